"""Every benchmark script imports, and so does every module it imports, without vLLM or a model.

The scripts under ``benchmarks/`` run as modules (``python -m benchmarks.NAME``, benchmarks/README.md) and
import each other, ``benchmarks/common.py`` and the package with no ``sys.path`` entries. A script imports most
of what it needs inside ``main`` (after its flags are read, or only on one side of a side venv), so importing it
is not enough: every import statement in it, at any depth, must name a module that exists here (or one of the
side venvs' packages in :data:`SIDE_VENV`), and every name it takes from a module of this repository must be
there. ``--help`` of each must work without loading anything.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: packages only the side venvs have: vLLM's (``.venv-vllm``) and kvpress's (``benchmarks/.kvpress-venv``,
#: with the vendored ``benchmarks/third_party/kvzap``)
SIDE_VENV = frozenset({"vllm", "kvpress", "kvzap"})
OURS = ("benchmarks", "sparseety")


def _modules() -> list[str]:
    paths = sorted(p for p in (ROOT / "benchmarks").rglob("*.py")
                   if "third_party" not in p.parts and p.name != "__init__.py")
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths]


MODULES = _modules()
SCRIPTS = [m for m in MODULES if m != "benchmarks.common"]


@pytest.fixture(autouse=True)
def _root_on_path(monkeypatch):
    """The repository root, as ``python -m`` there puts it (pytest may be started elsewhere)."""
    monkeypatch.syspath_prepend(str(ROOT))


def _imports(module: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names taken from it)`` of every absolute import statement in ``module``'s file."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return out


def test_every_script_is_found():
    assert len(SCRIPTS) >= 25 and "benchmarks.vllm_importance_cost" in SCRIPTS
    assert "benchmarks.learned_policy_bench" in SCRIPTS and "benchmarks.learned_policy" not in SCRIPTS


@pytest.mark.parametrize("module", MODULES)
def test_the_module_imports(module):
    imported = importlib.import_module(module)
    assert module == "benchmarks.common" or callable(getattr(imported, "main", None))


@pytest.mark.parametrize("module", MODULES)
def test_every_import_in_it_resolves(module):
    missing = []
    for line, target, names in _imports(module):
        if target.split(".")[0] in SIDE_VENV:
            continue
        spec = importlib.util.find_spec(target)
        if spec is None:
            missing.append(f"line {line}: no module {target}")
        elif spec.origin and TESTS in Path(spec.origin).parents:  # on the path only when pytest put it there
            missing.append(f"line {line}: {target} is a module of the tests")
        elif target.split(".")[0] in OURS:
            found = importlib.import_module(target)
            missing += [f"line {line}: {target} has no {name}" for name in names
                        if not hasattr(found, name) and importlib.util.find_spec(f"{target}.{name}") is None]
    assert not missing, f"{module}:\n" + "\n".join(missing)


@pytest.mark.parametrize("module", SCRIPTS)
def test_help_needs_no_model(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main()
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_no_script_edits_sys_path():
    """Scripts import each other as modules of ``benchmarks``; the one entry left puts kvpress's vendored
    ``kvzap/`` source tree on the path of the worker that runs in kvpress's venv."""
    allowed = {("benchmarks.kvpress_kvzap_train", "sys.path.insert(0, str(THIRD_PARTY))")}
    found = {(m, line.strip()) for m in MODULES
             for line in (ROOT / Path(*m.split("."))).with_suffix(".py").read_text(encoding="utf-8").splitlines()
             if "sys.path" in line and not line.strip().startswith("#")}
    assert found <= allowed, sorted(found - allowed)


#: scripts that start themselves as a worker in a side venv, as a script there (``python FILE --worker ...``),
#: so what they import at the top must be there: the standard library in kvpress's venv, which has no
#: sparseety; ``True``: vLLM's venv, which has sparseety installed (the launcher it imports is stdlib only)
SIDE_VENV_SCRIPTS = {"benchmarks/kvpress_compare.py": False, "benchmarks/kvpress_kvzap_train.py": False,
                     "benchmarks/studies/kvpress_scores_check.py": False, "benchmarks/vllm_compare.py": True}


@pytest.mark.parametrize("script", SIDE_VENV_SCRIPTS)
def test_a_side_venv_worker_starts_as_a_script(script):
    env = {"PATH": os.environ.get("PATH", "")} | ({"PYTHONPATH": str(ROOT / "src")} if SIDE_VENV_SCRIPTS[script] else {})
    # -S: no site-packages, so nothing installed in this venv is found; run as a file, as the worker is
    done = subprocess.run([sys.executable, "-S", str(ROOT / script), "--help"], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
