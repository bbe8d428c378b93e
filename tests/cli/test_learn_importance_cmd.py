"""``sparseety learn-importance`` and ``--importance learned --importance-weights`` in ``run`` and ``serve``:
a real tiny model on disk, its weights file used by a run, and every refusal one ``error:`` line (exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tiny_models import build_model, build_tokenizer  # noqa: E402

from sparseety.cli import app  # noqa: E402
from sparseety.engine import SparseEngine  # noqa: E402
from sparseety.errors import ConfigError  # noqa: E402
from sparseety.extract.head_weights import HeadWeights, read_head_weights  # noqa: E402
from sparseety.serve import ServeConfig  # noqa: E402
from sparseety.store import load_trace  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("learn")
    paths = {}
    for family in ("llama", "qwen2"):
        folder = root / family
        build_model(family).save_pretrained(folder)
        build_tokenizer().save_pretrained(folder)
        paths[family] = folder
    for i in range(2):
        text = root / f"text{i}.txt"
        text.write_text("\n".join(" ".join(f"t{5 + (5 * i + 3 * j + w) % 150}" for w in range(6)) for j in range(12)))
        paths[f"text{i}"] = text
    weights = root / "w.json"
    result = CliRunner().invoke(app, ["learn-importance", str(paths["text0"]), str(paths["text1"]), "-o", str(weights),
                                      "--model", str(paths["llama"]), "--tokens", "20", "--max-new-tokens", "3",
                                      "--ablations", "4", "--steps", "20", "--quiet"])
    assert result.exit_code == 0, result.output
    paths["weights"] = weights
    return paths


def one_error(result, *parts: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if not line.startswith("threads: ")]  # a run's notice
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_learned_weights_file_and_a_run_that_uses_it(setup, tmp_path: Path):
    weights = read_head_weights(setup["weights"])
    assert tuple(weights.weights.shape) == (4, 4) and weights.feature == "output"
    assert weights.provenance["texts"] == [str(setup["text0"]), str(setup["text1"])]
    assert float(weights.weights.mean()) == pytest.approx(1.0, abs=1e-4)
    run = CliRunner().invoke(app, ["run", "--model", str(setup["llama"]), "--prompt", "t5 t6 t7 t8 t9 t10",
                                   "--max-new-tokens", "3", "--importance", "learned", "--importance-weights",
                                   str(setup["weights"]), "--trace-dir", str(tmp_path / "traces"), "--json",
                                   "--no-report"])
    assert run.exit_code == 0, run.output
    trace = load_trace(tmp_path / "traces", json.loads(run.stdout)["request_id"])
    extraction = trace.document["provenance"]["extraction"]
    assert (extraction["importance"], extraction["importance_feature"]) == ("learned", "output")
    assert int(trace.arrays["sink.position"][0]) == 0


def test_refusals_are_one_error_line(setup, tmp_path: Path):
    other = CliRunner().invoke(app, ["run", "--model", str(setup["qwen2"]), "--prompt", "t5 t6 t7", "--max-new-tokens",
                                     "2", "--importance", "learned", "--importance-weights", str(setup["weights"]),
                                     "--trace-dir", str(tmp_path / "t"), "--no-report"])
    fingerprint = read_head_weights(setup["weights"]).model_fingerprint
    one_error(other, "were fitted for model", fingerprint, "this run uses model", "learn-importance")
    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"format": "sparseety-head-weights", "format_version": 1, "weights": [[1.0]]}')
    one_error(CliRunner().invoke(app, ["run", "--prompt", "hi", "--importance", "learned", "--importance-weights",
                                       str(damaged)]), f"importance weights {damaged}: damaged (no 'model')")
    one_error(CliRunner().invoke(app, ["run", "--prompt", "hi", "--importance", "value", "--importance-weights",
                                       str(setup["weights"])]), "--importance-weights needs --importance learned")
    one_error(CliRunner().invoke(app, ["learn-importance", str(tmp_path / "none.txt"), "-o", "w.json"]),
              "training text", "is not a file")
    one_error(CliRunner().invoke(app, ["learn-importance", str(setup["text0"]), "-o", "w.json", "--feature", "grad"]),
              "--feature must be one of attention, value, output, got 'grad'")


def test_texts_that_are_not_utf8_or_empty_are_refused_naming_the_argument(setup, tmp_path: Path):
    """Before the model loads (--model names no model here): the file, the byte offset, and the argument
    learn-importance has (its TEXTS, never bench faithfulness's --text)."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait, ".encode("latin-1") * 4)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for path, words in ((latin, [f"training text {latin} is not UTF-8", "0xe9 at offset 3"]),
                        (empty, [f"training text {empty}: no text", "empty"])):
        result = CliRunner().invoke(app, ["learn-importance", str(setup["text0"]), str(path), "-o",
                                          str(tmp_path / "w.json"), "--model", str(tmp_path / "no-model")])
        one_error(result, *words)
        assert "--text" not in result.stderr
    bench = CliRunner().invoke(app, ["bench", "faithfulness", "--text", str(latin), "--model",
                                     str(tmp_path / "no-model"), "-o", str(tmp_path / "b")])
    one_error(bench, f"--text {latin} is not UTF-8", "offset 3")


def test_serve_config_resolves_and_refuses_weights(setup):
    engine = SparseEngine(build_model("llama"), build_tokenizer(), str(setup["llama"]))
    config = ServeConfig(importance="learned", importance_weights=setup["weights"])
    options = config.generation_options(engine)
    assert options.importance == "learned" and isinstance(options.importance_weights, HeadWeights)
    assert ServeConfig().generation_options(engine).importance == "value"  # as from every door (issue 38)
    with pytest.raises(ValueError, match="importance_weights need importance 'learned'"):
        ServeConfig(importance="value", importance_weights=setup["weights"])
    qwen = SparseEngine(build_model("qwen2"), build_tokenizer(), "tiny-qwen2")
    with pytest.raises(ConfigError, match="this run uses model 'tiny-qwen2'"):
        config.generation_options(qwen)
    bad = CliRunner().invoke(app, ["serve", "--importance", "grad"])
    assert bad.exit_code == 2 and "importance" in bad.stderr
