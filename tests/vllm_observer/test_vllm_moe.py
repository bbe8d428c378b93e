"""``smollm2-moe`` (the default model upcycled into a Mixtral-layout MoE) served by a real ``vllm serve`` with
the observer on: vLLM routes through its fused-MoE path and still gives SmolLM2's greedy tokens, and the
observer records every request as it does for a dense model.

This is the ground the routing capture inside vLLM (issue 39) builds on: the same checkpoint in both engines.
"""

from __future__ import annotations

import pytest
import torch
from vllm_server import VllmServer, require_vllm, wait_for_vllm_rows

from sparseety.engine import encode_prompt
from sparseety.store import connect

pytestmark = pytest.mark.model

#: Plain prompts (no chat template), so vLLM and transformers see the same token ids.
PROMPTS = ("The three primary colours are", "To bake bread you need flour, water,")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm-moe")
    srv = VllmServer(resolve_model_dir("smollm2-moe"), base / "traces", base / "vllm.log").start()
    yield srv
    srv.stop()


def test_vllm_serves_smollm2_moe_with_smollm2s_greedy_tokens_and_traces_it(moe_server, smollm):
    model, tokenizer = smollm
    for prompt in PROMPTS:
        encoded = encode_prompt(tokenizer, prompt, False)
        with torch.inference_mode():
            reference = model.generate(encoded.input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        ids = encoded.input_ids[0].tolist()
        reply = moe_server.complete(ids, NEW_TOKENS)
        assert reply["choices"][0]["token_ids"] == reference[0, len(ids):].tolist(), prompt
    assert wait_for_vllm_rows(moe_server.trace_dir, len(PROMPTS)) == len(PROMPTS), moe_server.log_tail()
    stored = connect(moe_server.trace_dir).sql("SELECT model FROM requests WHERE policy = 'vllm'").fetchall()
    assert len(stored) == len(PROMPTS) and all("smollm2-moe" in model for (model,) in stored)
