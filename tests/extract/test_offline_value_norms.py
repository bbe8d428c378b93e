"""Offline records that carry value norms (``value_norms_path``) score through the engine's scoring code.

The record is a real tiny model's eager attention rows of one layer (the rows that emitted the answer)
plus its values' norms; ``sparseety extract`` must rank exactly as the engine's ``--importance value``
(and ``output``) trace of the same layer does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tiny_models import build_model, build_tokenizer, prompt_ids  # noqa: E402

from sparseety.cli import app  # noqa: E402
from sparseety.config import ExtractionConfig  # noqa: E402
from sparseety.engine import EncodedInput, SparseEngine  # noqa: E402
from sparseety.errors import RecordError  # noqa: E402
from sparseety.extract.ingest import value_weighted  # noqa: E402
from sparseety.extract.scoring import output_grams, slot_norms  # noqa: E402
from sparseety.policies import build_policy  # noqa: E402

N, NEW, LAYER = 16, 4, 2


@pytest.fixture(scope="module")
def engine() -> SparseEngine:
    return SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama")


def write_record(engine: SparseEngine, folder: Path, mode: str) -> tuple[Path, list[int]]:
    """A record of layer ``LAYER``'s emitting rows ``[heads, rows, keys]`` and its ``mode`` norms; the answer."""
    result = engine.generate(EncodedInput(prompt_ids(N, seed=5)), build_policy("dense"), max_new_tokens=NEW,
                             importance="attention")
    sequence = result.prompt_ids + result.output_ids
    reference = build_model("llama")
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([sequence[:-1]]), output_attentions=True, use_cache=True)
    rows = out.attentions[LAYER][0, :, N - 1 :].numpy()  # [heads, NEW, seen]
    values = out.past_key_values.layers[LAYER].values[0]  # [kv_heads, seen, d]
    cfg = reference.config
    grams = output_grams(reference.model.layers[LAYER].self_attn.o_proj.weight, cfg.num_attention_heads,
                         cfg.num_key_value_heads) if mode == "output" else None
    norms = slot_norms(values, mode, grams).numpy()  # type: ignore[arg-type]
    np.save(folder / "att.npy", rows)
    np.save(folder / "norms.npy", norms[..., 0] if mode == "value" else norms)
    record = {"generation_id": "g", "prompt_tokens": result.prompt_ids, "generated_tokens": result.output_ids[:-1],
              "layer": LAYER, "score_type": "attention", "scores_path": "att.npy", "layout": "hqk",
              "value_norms_path": "norms.npy"}
    path = folder / "r.json"
    path.write_text(json.dumps(record))
    return path, result.output_ids


@pytest.mark.parametrize("mode", ["value", "output"])
def test_extract_ranks_as_the_engine_trace(engine, tmp_path, mode):
    path, _ = write_record(engine, tmp_path, mode)
    got = CliRunner().invoke(app, ["extract", str(path), "--top-k", "6", "--head-reduce", "mean",
                                   "--query-reduce", "sum", "--normalize", "max"])
    assert got.exit_code == 0, got.output
    records = [json.loads(line) for line in got.stdout.splitlines()]
    traced = engine.generate(EncodedInput(prompt_ids(N, seed=5)), build_policy("dense"), max_new_tokens=NEW,
                             importance=mode)
    row = traced.arrays["importance"][LAYER].astype(np.float64)[: N + NEW - 1]
    expected = sorted(range(row.shape[0]), key=lambda j: (-row[j], j))[:6]
    assert [r["position"] for r in records] == expected
    assert [r["score"] for r in records] == pytest.approx([row[j] / row.max() for j in expected], rel=3e-3)


def test_value_weighted_matches_by_hand_in_every_layout():
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.random((4, 3, 7)), dtype=torch.float32)  # [heads, q, k], 2 KV heads of 2
    norms = torch.tensor(rng.random((2, 7)), dtype=torch.float32)
    expected = x * norms.repeat_interleave(2, dim=0)[:, None, :]
    config = ExtractionConfig(score_type="attention", layout="hqk")
    torch.testing.assert_close(value_weighted(x, norms, config), expected)
    transposed = ExtractionConfig(score_type="attention", layout="bhkq")
    got = value_weighted(x.transpose(1, 2)[None], norms, transposed)
    torch.testing.assert_close(got, expected.transpose(1, 2)[None])
    per_head = torch.tensor(rng.random((2, 7, 2)), dtype=torch.float32)  # [kv_heads, k, g]
    by_hand = x * per_head.permute(0, 2, 1).reshape(4, 7)[:, None, :]
    torch.testing.assert_close(value_weighted(x, per_head, config), by_hand)
    single = ExtractionConfig(score_type="attention", layout="qk")
    torch.testing.assert_close(value_weighted(x[0], norms[0], single), x[0] * norms[0])
    with pytest.raises(RecordError, match=r"value norms of shape \(2, 6, 1\) do not fit attention of shape "
                                          r"\(4, 3, 7\) \(layout 'hqk'\): expected \[kv_heads, 7\]"):
        value_weighted(x, norms[:, :6], config)
    with pytest.raises(RecordError, match="value norms of shape \\(3, 7, 1\\)"):
        value_weighted(x, torch.ones(3, 7), config)
