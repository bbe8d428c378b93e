"""Retention: delete date partitions older than a period (``sparseety gc --older-than 7d``), and what
killed writers left behind: temporary files and never-committed data files past a grace period, and
commit manifests whose files are all gone."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from sparseety.errors import InputError, RecordError
from sparseety.store.commits import manifest_paths, read_manifest
from sparseety.store.dataset import open_dataset
from sparseety.store.scan import GRACE_S, scan_dataset
from sparseety.store.tables import TABLES

_PERIOD = re.compile(r"^\s*(\d{1,12})\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_PERIOD = timedelta(days=365 * 1000)
"""The longest period accepted (a thousand years): beyond it dates overflow."""
STALE_TEMP_S = GRACE_S
"""A temporary file this old was left by a writer that died mid-write; gc removes it."""


def parse_period(text: str) -> timedelta:
    """``"7d"`` -> 7 days; units ``s``, ``m``, ``h``, ``d``, ``w``; a clear :class:`InputError` otherwise."""
    match = _PERIOD.match(str(text))
    if not match:
        raise InputError(f"retention period must be a number and a unit (s, m, h, d, w), like 7d or 12h; got {text!r}")
    seconds = int(match.group(1)) * _SECONDS[match.group(2)]
    if seconds > MAX_PERIOD.total_seconds():
        raise InputError(f"retention period {text!r} is too long: at most {MAX_PERIOD.days} days")
    return timedelta(seconds=seconds)


@dataclass
class GcResult:
    """What :func:`collect_garbage` removed (or, dry run, would remove)."""

    cutoff: datetime
    partitions: list[Path] = field(default_factory=list)
    files: int = 0
    stale_temp_files: list[Path] = field(default_factory=list)
    orphaned_files: list[Path] = field(default_factory=list)
    manifests: list[Path] = field(default_factory=list)


def collect_garbage(trace_dir: str | Path, older_than: timedelta, *, now: datetime | None = None,
                    dry_run: bool = False, grace: timedelta = timedelta(seconds=STALE_TEMP_S)) -> GcResult:
    """Delete every ``date=`` partition whose whole day lies before ``now - older_than``.

    Also removes temporary files and never-committed data files older than ``grace`` (left by killed
    writers), and commit manifests none of whose files remain.
    """
    root = open_dataset(trace_dir)
    now = now or datetime.now(UTC)
    cutoff = now - older_than
    result = GcResult(cutoff=cutoff)
    scan = scan_dataset(root, grace_s=grace.total_seconds(), now=now.timestamp())
    result.stale_temp_files, result.orphaned_files = scan.abandoned, scan.orphaned
    if not dry_run:
        for path in scan.abandoned + scan.orphaned:
            path.unlink(missing_ok=True)
    for table in TABLES:
        for folder in sorted((root / table).glob("date=*")):
            day = _day(folder)
            if day is None or datetime.combine(day + timedelta(days=1), datetime.min.time(), UTC) > cutoff:
                continue
            result.partitions.append(folder)
            result.files += sum(1 for _ in folder.glob("part-*.parquet"))
            if not dry_run:
                shutil.rmtree(folder)
    if not dry_run:
        for manifest in manifest_paths(root):
            try:
                names = read_manifest(manifest)
            except RecordError:  # a damaged manifest is `traces check`'s to report, not gc's to delete
                continue
            if not any((root / name).exists() for name in names):
                manifest.unlink(missing_ok=True)
                result.manifests.append(manifest)
    return result


def _day(folder: Path) -> date | None:
    try:
        return date.fromisoformat(folder.name.removeprefix("date="))
    except ValueError:
        return None
