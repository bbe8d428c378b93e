"""Regenerate the shipped ``--importance learned`` weights of the default model.

Training text is never what ``bench faithfulness`` evaluates on (six licence texts under
/usr/share/common-licenses): it is the long module docstrings of the Python standard library plus the
two licence texts that are not variants of the evaluated ones (BSD, CC0-1.0). The docstrings are
written to ``--texts-dir`` (a scratch folder in the system's temporary folder by default, rewritten on
every run) and handed to ``sparseety learn-importance``.

    python -m sparseety.training.shipped_head_weights   # writes src/sparseety/extract/weights/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parents[1] / "extract" / "weights"  #: the shipped weights (read at run time)
TEXTS_DIR = Path(tempfile.gettempdir()) / "sparseety-head-weights-texts"  #: scratch, never committed
MODULES = ("re", "configparser", "turtle", "sys", "wave", "statistics", "csv", "cmd", "argparse", "json",
           "socket", "timeit", "hashlib", "pydoc", "copy", "heapq")
LICENCES = (Path("/usr/share/common-licenses/BSD"), Path("/usr/share/common-licenses/CC0-1.0"))


def write_texts(folder: Path, modules: tuple[str, ...] = MODULES) -> list[Path]:
    """One file per module docstring (and the licence texts that exist): the training passages."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in modules:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        path = folder / f"doc-{name}.txt"
        path.write_text(doc + "\n", encoding="utf-8")
        paths.append(path)
    return paths + [p for p in LICENCES if p.is_file()]


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}" if __spec__ else None,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=WEIGHTS / "smollm2-135m.json")
    parser.add_argument("--texts-dir", type=Path, default=TEXTS_DIR,
                        help="Scratch folder the training texts are written to (default: %(default)s, in the system's "
                             "temporary folder, outside the repository; rewritten on every run).")
    parser.add_argument("--count", type=int, default=10, help="Docstring modules used (the first N of MODULES).")
    parser.add_argument("--ablations", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    texts = write_texts(args.texts_dir, MODULES[: args.count])
    command = [str(Path(sys.executable).with_name("sparseety")), "learn-importance", *map(str, texts),
               "-o", str(args.out), "--model", args.model, "--ablations", str(args.ablations)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    print(" ".join(command), file=sys.stderr, flush=True)
    code = subprocess.call(command)
    if code == 0:  # name the texts, not this machine's paths
        document = json.loads(args.out.read_text(encoding="utf-8"))
        document["provenance"]["texts"] = [f"stdlib docstring {Path(t).stem[4:]}" if Path(t).name.startswith("doc-")
                                           else t for t in document["provenance"]["texts"]]
        document["provenance"]["regenerate"] = (f"python -m sparseety.training.shipped_head_weights "
                                                f"--count {args.count} --ablations {args.ablations}")
        args.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
