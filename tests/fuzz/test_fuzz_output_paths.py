"""Fuzzed output paths: every command that writes, given a path it could not write (a file where a directory is
meant and the reverse, a parent under a file, ``/proc`` and ``/sys``, a symbolic link loop, a broken link, an
empty or blank name, a read-only folder where one can be made), stops at start-up: exit code 2, exactly one
``error:`` line naming the flag, no traceback, nothing created, and the model never loaded.

The model loader is replaced by one that counts its calls and fails the test; ``--model`` also names a
folder that does not exist, so a load would end in another message anyway.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fuzz_helpers import examples
from hypothesis import assume, given
from hypothesis import strategies as st
from typer.testing import CliRunner

import sparseety.models
from sparseety.cli import app
from sparseety.store import write_trace
from sparseety.store.synthetic import synthetic_result

FILE, DIR = "file", "directory"
NO_MODEL = "/no/such/model"


@dataclass(frozen=True)
class Writer:
    """One flag of one command that names a path written to."""

    flag: str
    kind: str  #: FILE or DIR
    suffix: str  #: what a file name must end in for the command to accept it (learn-policy: .safetensors)
    argv: Callable[[dict[str, str], str], list[str]]  #: (fixtures, path) -> the command line


WRITERS: dict[str, Writer] = {
    "learn-policy -o": Writer("-o", FILE, ".safetensors",
                              lambda e, p: ["learn-policy", e["dataset"], "-o", p, "--model", NO_MODEL]),
    "learn-policy --target kvzip -o": Writer("-o", FILE, ".safetensors", lambda e, p: [
        "learn-policy", e["dataset"], "--target", "kvzip", "-o", p, "--model", NO_MODEL]),
    "learn-importance -o": Writer("-o", FILE, ".json",
                                  lambda e, p: ["learn-importance", e["text"], "-o", p, "--model", NO_MODEL]),
    "bench passkey --out": Writer("--out", DIR, "", lambda e, p: ["bench", "passkey", "--out", p, "--model", NO_MODEL]),
    "bench faithfulness -o": Writer("-o", DIR, "", lambda e, p: [
        "bench", "faithfulness", "--text", e["text"], "-o", p, "--model", NO_MODEL]),
    "bench ruler -o": Writer("-o", DIR, "", lambda e, p: ["bench", "ruler", "-o", p, "--model", NO_MODEL]),
    "tune --out": Writer("--out", FILE, ".json", lambda e, p: [
        "tune", "--policy", "streaming", "--metric", "top1_agreement", "--threshold", "0.9", "--prompt", "Hi",
        "--out", p, "--model", NO_MODEL]),
    "report -o": Writer("-o", FILE, ".html", lambda e, p: ["report", e["dataset"], "-o", p]),
    "report --png": Writer("--png", DIR, "", lambda e, p: ["report", e["dataset"], "--png", p]),
    "export -o": Writer("-o", FILE, ".jsonl", lambda e, p: ["export", "--trace-dir", e["dataset"], "-o", p]),
    "run --trace-dir": Writer("--trace-dir", DIR, "", lambda e, p: [
        "run", "--prompt", "Hi", "--trace-dir", p, "--model", NO_MODEL]),
    "run --jsonl": Writer("--jsonl", FILE, ".jsonl", lambda e, p: [
        "run", "--prompt", "Hi", "--trace-dir", e["fresh"], "--jsonl", p, "--model", NO_MODEL]),
    "run --batch-file --trace-dir": Writer("--trace-dir", DIR, "", lambda e, p: [
        "run", "--batch-file", e["batch"], "--trace-dir", p, "--model", NO_MODEL]),
    "compare --trace-dir": Writer("--trace-dir", DIR, "", lambda e, p: [
        "compare", "--prompt", "Hi", "--policy", "streaming", "--budget", "8", "--trace-dir", p, "--model", NO_MODEL]),
    "serve --trace-dir": Writer("--trace-dir", DIR, "", lambda e, p: ["serve", "--trace-dir", p, "--model", NO_MODEL]),
}

#: bad path kinds: (sandbox, writer, leaf name) -> (path, words the error line must hold)
KINDS: dict[str, Callable[[Path, Writer, str], tuple[str, str]]] = {
    "empty": lambda s, w, leaf: ("", "is empty"),
    "blank": lambda s, w, leaf: ("  ", "is empty"),
    "wrong type": lambda s, w, leaf: (
        (str(s / "afile"), "is not a directory") if w.kind == DIR else
        (str(s / f"adir{w.suffix}"), "is a directory; give a file name")),
    "trailing slash": lambda s, w, leaf: (
        (str(s / "afile") + "/", "is not a directory") if w.kind == DIR else
        (str(s / f"new{w.suffix}") + "/", "ends in '/'")),
    "under a file": lambda s, w, leaf: (str(s / "afile" / f"{leaf}{w.suffix}"), "afile is a file, not a directory"),
    "missing parent under a file": lambda s, w, leaf: (str(s / "afile" / "missing" / f"{leaf}{w.suffix}"),
                                                       "afile is a file, not a directory"),
    "/proc": lambda s, w, leaf: (f"/proc/sparseety-{leaf}{w.suffix}", "inside /proc, a pseudo file system"),
    "/proc/self": lambda s, w, leaf: (f"/proc/self/{leaf}{w.suffix}", "inside /proc, a pseudo file system"),
    "/sys": lambda s, w, leaf: (f"/sys/{leaf}{w.suffix}", "inside /sys, a pseudo file system"),
    "link loop": lambda s, w, leaf: (str(s / f"loop{w.suffix}"), "is a symbolic link loop"),
    "under a link loop": lambda s, w, leaf: (str(s / "loop" / f"{leaf}{w.suffix}"), "loop is a symbolic link loop"),
    "broken link": lambda s, w, leaf: (str(s / f"dangling{w.suffix}"), "is a broken symbolic link"),
    "read-only (immutable)": lambda s, w, leaf: (
        (str(s / "immutable"), "is not writable") if w.kind == DIR else
        (str(s / "immutable" / f"{leaf}{w.suffix}"), "cannot be created in")),
    "read-only (mount)": lambda s, w, leaf: (
        (str(s / "ro"), "is not writable: Read-only file system") if w.kind == DIR else
        (str(s / "ro" / f"{leaf}{w.suffix}"), "Read-only file system")),
}
NEEDS = {"read-only (immutable)": "immutable", "read-only (mount)": "ro"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Iterator[tuple[Path, dict[str, str], set[str]]]:
    """The sandbox of bad paths, the fixtures every command line needs, and which read-only kinds work here."""
    root = tmp_path_factory.mktemp("outputs")
    box = root / "box"
    box.mkdir()
    (box / "afile").write_text("a file, not a folder")
    for suffix in {w.suffix for w in WRITERS.values()}:
        (box / f"adir{suffix}").mkdir(exist_ok=True)
        for name in ("loop", "dangling"):
            link = box / f"{name}{suffix}"
            link.symlink_to(link if name == "loop" else box / "nowhere")
    dataset = root / "traces"
    write_trace(synthetic_result(0, tier=3, prompt_len=40), dataset)  # enough for every learn-policy target
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (root / "batch.jsonl").write_text('{"prompt": "Hi"}\n')
    fixtures = {"dataset": str(dataset), "text": str(root / "text.txt"), "batch": str(root / "batch.jsonl"),
                "fresh": str(root / "fresh-traces")}
    usable: set[str] = set()
    with contextlib.ExitStack() as stack:
        (box / "immutable").mkdir()
        if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(box / "immutable")],
                                                     capture_output=True).returncode == 0:
            usable.add("immutable")
            stack.callback(subprocess.run, ["chattr", "-i", str(box / "immutable")], check=True)
        elif os.geteuid() != 0:  # permission bits stop everyone but root
            (box / "immutable").chmod(0o555)
            usable.add("immutable")
            stack.callback((box / "immutable").chmod, 0o755)
        (box / "ro").mkdir()
        if shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                                     str(box / "ro")], capture_output=True).returncode == 0:
            usable.add("ro")
            stack.callback(subprocess.run, ["umount", str(box / "ro")], check=True)
        yield box, fixtures, usable


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Every model load attempted (each also fails the command)."""
    calls: list[str] = []

    def load_model(name, *args, **kwargs):
        calls.append(str(name))
        raise AssertionError(f"the model {name} was loaded before the output path was checked")

    monkeypatch.setattr(sparseety.models, "load_model", load_model)
    return calls


