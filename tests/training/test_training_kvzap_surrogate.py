"""The ``kvzap`` surrogate's training (:mod:`sparseety.training.kvzap_surrogate`): KVzip+ scores on constructed
tensors against a loop over their definition, and ``learn-policy --target kvzip`` on a tiny model end to end,
its file then run by ``--policy kvzap``. The policy itself: ``tests/policies/test_policy_kvzap.py``."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build_model, build_tokenizer
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.policies.parts.kvzap_model import read_surrogate
from sparseety.training.kvzap_surrogate import kept_recall, kvzip_plus, spearman

LAYERS = 4  # the tiny llama's


def test_kvzip_plus_on_constructed_tensors():
    """One KV head, two query heads, two rows over 3 context slots + the rows' own 2 (causal)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g)
    hid = torch.randn(2, 6, generator=g)
    wo = torch.randn(6, 8, generator=g)  # [D, heads * d]
    grams = torch.stack([wo[:, h * 4:(h + 1) * 4].T @ wo[:, h * 4:(h + 1) * 4] for h in range(2)]).unsqueeze(0)
    got = kvzip_plus(q, k, v, hid, grams, 0.5, 0, 3)
    best = torch.full((3,), -1.0)
    for h in range(2):
        for t in range(2):
            logits = (k[0, 0, : 3 + t + 1] @ q[0, h, t]) * 0.5
            a = torch.softmax(logits, 0)[:3]
            wov = (v[0, 0, :3] @ wo[:, h * 4:(h + 1) * 4].T).norm(dim=-1)
            best = torch.maximum(best, a * wov / hid[t].norm())
    torch.testing.assert_close(got, best.log().unsqueeze(0), rtol=1e-5, atol=1e-6)
    assert spearman(torch.tensor([1.0, 2, 3]), torch.tensor([10.0, 20, 30])) == pytest.approx(1.0)
    assert kept_recall(torch.tensor([[1.0, 2, 3, 4]]), torch.tensor([[4.0, 3, 2, 1]])) == 0.0


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_learn_policy_target_kvzip_then_run_kvzap(tmp_path):
    folder = tmp_path / "tiny-llama"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    words = [f"t{4 + (i * 7) % 150}" for i in range(48)]
    for i in range(4):
        done = invoke("run", "--model", str(folder), "--prompt", " ".join(words[i:] + words[:i]), "--no-chat",
                      "--policy", "dense", "--tier", "1", "--force-trace", "--max-new-tokens", "2",
                      "--trace-dir", str(tmp_path / "traces"), "--no-report", "--json")
        assert done.exit_code == 0, done.output
    out = tmp_path / "kvzap.safetensors"
    done = invoke("learn-policy", str(tmp_path / "traces"), "-o", str(out), "--target", "kvzip",
                  "--text-source", "tiny words", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert [row["layer"] for row in report["heldout"]] == list(range(LAYERS))
    assert all(-1 <= row["spearman"] <= 1 and 0 <= row["recall@0.5"] <= 1 for row in report["heldout"])
    s = read_surrogate(out)
    assert s.kind == "linear" and s.provenance["text_source"] == "tiny words" and len(s.provenance["heldout_request_ids"]) == 1
    done = invoke("run", "--model", str(folder), "--prompt", " ".join(words), "--no-chat", "--policy", "kvzap",
                  "--budget", "20", "--policy-opt", f"model={out}", "--max-new-tokens", "3", "--json")
    assert done.exit_code == 0, done.output
    assert json.JSONDecoder().raw_decode(done.output)[0]["sparsity"]["evicted_positions"] > 0
    done = invoke("learn-policy", str(tmp_path / "traces"), "-o", str(out), "--target", "kv")
    assert done.exit_code == 2 and "error: --target must be attention or kvzip, got 'kv'" in done.output
