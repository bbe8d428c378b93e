"""``sparseety traces check``: find damaged, orphaned and abandoned files; ``--repair`` quarantines them.

Quarantined files move to ``<root>/_quarantine/`` under their dataset-relative path, where no reader
looks; nothing is deleted, so a person can inspect or restore them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sparseety.store.dataset import QUARANTINE, open_dataset
from sparseety.store.scan import GRACE_S, Scan, scan_dataset


@dataclass
class CheckResult:
    """A deep scan of a dataset and, after a repair, where each file went."""

    scan: Scan
    moved: list[tuple[Path, Path]] = field(default_factory=list)

    @property
    def problems(self) -> int:
        """How many damaged, orphaned and abandoned files the scan found."""
        return len(self.scan.damaged) + len(self.scan.orphaned) + len(self.scan.abandoned)


def check_dataset(trace_dir: str | Path, *, repair: bool = False, grace_s: float = GRACE_S,
                  now: float | None = None) -> CheckResult:
    """Scan every file of the dataset (decoding each); with ``repair`` quarantine what is wrong."""
    root = open_dataset(trace_dir)
    result = CheckResult(scan=scan_dataset(root, grace_s=grace_s, now=now, deep=True))
    if repair:
        bad = [d.path for d in result.scan.damaged] + result.scan.orphaned + result.scan.abandoned
        result.moved = [(path, quarantine(root, path)) for path in bad]
    return result


def quarantine(root: Path, path: Path) -> Path:
    """Move ``path`` (inside ``root``) into the quarantine folder; returns its new path."""
    target = root / QUARANTINE / path.relative_to(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = target, 1
    while candidate.exists():
        candidate = target.with_name(f"{target.name}.{n}")
        n += 1
    os.replace(path, candidate)
    return candidate
