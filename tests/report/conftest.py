"""Report fixtures: one real trace of the default model, one real trace of a tiny MoE model with
speculative decoding, both written to and read back from the trace store, made once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

PROMPT = "Explain in one sentence why the sky is blue. <script>alert(1)</script>"


@pytest.fixture(scope="session")
def real_trace_dir(smollm_engine, tmp_path_factory) -> Path:
    """A trace dataset holding one h2o run (budget 32, 8 new tokens, tier 3) of the default model."""
    from sparseety.engine import encode_prompt
    from sparseety.policies import build_policy
    from sparseety.store import write_trace

    encoded = encode_prompt(smollm_engine.tokenizer, PROMPT, True)
    result = smollm_engine.generate(encoded, build_policy("h2o", 32, {}), max_new_tokens=8, tier=3, top_k=8)
    trace_dir = tmp_path_factory.mktemp("real-traces")
    write_trace(result, trace_dir)
    return trace_dir


@pytest.fixture(scope="session")
def real_trace(real_trace_dir):
    from sparseety.store import load_trace

    return load_trace(real_trace_dir)


@pytest.fixture(scope="session")
def moe_trace(tmp_path_factory):
    """A tiny random-weight Qwen2-MoE run with H2O and prompt-lookup drafts (router and draft arrays)."""
    import torch
    from tiny_models import build_model, build_tokenizer, repetitive_ids

    from sparseety.engine import SparseEngine
    from sparseety.engine.inputs import EncodedInput
    from sparseety.policies import build_policy
    from sparseety.store import load_trace, write_trace

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = SparseEngine(build_model("qwen2_moe"), build_tokenizer(), "tiny-qwen2-moe")
        result = engine.generate(EncodedInput(repetitive_ids(40)), build_policy("h2o", 16, {}), max_new_tokens=12,
                                 tier=2, speculative=3)
    finally:
        torch.set_num_threads(threads)
    trace_dir = tmp_path_factory.mktemp("moe-traces")
    write_trace(result, trace_dir)
    return load_trace(trace_dir, result.request_id)