def listing(box: Path) -> set[str]:
    return {str(p) for p in box.rglob("*") if not str(p).startswith(str(box / "ro"))}


def can_make(kind: str, sandbox) -> bool:
    return kind not in NEEDS or NEEDS[kind] in sandbox[2]


def check_refused(writer_name: str, kind: str, leaf: str, sandbox, loads: list[str]) -> None:
    box, fixtures, _ = sandbox
    writer = WRITERS[writer_name]
    path, words = KINDS[kind](box, writer, leaf)
    before = listing(box)
    with contextlib.chdir(box.parent):  # an empty path must not land in the checkout either
        result = CliRunner().invoke(app, writer.argv(fixtures, path))
    assert result.exit_code == 2, (writer_name, kind, path, result.output, result.exception)
    assert "Traceback" not in result.output and not isinstance(result.exception, AssertionError), result.output
    lines = [line for line in result.stderr.splitlines() if not line.startswith("threads: ")]  # a batch's notice
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    errors = lines
    assert writer.flag in errors[0] and words in errors[0], (writer_name, kind, errors[0])
    assert loads == [], loads
    assert listing(box) == before  # nothing created, nothing computed
    assert not (box.parent / "_sparseety_dataset.json").exists()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_refuses_every_bad_path_kind_before_the_model_loads(writer: str, kind: str, sandbox, loads):
    if not can_make(kind, sandbox):
        pytest.skip(f"{kind}: cannot be made here")
    check_refused(writer, kind, "x", sandbox, loads)


LEAVES = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters=" _-.é€"), min_size=1,
                 max_size=16).filter(lambda s: s.strip(" .") != "" and not s.endswith("/"))


@examples(80)
@given(writer=st.sampled_from(sorted(WRITERS)), kind=st.sampled_from(sorted(KINDS)), leaf=LEAVES)
def test_fuzzed_bad_output_paths_never_start_work(writer: str, kind: str, leaf: str, sandbox, loads):
    assume(can_make(kind, sandbox))
    loads.clear()
    check_refused(writer, kind, leaf, sandbox, loads)
