"""Fuzzed run configuration files: any YAML text, and any mapping of known sections and keys with
hostile values, either loads or raises one ConfigError naming the problem; the command line turns it
into one ``error:`` line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import yaml
from fuzz_helpers import assert_clean, examples
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.config import ExtractionConfig
from sparseety.errors import ConfigError
from sparseety.run_file import RunFile

KEYS = {
    "model": ["path", "tokenizer_path", "max_new_tokens", "nope"],
    "sparsity": ["enabled", "policy", "kv_cache_limit", "ratio", "attention_topk", "token_pruning", "policy_opts"],
    "extraction": ["top_k", "min_score", "layers"],
    "logging": ["level", "output_file", "tier", "sample_rate"],
    "extra_section": ["x"],
}
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["h2o", "streaming", "dense", "auto", "all", "0,1,x", "8:0.3,16:0.5", "default", "INFO",
                     "/tmp", "", "1e400", ".nan"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


@st.composite
def run_files(draw) -> dict:
    doc = {}
    for section in draw(st.lists(st.sampled_from(sorted(KEYS)), max_size=4, unique=True)):
        keys = draw(st.lists(st.sampled_from(KEYS[section]), max_size=4, unique=True))
        doc[section] = {key: draw(VALUES) for key in keys} if draw(st.booleans()) or keys else draw(VALUES)
    return doc


@examples(200)
@given(doc=run_files())
def test_structured_run_files_load_or_name_the_problem(doc: dict, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "run.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        RunFile.load(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(path)) and "Traceback" not in str(exc)


@examples(150)
@given(text=st.one_of(st.text(max_size=200), st.sampled_from([
    "a: 1\na: 2\n", "model: {path: x, path: y}\n", "[1, 2", "!!python/object:os.system ls", "&a [*a]",
    "sparsity:\n  policy_opts:\n    k: 1\n    k: 2\n", "\t\x00", "- " * 200, "[" * 500 + "]" * 500])))
def test_any_text_loads_or_raises_config_error(text: str, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "any.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for loader in (RunFile.load, ExtractionConfig.from_yaml):
        try:
            loader(path)
        except ConfigError:
            pass


@examples(40)
@given(doc=run_files())
def test_a_bad_config_on_the_command_line_is_one_error_line(doc: dict, tmp_path_factory):
    path: Path = tmp_path_factory.getbasetemp() / "cli.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        RunFile.load(path)
    except ConfigError:
        result = CliRunner().invoke(app, ["tune", "--config", str(path), "--policy", "h2o", "--metric", "mean_kl",
                                          "--threshold", "0.1", "--prompt", "hi"])
        assert_clean(result)
        assert result.exit_code == 2
