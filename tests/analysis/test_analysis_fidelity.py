"""Teacher-forced fidelity: the metrics against an independent NumPy computation, and the forcing loop on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import prompt_ids

from sparseety.analysis.fidelity import fidelity, teacher_forced_logprobs
from sparseety.engine import EncodedInput
from sparseety.errors import InputError
from sparseety.policies import build_policy


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_metrics_match_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 11)), rng.normal(size=(5, 11))
    b[2] = a[2]  # one step with identical distributions
    targets = [3, 0, 7, 10, 1]
    la, lb = _log_softmax(a), _log_softmax(b)
    fid = fidelity(torch.from_numpy(la), torch.from_numpy(lb), targets)
    kl = (np.exp(la) * (la - lb)).sum(-1)
    assert fid.kl_per_step == pytest.approx(kl.tolist(), abs=1e-12)
    assert fid.kl_per_step[2] == 0.0
    assert fid.mean_kl == pytest.approx(kl.mean()) and fid.max_kl == pytest.approx(kl.max())
    assert fid.top1_agreement == pytest.approx(np.mean(la.argmax(-1) == lb.argmax(-1)))
    nll = lambda lp: -np.mean([lp[i, t] for i, t in enumerate(targets)])
    assert fid.ppl_dense == pytest.approx(math.exp(nll(la)))
    assert fid.ppl_sparse == pytest.approx(math.exp(nll(lb)))


def test_shape_mismatch_is_an_input_error():
    with pytest.raises(InputError, match=r"\[steps=2, vocab\]"):
        fidelity(torch.zeros(2, 5), torch.zeros(3, 5), [0, 1])


@pytest.mark.parametrize("document", [False, True], ids=["prompt", "long-document"])
def test_dense_forcing_reproduces_greedy_generation(tiny_engine, one_thread, document):
    """Forcing the dense output through the dense policy predicts exactly that output (argmax per step)."""
    ids = prompt_ids(30, seed=4)
    encoded = EncodedInput(ids, compress_len=22 if document else None)
    out = tiny_engine.generate(encoded, build_policy("dense"), max_new_tokens=8, tier=0)
    lp = teacher_forced_logprobs(tiny_engine, encoded, build_policy("dense"), out.output_ids)
    assert lp.shape == (8, 160) and lp.dtype == torch.float64
    assert lp.argmax(-1).tolist() == out.output_ids


def test_sparse_forcing_feeds_the_dense_tokens(tiny_engine, one_thread):
    """A policy that keeps everything it sees (budget above the sequence) gives the dense distributions."""
    encoded = EncodedInput(prompt_ids(24, seed=5))
    out = tiny_engine.generate(encoded, build_policy("dense"), max_new_tokens=6, tier=0)
    dense = teacher_forced_logprobs(tiny_engine, encoded, build_policy("dense"), out.output_ids)
    roomy = teacher_forced_logprobs(tiny_engine, encoded, build_policy("h2o", 64), out.output_ids)
    tight = teacher_forced_logprobs(tiny_engine, encoded, build_policy("streaming", 6), out.output_ids)
    assert fidelity(dense, roomy, out.output_ids).max_kl == pytest.approx(0.0, abs=1e-9)
    assert fidelity(dense, tight, out.output_ids).mean_kl > 0
