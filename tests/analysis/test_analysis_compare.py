"""``compare`` on the real default model: dense against dense is an identity; a tiny budget diverges."""

from __future__ import annotations

import pytest

from sparseety.analysis.compare import compare
from sparseety.analysis.fidelity import teacher_forced_logprobs
from sparseety.analysis.token_diff import apply_ops
from sparseety.engine import encode_document, encode_prompt
from sparseety.policies import build_policy

PROMPT = "Explain in two sentences why the sky is blue."


@pytest.fixture(scope="module")
def encoded(smollm_engine):
    return encode_prompt(smollm_engine.tokenizer, PROMPT, None)


def test_dense_against_dense_is_exact(smollm_engine, encoded):
    result = compare(smollm_engine, encoded, build_policy("dense"), max_new_tokens=6, tier=1, embeddings=False)
    assert result.baseline.output_ids == result.sparse.output_ids
    assert result.diff.ratio == 1.0 and result.diff.first_divergence is None
    fid = result.fidelity
    assert fid.mean_kl == 0.0 and fid.max_kl == 0.0 and fid.kl_per_step == [0.0] * 6
    assert fid.top1_agreement == 1.0 and fid.ppl_dense == fid.ppl_sparse
    assert result.quality.exact_match and result.quality.rouge_l == 1.0


def test_a_tiny_budget_diverges(smollm_engine, encoded):
    result = compare(smollm_engine, encoded, build_policy("streaming", 8), max_new_tokens=8, tier=2, embeddings=False)
    base, sparse = result.baseline.output_ids, result.sparse.output_ids
    assert base != sparse
    first = next(i for i, (a, b) in enumerate(zip(base + [-1], sparse + [-2])) if a != b)
    assert result.diff.first_divergence == first
    assert apply_ops(base, result.diff.ops) == sparse
    assert result.fidelity.mean_kl > 0 and result.fidelity.top1_agreement < 1
    assert result.fidelity.ppl_sparse > result.fidelity.ppl_dense
    assert not result.quality.exact_match and result.quality.rouge_l < 1
    section = result.section()
    assert section["baseline_request_id"] == result.baseline.request_id
    assert set(section) == {"baseline_request_id", "diff", "fidelity", "quality"}


def test_document_protocol_forcing_reproduces_dense_greedy(smollm_engine):
    """Context compressed once, question uncompressed: the forced dense run predicts the generated answer."""
    encoded = encode_document(smollm_engine.tokenizer, "The meeting moved to Thursday at 3 pm in room 12. " * 4,
                              "When is the meeting?", None)
    out = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=5, tier=0)
    lp = teacher_forced_logprobs(smollm_engine, encoded, build_policy("dense"), out.output_ids)
    assert lp.argmax(-1).tolist() == out.output_ids
    # With a policy, the forced first step is exactly generate's first step (same split, same compression).
    policy = build_policy("snapkv", 24)
    sparse = smollm_engine.generate(encoded, policy, max_new_tokens=1, tier=0)
    forced = teacher_forced_logprobs(smollm_engine, encoded, policy, out.output_ids)
    assert int(forced[0].argmax()) == sparse.output_ids[0]
