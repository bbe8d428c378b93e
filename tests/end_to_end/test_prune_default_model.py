"""Token pruning and layer selection on the real default model, through the engine and the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.engine import encode_prompt
from sparseety.policies import build_policy
from sparseety.prune_schedule import parse_prune_schedule

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8")[:900]
NEW = 8


def _last_row_scores(model: torch.nn.Module, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """``[P]`` attention the last prompt row pays to every token at ``layer`` (mean over heads), from q and k
    recomputed on the never-wrapped model's hidden state entering that layer."""
    config = model.config
    head_dim, p = config.head_dim, ids.shape[1]
    with torch.inference_mode():
        block = model.model.layers[layer]
        x = block.input_layernorm(model(ids, output_hidden_states=True).hidden_states[layer])
        cos, sin = model.model.rotary_emb(x, torch.arange(p)[None])
        q = block.self_attn.q_proj(x).view(1, p, -1, head_dim).transpose(1, 2)
        k = block.self_attn.k_proj(x).view(1, p, -1, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return torch.softmax((q[:, :, -1:] @ k.transpose(-1, -2)).float() * head_dim**-0.5, dim=-1)[0, :, 0].mean(0)


def test_zero_schedule_equals_plain_generate(smollm, smollm_engine):
    model, tokenizer = smollm
    encoded = encode_prompt(tokenizer, TEXT, False)
    with torch.inference_mode():
        reference = model.generate(encoded.input_ids, max_new_tokens=NEW, do_sample=False)[0, encoded.input_len:]
    result = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=NEW, tier=1,
                                    prune=parse_prune_schedule("8:0"))
    assert result.output_ids == reference.tolist() and result.pruned_tokens == 0


def test_half_pruned_after_layer_eight(smollm, smollm_engine):
    """The pruned set is the lowest-scored half, layers 9+ hold none of it, and the KV bytes drop exactly."""
    model, tokenizer = smollm
    encoded = encode_prompt(tokenizer, TEXT, False)
    p = encoded.input_len
    result = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=NEW, tier=2,
                                    prune=parse_prune_schedule("8:0.5"))
    a = result.arrays
    pruned = a["pruned.position"].tolist()
    assert len(pruned) == int(0.5 * p + 0.5) and set(a["pruned.layer"].tolist()) == {8}
    scores = _last_row_scores(model, encoded.input_ids, 8)
    candidates = [i for i in range(4, p - 8)]
    kept_candidates = sorted(set(candidates) - set(pruned))
    # every pruned token scored no higher than every kept candidate (float noise aside)
    assert float(scores[pruned].max()) <= float(scores[kept_candidates].min()) + 1e-6
    torch.testing.assert_close(torch.from_numpy(a["pruned.score"]), scores[pruned], rtol=1e-3, atol=1e-6)
    seen = p + NEW - 1
    for layer, heads in result.kept_positions_final.items():
        expected = list(range(seen)) if int(layer) <= 8 else sorted(set(range(seen)) - set(pruned))
        assert all(kept == expected for kept in heads.values())
    assert a["layer_tokens"].tolist() == [p] * 9 + [p - len(pruned)] * 21
    slots = 9 * seen + 21 * (seen - len(pruned))
    assert result.kv_cache_bytes_peak == 2 * slots * 3 * 64 * 4
    assert result.to_json()["sparsity"]["pruned_tokens"] == len(pruned)


def test_run_cli_prunes_and_picks_a_layer(tmp_path):
    out = CliRunner().invoke(app, [
        "run", "--prompt", TEXT[:400], "--no-chat", "--policy", "h2o", "--budget", "48", "--prune-schedule", "8:0.3,16:0.5",
        "--prune-opt", "keep_recent=4", "--layers", "auto", "--max-new-tokens", "4", "--json", "--no-report",
        "--trace-dir", str(tmp_path),
    ])
    assert out.exit_code == 0, out.output
    document = json.loads(out.stdout.strip().splitlines()[-1])
    sparsity = document["sparsity"]
    assert sparsity["prune"] == {"schedule": "8:0.3,16:0.5", "keep_recent": 4, "sinks": 4, "window": 1}
    assert sparsity["pruned_tokens"] > 0
    assert document["extraction"]["layers"] == "auto" and len(document["extraction"]["recorded_layers"]) == 1


def test_run_cli_bad_prune_and_layer_flags():
    runner = CliRunner()
    cases = [
        (["--prune-schedule", "8:1.5"], "fraction after layer 8 must be in [0, 1), got 1.5"),
        (["--prune-schedule", "8-0.5"], "'8-0.5' is not layer:fraction"),
        (["--prune-schedule", "16:0.3,8:0.5"], "strictly increasing"),
        (["--prune-schedule", "29:0.5"], "layer 29 is outside 0..28"),
        (["--prune-opt", "keep_recent=2"], "--prune-opt needs --prune-schedule"),
        (["--layers", "0,30"], "layer 30 is outside the model's layers 0..29"),
        (["--layers", "first"], "'first' is not a layer number"),
    ]
    for flags, message in cases:
        out = runner.invoke(app, ["run", "--prompt", "hello", "--no-report", *flags])
        assert out.exit_code == 2, (flags, out.output)
        # Checks that need the model's layer count come after the model loads, so the threads line
        # (stderr) may come first; the error is then the last line, and stdout stays empty.
        errors = [line for line in out.stderr.splitlines() if not line.startswith("threads: ")]
        text = " ".join(errors)
        assert out.stdout == "" and text.startswith("error: ") and message in text, (flags, out.output)
