"""Retention: delete date partitions older than a period (``sparseety gc --older-than 7d``)."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from sparseety.errors import InputError
from sparseety.store.dataset import TEMP_PREFIX, open_dataset
from sparseety.store.tables import TABLES

_PERIOD = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
STALE_TEMP_S = 3600.0
"""A temporary file this old was left by a writer that died mid-write; gc removes it."""


def parse_period(text: str) -> timedelta:
    """``"7d"`` -> 7 days; units ``s``, ``m``, ``h``, ``d``, ``w``; a clear :class:`InputError` otherwise."""
    match = _PERIOD.match(str(text))
    if not match:
        raise InputError(f"retention period must be a number and a unit (s, m, h, d, w), like 7d or 12h; got {text!r}")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


@dataclass
class GcResult:
    """What :func:`collect_garbage` removed (or, dry run, would remove)."""

    cutoff: datetime
    partitions: list[Path] = field(default_factory=list)
    files: int = 0
    stale_temp_files: list[Path] = field(default_factory=list)


def collect_garbage(trace_dir: str | Path, older_than: timedelta, *, now: datetime | None = None,
                    dry_run: bool = False) -> GcResult:
    """Delete every ``date=`` partition whose whole day lies before ``now - older_than``.

    Also removes temporary files older than :data:`STALE_TEMP_S` (left by killed writers).
    """
    root = open_dataset(trace_dir)
    now = now or datetime.now(UTC)
    cutoff = now - older_than
    result = GcResult(cutoff=cutoff)
    for table in TABLES:
        for folder in sorted((root / table).glob("date=*")):
            day = _day(folder)
            if day is None or datetime.combine(day + timedelta(days=1), datetime.min.time(), UTC) > cutoff:
                continue
            result.partitions.append(folder)
            result.files += sum(1 for _ in folder.glob("part-*.parquet"))
            if not dry_run:
                shutil.rmtree(folder)
        for temp in sorted((root / table).glob(f"date=*/{TEMP_PREFIX}*.tmp")):
            if time.time() - temp.stat().st_mtime >= STALE_TEMP_S:
                result.stale_temp_files.append(temp)
                if not dry_run:
                    temp.unlink(missing_ok=True)
    return result


def _day(folder: Path) -> date | None:
    try:
        return date.fromisoformat(folder.name.removeprefix("date="))
    except ValueError:
        return None
