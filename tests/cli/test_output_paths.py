"""No finished work is lost to a bad output path (issue 37, item 1): the commands that fit or benchmark for
minutes check their output at start-up, before the model loads, with one ``error:`` line (exit 2); and a save
that still fails after the work puts the result in a fallback file and names it (exit 1).

The model loader is replaced by one that fails the test, so a check made only at save time shows up as a
loaded model rather than as the error line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tiny_models import build_model, build_tokenizer  # noqa: E402

import sparseety.models  # noqa: E402
from sparseety.suites.resume import write_document  # noqa: E402
from sparseety.cli import app  # noqa: E402
from sparseety.errors import InputError, OutputSavedElsewhere  # noqa: E402
from sparseety.extract.head_weights import read_head_weights  # noqa: E402
from sparseety.integrations.vllm.transport.settings import check_trace_dir as vllm_check  # noqa: E402
from sparseety.output_paths import DIRECTORY, FILE, check_output, save_or_salvage  # noqa: E402
from sparseety.store import write_trace  # noqa: E402
from sparseety.store.synthetic import synthetic_result  # noqa: E402


@pytest.fixture
def no_model(monkeypatch) -> list[str]:
    loads: list[str] = []

    def load_model(name, *args, **kwargs):
        loads.append(str(name))
        raise AssertionError(f"model {name} loaded before the output path was checked")

    monkeypatch.setattr(sparseety.models, "load_model", load_model)
    return loads


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A file, a directory, a folder nothing can be created in (``chattr +i``; root ignores permission bits),
    a symbolic link loop, a trace dataset and a text."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "dir").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    write_trace(synthetic_result(0, tier=3, prompt_len=40), tmp_path / "traces")  # long enough for --target kvzip
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(ro)]).returncode != 0:
        ro = None
    yield {"tmp": tmp_path, "ro": ro}
    if ro is not None and os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(ro)], check=True)


def one_error(result, *parts: str) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


FINDINGS = [  # issue 37 item 1: (command line with {t} for the sandbox, words the error must hold)
    (["learn-policy", "{t}/traces", "--target", "kvzip", "-o", "{t}/afile/x.safetensors"],
     "-o {t}/afile/x.safetensors cannot be created: {t}/afile is a file, not a directory"),
    (["learn-policy", "{t}/traces", "--target", "kvzip", "-o", "{t}/dir.safetensors"],
     "-o {t}/dir.safetensors is a directory; give a file name"),
    (["learn-policy", "{t}/traces", "--target", "kvzip", "-o", "{ro}/x.safetensors"],
     "-o {ro}/x.safetensors cannot be created in {ro}: "),
    (["learn-policy", "{t}/traces", "-o", "{t}/afile/x.safetensors"], "{t}/afile is a file, not a directory"),
    (["learn-policy", "{t}/traces", "-o", "{t}/dir.safetensors"], "is a directory; give a file name"),
    (["learn-policy", "{t}/traces", "-o", "{ro}/x.safetensors"], "cannot be created in {ro}: "),
    (["learn-importance", "{t}/text.txt", "-o", "{ro}/w.json"], "-o {ro}/w.json cannot be created in {ro}: "),
    (["learn-importance", "{t}/text.txt", "-o", "{t}/afile/w.json"], "{t}/afile is a file, not a directory"),
    (["learn-importance", "{t}/text.txt", "-o", "{t}/dir/"], "{t}/dir/ ends in '/', a directory; give a file name"),
    (["learn-importance", "{t}/text.txt", "-o", "{t}/dir"], "-o {t}/dir is a directory; give a file name"),
    (["learn-importance", "{t}/text.txt", "-o", "{t}/newdir/"], "{t}/newdir/ ends in '/', a directory"),
    (["bench", "faithfulness", "--text", "{t}/text.txt", "-o", "{t}/afile"], "-o {t}/afile is not a directory"),
    (["bench", "faithfulness", "--text", "{t}/text.txt", "-o", "/proc/x"],
     "-o /proc/x is inside /proc, a pseudo file system"),
    (["bench", "faithfulness", "--text", "{t}/text.txt", "-o", "{ro}"], "-o {ro} is not writable: "),
    (["bench", "passkey", "--out", "{t}/afile"], "--out {t}/afile is not a directory"),
    (["bench", "ruler", "-o", "{t}/afile"], "-o {t}/afile is not a directory"),
    (["bench", "ruler", "-o", "{t}/loop"], "-o {t}/loop is a symbolic link loop"),
    (["tune", "--policy", "streaming", "--metric", "top1_agreement", "--threshold", "0.9", "--prompt", "Hi",
      "--out", "{t}/dir"], "--out {t}/dir is a directory; give a file name"),
]


@pytest.mark.parametrize("argv, words", FINDINGS, ids=[" ".join(a[:2]) + f" {i}" for i, (a, _) in enumerate(FINDINGS)])
def test_a_bad_output_is_refused_before_the_model_loads(argv, words, places, no_model):
    if places["ro"] is None and any("{ro}" in a for a in argv):
        pytest.skip("no read-only folder can be made here")
    fill = {"t": str(places["tmp"]), "ro": str(places["ro"])}
    args = [a.format(**fill) for a in argv]
    if args[0] != "learn-policy":
        args += ["--model", "/no/such/model"]
    before = sorted(places["tmp"].rglob("*"))
    one_error(CliRunner().invoke(app, args), words.format(**fill))
    assert no_model == [] and sorted(places["tmp"].rglob("*")) == before


def test_the_check_names_each_cause_and_creates_nothing(tmp_path: Path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    refused = {
        ("", FILE): "-o is empty; give a file name",
        (" ", DIRECTORY): "-o is empty; give a directory",
        (f"{tmp_path}/afile/x", FILE): f"-o {tmp_path}/afile/x cannot be created: {tmp_path}/afile is a file, not a "
                                       "directory",
        (f"{tmp_path}/afile/a/b", DIRECTORY): f"-o {tmp_path}/afile/a/b cannot be created: {tmp_path}/afile is a file",
        (f"{tmp_path}", FILE): f"-o {tmp_path} is a directory; give a file name",
        (f"{tmp_path}/afile", DIRECTORY): f"-o {tmp_path}/afile is not a directory",
        (f"{tmp_path}/loop", DIRECTORY): f"-o {tmp_path}/loop is a symbolic link loop",
        (f"{tmp_path}/loop/x", FILE): f"-o {tmp_path}/loop/x cannot be used: {tmp_path}/loop is a symbolic link loop",
        (f"{tmp_path}/dangling", FILE): f"-o {tmp_path}/dangling is a broken symbolic link (to {tmp_path}/nowhere)",
        ("/proc/x", FILE): "-o /proc/x is inside /proc, a pseudo file system that keeps no files",
        ("/proc/self/cwd", DIRECTORY): "-o /proc/self/cwd is inside /proc",  # written there, though it leads out
        ("/sys/kernel", DIRECTORY): "-o /sys/kernel is inside /sys",
        ("/dev/null", FILE): "-o /dev/null is not a regular file",
        ("a\0b", FILE): "-o 'a\\x00b' cannot be used: embedded null byte",
    }
    for (path, kind), message in refused.items():
        with pytest.raises(InputError) as info:
            check_output(path, kind, "-o")
        assert str(info.value).startswith(message), (path, str(info.value))
    assert check_output(tmp_path / "new" / "deeper" / "w.json", FILE, "-o") == tmp_path / "new" / "deeper" / "w.json"
    assert check_output(tmp_path / "afile", FILE, "-o") == tmp_path / "afile"  # an existing file is replaced
    check_output(tmp_path / "new-dir", DIRECTORY, "-o")
    with pytest.raises(InputError, match=r"-o .* MiB free, less than the 1048576 MiB it must have"):
        check_output(tmp_path, DIRECTORY, "-o", min_free=1 << 40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling", "loop"]


def test_a_read_only_mount_is_refused(tmp_path: Path):
    """As root, permission bits stop nothing; a read-only tmpfs does (skipped where mounting is not allowed)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(InputError, match=f"^--trace-dir {ro} is not writable: Read-only file system$"):
            check_output(ro, DIRECTORY, "--trace-dir")
        with pytest.raises(InputError, match=f"^-o {ro}/a/w.json cannot be created in {ro}: Read-only file system$"):
            check_output(ro / "a" / "w.json", FILE, "-o")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_the_vllm_observer_uses_the_same_check(tmp_path: Path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert vllm_check(str(tmp_path / "loop")) == f"SPARSEETY_TRACE_DIR='{tmp_path / 'loop'}' is a symbolic link loop"
    assert vllm_check("/proc/x").startswith("SPARSEETY_TRACE_DIR='/proc/x' is inside /proc")
    assert vllm_check(str(tmp_path / "new")) is None and (tmp_path / "new").is_dir()  # the observer creates it


def test_a_save_that_fails_after_the_work_lands_in_a_fallback(tmp_path: Path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "r.json").mkdir()  # a folder appeared where the file goes: the file lands next to it
    with pytest.raises(OutputSavedElsewhere) as info:
        write_document(folder / "r.json", {"kind": "tune", "complete": True})
    spare = info.value.fallback
    assert spare.parent == folder and spare.name.startswith("r.salvaged-") and spare.suffix == ".json"
    assert json.loads(spare.read_text()) == {"kind": "tune", "complete": True}
    assert str(info.value) == (f"cannot write {folder}/r.json: Is a directory; saved the result to {spare} "
                               "instead")
    shutil.rmtree(folder)
    folder.write_text("the folder was replaced by a file")  # nothing next to it either: the system temp folder
    with pytest.raises(OutputSavedElsewhere) as info:
        save_or_salvage(folder / "w.bin", lambda p: Path(p).write_bytes(b"\x01\x02"), what="the weights", flag="-o")
    spare = info.value.fallback
    try:
        assert spare.read_bytes() == b"\x01\x02" and spare.parent.samefile(tempfile.gettempdir())
        assert f"saved the weights to {spare} instead" in str(info.value)
        assert str(info.value).startswith(f"cannot write -o {folder}/w.bin: ")
    finally:
        spare.unlink()


def test_nowhere_to_save_names_every_reason(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "afile"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match=r"^cannot write .*w.bin: .*; the result could not be saved elsewhere "
                                         r"either \(.*afile: .*; .*afile: .*\)$"):
        save_or_salvage(tmp_path / "afile" / "w.bin", lambda p: Path(p).write_bytes(b"x"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    build_model("llama").save_pretrained(root / "llama")
    build_tokenizer().save_pretrained(root / "llama")
    text = root / "text.txt"
    text.write_text("\n".join(" ".join(f"t{5 + (3 * j + w) % 150}" for w in range(6)) for j in range(12)))
    return {"model": root / "llama", "text": text}


def test_a_fit_whose_folder_vanished_is_saved_in_the_temp_folder(tiny, tmp_path: Path, monkeypatch):
    """learn-importance: the output folder is replaced by a file while the fit runs; the weights land in a
    temporary file the error line names (exit 1), and that file is a valid weights file."""
    import sparseety.training.head_weights as fit

    out = tmp_path / "out" / "w.json"
    out.parent.mkdir()
    real = fit.learn_head_weights

    def fit_then_break(*args, **kwargs):
        weights = real(*args, **kwargs)
        shutil.rmtree(tmp_path / "out")
        (tmp_path / "out").write_text("no longer a folder")
        return weights

    monkeypatch.setattr(fit, "learn_head_weights", fit_then_break)
    result = CliRunner().invoke(app, ["learn-importance", str(tiny["text"]), "-o", str(out), "--model",
                                      str(tiny["model"]), "--tokens", "20", "--max-new-tokens", "2", "--ablations",
                                      "2", "--steps", "5", "--quiet"])
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write -o {out}: "), result.stderr
    spare = Path(lines[0].split("saved the weights to ")[1].removesuffix(" instead"))
    try:
        weights = read_head_weights(spare)
        assert weights.provenance["texts"] == [str(tiny["text"])] and tuple(weights.weights.shape) == (4, 4)
    finally:
        spare.unlink()
