"""kvpress's own scores beside SparSEEty's for keydiff, expected_attention and compactor, on the same keys.

A sanity check of the three query-agnostic policies (issue 15), not a test: a tiny random-weight Llama
(hidden 128, 4 query / 2 KV heads, head_dim 32, 2 layers, seed 0) reads 600 random token ids inside
kvpress's side environment (``benchmarks/.kvpress-venv``, which ``benchmarks/kvpress_compare.py``
creates: kvpress 0.5.5 needs ``transformers<5.3``); the script then takes layer 1's hidden states,
post-RoPE keys, values and queries, and asks ``KeyDiffPress``, ``ExpectedAttentionPress`` (default,
and without covariance with ``epsilon=0.01``) and ``CompactorPress`` (chunk 256 and 100) for their
``score()``. Back in SparSEEty's environment the same tensors go through the policies' ``score()`` on an
:class:`Observation` (queries and keys post-RoPE, as the engine hands them). Compactor draws a random
sketch: it is compared twice, once with kvpress's own draw (so the scores must agree to float
precision) and once with the policy's seeded draw (only the kept sets are expected to agree closely).

Reported per press: the largest relative score difference (protected slots left out: kvpress pads its
sinks with the maximum score, SparSEEty with ``+inf``) and the overlap of the kept sets at ratio 0.5
per KV head. Results: ``benchmarks/results/studies/kvpress_scores_check.json``.

Usage::

    .venv/bin/python -m benchmarks.studies.kvpress_scores_check      # ~20 s once the side environment exists
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/
VENV_PYTHON = ROOT / ".kvpress-venv" / "bin" / "python"
RESULTS = ROOT / "results" / "studies" / "kvpress_scores_check.json"
N, RATIO = 600, 0.5


def dump(path: str) -> None:
    """kvpress side: run the tiny model, save the layer's tensors and kvpress's scores."""
    import importlib.metadata

    import torch
    import transformers
    from kvpress import CompactorPress, ExpectedAttentionPress, KeyDiffPress
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=200, max_position_embeddings=2048, head_dim=32)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 200, (1, N))
    attn = model.model.layers[1].self_attn
    captured = {}
    attn.register_forward_pre_hook(lambda m, a, kw: captured.update(kw), with_kwargs=True)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        keys, values = cache.layers[1].keys, cache.layers[1].values
        h, (cos, sin) = captured["hidden_states"], captured["position_embeddings"]
        q = attn.q_proj(h).view(1, N, -1, 32).transpose(1, 2)
        k = attn.k_proj(h).view(1, N, -1, 32).transpose(1, 2)
        q_post, k_post = apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(k_post, keys)
        kw = {"position_embeddings": (cos, sin)}
        attn.rotary_emb = model.model.rotary_emb  # as kvpress's pipeline sets it
        out = {"keys": keys, "values": values, "queries": q_post, "inv_freq": model.model.rotary_emb.inv_freq,
               "versions": {"kvpress": importlib.metadata.version("kvpress"),
                            "transformers": transformers.__version__}}
        out["keydiff"] = KeyDiffPress(compression_ratio=RATIO).score(attn, h, keys, values, None, kw)
        out["expected_attention"] = ExpectedAttentionPress(compression_ratio=RATIO).score(attn, h, keys, values, None, kw)
        out["expected_attention_nocov_eps"] = ExpectedAttentionPress(
            compression_ratio=RATIO, use_covariance=False, epsilon=0.01).score(attn, h, keys, values, None, kw)
        draws, real = [], torch.randn

        def spy(*args, **kwargs):
            x = real(*args, **kwargs)
            draws.append(x.clone())
            return x

        torch.randn = spy
        for chunk in (256, 100):
            out[f"compactor_{chunk}"] = CompactorPress(compression_ratio=RATIO, chunk_size=chunk).score(
                attn, h, keys, values, None, kw)
        torch.randn = real
        out["sketches"] = draws
    torch.save(out, path)


def compare(path: str) -> dict:
    """SparSEEty side: the same tensors through the policies."""
    import torch

    from sparseety.policies import build_policy
    from sparseety.policies.base import Observation
    from sparseety.policies.compactor import compactor_scores

    r = torch.load(path)
    keys, values, queries, inv = r["keys"], r["values"], r["queries"], r["inv_freq"]
    pos = torch.arange(N).expand(1, keys.shape[1], N)
    budget = int(N * (1 - RATIO))
    obs = Observation(layer=1, num_layers=2, step=0, prefill=True, positions=pos, keys=keys, attention=None,
                      state=None, seed=0, queries=queries, values=values, rotary=inv)

    def row(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
        finite = torch.isfinite(ours)
        rel = ((ours[finite] - theirs[finite]).abs().max() / theirs[finite].abs().max()).item()
        overlap = [len(set(ours[0, h].topk(budget).indices.tolist()) & set(theirs[0, h].topk(budget).indices.tolist()))
                   / budget for h in range(ours.shape[1])]
        return {"max_relative_difference": float(f"{rel:.3g}"), "kept_overlap_per_kv_head": overlap}

    table = {
        "keydiff": row(build_policy("keydiff", budget).score(obs)[0], r["keydiff"]),
        "expected_attention": row(build_policy("expected_attention", budget).score(obs)[0], r["expected_attention"]),
        "expected_attention use_covariance=false epsilon=0.01": row(build_policy(
            "expected_attention", budget, {"use_covariance": "false", "epsilon": "0.01"}).score(obs)[0],
            r["expected_attention_nocov_eps"]),
    }
    lo, hi = 8, N - 4
    for i, chunk in enumerate((256, 100)):
        theirs = r[f"compactor_{chunk}"]
        phi = r["sketches"][i] / math.sqrt(48)
        core = compactor_scores(keys[:, :, lo:hi], values[:, :, lo:hi], queries[:, :, lo:hi], pos[:, :, lo:hi], inv,
                                phi, chunk, RATIO)
        table[f"compactor chunk_size={chunk}, kvpress's sketch"] = row(core, theirs[..., lo:hi])
        ours = build_policy("compactor", budget, {"chunk_size": str(chunk)}).score(obs)[0]
        table[f"compactor chunk_size={chunk}, the policy's seeded sketch"] = row(ours, theirs)
    return {"setup": {"model": "tiny random Llama (seed 0), layer 1", "tokens": N, "ratio": RATIO,
                      "kvpress_side": r["versions"]}, "presses": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", metavar="PATH", help=argparse.SUPPRESS)  # the kvpress side, in its venv
    args = parser.parse_args()
    if args.dump:
        dump(args.dump)
        return
    if not VENV_PYTHON.exists():
        raise SystemExit(f"{VENV_PYTHON} is missing: run benchmarks/kvpress_compare.py once to create it")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "kvpress_scores.pt")
        subprocess.run([str(VENV_PYTHON), __file__, "--dump", path], check=True, cwd=tmp)
        result = compare(path)
    from benchmarks.common import command  # here: the --dump side runs this file as a script in kvpress's venv

    result["command"] = command()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, figures in result["presses"].items():
        print(f"{name:58s} max rel diff {figures['max_relative_difference']:<9} kept overlap "
              f"{', '.join(f'{x:.3f}' for x in figures['kept_overlap_per_kv_head'])}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
