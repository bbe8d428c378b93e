"""The ``learned`` policy's training (:mod:`sparseety.training.learned_policy`): labels from tier-3 traces
(the most, the summed or the question row's attention later steps gave each context position), heavy
hitters and kept sets with ties broken by position, and a clear error without tier-3 traces. The policy
and its predictor file: ``tests/policies/test_policy_learned.py``; the command: ``tests/cli/test_learn_policy.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import prompt_ids
from tiny_training import train_tiny_learned_policy

from sparseety.engine import EncodedInput
from sparseety.errors import InputError
from sparseety.policies import build_policy
from sparseety.policies.parts.learned_model import read_predictor
from sparseety.store import write_trace
from sparseety.training.learned_policy import heavy_hitters, kept_by, read_examples


def test_heavy_hitters_and_kept_sets_break_ties_by_position():
    assert heavy_hitters(np.array([0.0, 3.0, 1.0, 3.0, 2.0]), 0.4).tolist() == [False, True, False, True, False]
    assert kept_by(np.array([1.0, 1.0, 5.0, 0.0]), 0.5).tolist() == [True, False, True, False]
    assert kept_by(np.array([9.0, 1.0, 5.0, 0.0]), 0.5, protect_recent=1).tolist() == [True, False, False, True]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tier-3 dense traces of tiny llama (long-document protocol), a predictor trained on them, and the engine."""
    return train_tiny_learned_policy(tmp_path_factory.mktemp("learned"))


def test_no_tier3_traces_is_a_clear_error(tmp_path, trained):
    engine, _, _ = trained
    write_trace(engine.generate(EncodedInput(prompt_ids(20)), build_policy("dense"), max_new_tokens=2, tier=2),
                tmp_path / "t2")
    with pytest.raises(InputError, match="no tier-3 traces"):
        read_examples(tmp_path / "t2")


def test_the_label_is_the_most_or_the_summed_attention_later_steps_gave_each_context_position(trained):
    from sparseety.store import connect, load_trace

    _, _, path = trained
    root = Path(read_predictor(path).provenance["trace_dir"])
    by_max = {e.request_id: e for e in read_examples(root)}
    by_sum = {e.request_id: e for e in read_examples(root, label="sum")}
    by_question = {e.request_id: e for e in read_examples(root, label="question")}
    ((request_id,),) = connect(root).sql("SELECT request_id FROM requests ORDER BY request_id LIMIT 1").fetchall()
    steps = load_trace(root, request_id).arrays["step_importance"]  # [steps, layers, seen]
    later = np.nan_to_num(steps[1:, :, :32].astype(np.float32))  # the context is the first 32 tokens
    np.testing.assert_allclose(by_max[request_id].future, later.max(axis=0))
    np.testing.assert_allclose(by_sum[request_id].future, later.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(by_question[request_id].future, later[0])  # the first row after the prefill
    assert "the maximum" in read_predictor(path).provenance["label"]
    with pytest.raises(InputError, match="label must be one of max, sum, question"):
        read_examples(root, label="mean")
