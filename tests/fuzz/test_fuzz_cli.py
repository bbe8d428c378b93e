"""Fuzzed command lines: any mix of known flags with hostile values, unknown flags and junk arguments
is handled (exit 0/1/2, one ``error:`` line on failure, never a traceback), and never loads a model."""

from __future__ import annotations

import contextlib

from pathlib import Path

import pytest
from fuzz_helpers import assert_clean, examples
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import write_trace
from sparseety.store.synthetic import synthetic_result

NUMBERS = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "0", "-1", "0x10", "1_000", "", " ", "١٢"]),
)
JUNK = st.one_of(st.text(max_size=30), st.sampled_from(["--", "-", "--x", "'; DROP TABLE requests; --", "\x00",
                                                         "../../etc/passwd", "a" * 500]))
VALUE = st.one_of(NUMBERS, JUNK)

#: commands that finish without a model, with the flags they take
FAST = {
    ("traces", "list"): ["--limit", "--json"],
    ("traces", "show"): ["--json"],
    ("traces", "check"): ["--grace", "--json", "--repair"],
    ("query",): ["--format"],
    ("export",): ["--format", "--table", "--request-id", "-o"],
    ("gc",): ["--older-than", "--grace", "--dry-run"],
    ("policies", "list"): [],
    ("models", "list"): [],
}
#: commands that load a model; fuzzed only with a numeric flag out of its range, which must stop them first
MODEL = {
    ("run",): ["--budget", "--max-new-tokens", "--top-k", "--seed", "--speculative", "--attention-topk"],
    ("compare",): ["--budget", "--max-new-tokens", "--top-k", "--seed"],
    ("tune",): ["--min-budget", "--max-budget", "--step", "--max-new-tokens", "--seed"],
    ("bench", "passkey"): ["--max-new-tokens", "--seed", "--attention-topk"],
}
FLAGS_WITHOUT_VALUE = {"--json", "--repair", "--dry-run"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-cli")
    for i in range(2):
        write_trace(synthetic_result(i), root)
    return root


@st.composite
def fast_argv(draw) -> list[str]:
    command = draw(st.sampled_from(sorted(FAST)))
    argv = list(command)
    if command == ("traces", "show"):
        argv.append(draw(JUNK.filter(lambda s: not s.startswith("-"))))
    if command == ("query",):
        argv.append(draw(st.one_of(JUNK, st.sampled_from(["SELECT 1", "SELECT count(*) FROM requests",
                                                          "COPY requests TO 'x.csv'", "SELECT 1; SELECT 2",
                                                          "SELECT * FROM read_text('/etc/hostname')"]))))
    for flag in draw(st.lists(st.sampled_from(FAST[command] + ["--nope"]), max_size=4)):
        argv.append(flag)
        if flag not in FLAGS_WITHOUT_VALUE:
            argv.append(draw(VALUE))
    return argv


@examples(120)
@given(argv=fast_argv())
def test_fast_commands_never_trace_back(argv: list[str], dataset: Path, tmp_path_factory):
    out_dir = tmp_path_factory.getbasetemp()
    argv = [a.replace("x.csv", str(out_dir / "x.csv")) for a in argv]
    if argv[0] not in ("policies", "models"):
        argv += ["--trace-dir", str(dataset)]
    with contextlib.chdir(out_dir):  # a relative -o lands in a temporary folder, never in the checkout
        assert_clean(CliRunner().invoke(app, argv))


@examples(60)
@given(data=st.data())
def test_model_commands_stop_at_a_bad_number_before_loading(data, tmp_path_factory):
    command = data.draw(st.sampled_from(sorted(MODEL)))
    flag = data.draw(st.sampled_from(MODEL[command]))
    value = data.draw(st.one_of(st.integers(min_value=2**40, max_value=10**40), st.integers(max_value=-1))
                      .map(str) | st.sampled_from(["nan", "inf", "-inf", "abc", ""]))
    argv = [*command, "--model", str(tmp_path_factory.getbasetemp() / "no-model-here"), flag, value]
    if command in (("run",), ("compare",), ("tune",)):
        argv += ["--prompt", "hi"]
    if command == ("tune",):
        argv += ["--policy", "h2o", "--metric", "mean_kl", "--threshold", "0.1"]
    result = CliRunner().invoke(app, argv)
    assert_clean(result)
    assert result.exit_code == 2 and "cannot load model" not in result.stderr  # refused before any load
