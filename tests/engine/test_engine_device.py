"""The engine on whichever device holds the model: window edges, routing and eviction equal the CPU run's.

On a machine without CUDA only the CPU case runs (against plain ``generate`` on the same device); where CUDA
is present the same checks run on the GPU and are compared with the CPU engine on the same prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import WINDOW, build_model, prompt_ids

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.policies import build_policy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPT, NEW = 30, 6


def _engine(family: str, device: str, tokenizer) -> SparseEngine:
    return SparseEngine(build_model(family).to(device), tokenizer, model_name=f"tiny-{family}")


def _greedy(family: str, device: str, ids: torch.Tensor, new: int) -> list[int]:
    model = build_model(family).to(device)
    ids = ids.to(device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _generate(engine: SparseEngine, ids: torch.Tensor, policy: str, budget: int | None = None, tier: int = 2):
    device = next(engine.model.parameters()).device
    return engine.generate(EncodedInput(ids.to(device)), build_policy(policy, budget), max_new_tokens=NEW, tier=tier)


@pytest.fixture(scope="module")
def cpu_runs(tokenizer):
    """The CPU engine's results for every check, computed once."""
    ids = prompt_ids(PROMPT)
    return {
        "window": _generate(_engine("gemma3", "cpu", tokenizer), ids, "dense"),
        "moe": _generate(_engine("mixtral", "cpu", tokenizer), ids, "dense"),
        "streaming": _generate(_engine("llama", "cpu", tokenizer), ids, "streaming", 12),
        "snapkv": _generate(_engine("llama", "cpu", tokenizer), ids, "snapkv", 12),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_window_edges_and_frees_on_device(device, tokenizer, cpu_runs):
    ids = prompt_ids(PROMPT)
    result = _generate(_engine("gemma3", device, tokenizer), ids, "dense")
    assert result.output_ids == _greedy("gemma3", device, ids, NEW)
    rows = sorted(zip(result.arrays["window.step"].tolist(), result.arrays["window.layer"].tolist(),
                      result.arrays["window.position"].tolist()))
    assert rows == sorted((s, layer, PROMPT + s - WINDOW) for s in range(NEW) for layer in (0, 1, 2))
    reference = cpu_runs["window"]
    assert result.kept_positions_final == reference.kept_positions_final
    assert result.kv_cache_bytes_peak == reference.kv_cache_bytes_peak


@pytest.mark.parametrize("device", DEVICES)
def test_routing_on_device_equals_the_cpu_run(device, tokenizer, cpu_runs):
    ids = prompt_ids(PROMPT)
    result = _generate(_engine("mixtral", device, tokenizer), ids, "dense")
    assert result.output_ids == _greedy("mixtral", device, ids, NEW)
    reference = cpu_runs["moe"]
    layers = [key for key in reference.arrays if key.startswith("router.")]
    assert layers and sorted(layers) == sorted(k for k in result.arrays if k.startswith("router."))
    for key in layers:
        got, want = result.arrays[key].astype(np.float32), reference.arrays[key].astype(np.float32)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-3)  # float16 in the trace; TF32/kernels differ on GPU
        top2 = lambda probs: np.sort(np.argsort(-probs, axis=1)[:, :2], axis=1)  # noqa: E731
        assert (top2(got) == top2(want)).mean() >= 0.95, key


@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
@pytest.mark.parametrize("device", DEVICES)
def test_eviction_on_device_keeps_the_cpu_positions(device, policy, tokenizer, cpu_runs):
    result = _generate(_engine("llama", device, tokenizer), prompt_ids(PROMPT), policy, 12)
    reference = cpu_runs[policy]
    assert result.output_ids == reference.output_ids
    assert result.kept_positions_final == reference.kept_positions_final
    assert result.eviction_events == reference.eviction_events
    for key in ("evicted.step", "evicted.layer", "evicted.kv_head", "evicted.position"):
        assert result.arrays[key].tolist() == reference.arrays[key].tolist(), key
