"""The commit log of a trace dataset: a small JSON manifest per committed batch, written last.

A batch's Parquet files are renamed into place first and its manifest
``<root>/_commits/commit-<uuid>.json`` (the dataset-relative paths of those files) after them, so a
batch is visible to readers all at once or not at all: readers take only files some manifest names.
Datasets written before the commit log (marker without ``commit_log``) have every file committed.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from sparseety.errors import RecordError

COMMITS_DIR = "_commits"  #: the manifests' folder, also the marker's ``commit_log`` value
MANIFEST_PREFIX = "commit-"
MANIFEST_FORMAT = "sparseety-commit"


def manifest_paths(root: Path) -> list[Path]:
    """The committed manifests of the dataset at ``root``."""
    return sorted((root / COMMITS_DIR).glob(f"{MANIFEST_PREFIX}*.json"))


def write_manifest(root: Path, files: list[Path]) -> Path:
    """Commit ``files`` (inside ``root``) by writing their manifest atomically; returns its path."""
    folder = root / COMMITS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{MANIFEST_PREFIX}{uuid.uuid4().hex}.json"
    final, tmp = folder / name, folder / f".{name}.tmp"
    payload = {"format": MANIFEST_FORMAT, "files": [p.relative_to(root).as_posix() for p in files]}
    try:
        with open(tmp, "wb") as handle:
            handle.write(json.dumps(payload).encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def read_manifest(path: Path) -> list[str]:
    """The dataset-relative file paths ``path`` commits.

    Raises
    ------
    RecordError
        The manifest is unreadable or not a sparseety commit manifest.
    """
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordError(f"commit manifest {path} is unreadable: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != MANIFEST_FORMAT:
        raise RecordError(f"commit manifest {path} is not a sparseety commit manifest")
    files = payload.get("files")
    if not isinstance(files, list) or not all(_inside(f) for f in files):
        raise RecordError(f"commit manifest {path} names files outside its dataset")
    return files


def _inside(name: object) -> bool:
    return isinstance(name, str) and bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts
