"""``tune``: bisection finds a boundary budget; on a model, the answer meets the bar and one step below does not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import prompt_ids

from sparseety.analysis.fidelity import fidelity, teacher_forced_logprobs
from sparseety.analysis.tune import bisect_budget, check_metric, meets, tune_fidelity
from sparseety.engine import EncodedInput
from sparseety.errors import ConfigError
from sparseety.policies import build_policy


@given(lo=st.integers(1, 50), span=st.integers(0, 200), step=st.integers(1, 9), cut=st.integers(0, 300))
def test_bisection_on_a_monotone_bar(lo, span, step, cut):
    hi = lo + span
    grid = list(range(lo, hi, step)) + [hi]
    calls: list[int] = []

    def ok(b: int) -> bool:
        calls.append(b)
        return b >= cut

    expected = next((b for b in grid if b >= cut), None)
    assert bisect_budget(ok, lo, hi, step) == expected
    assert len(set(calls)) <= 2 + max(1, len(grid)).bit_length()


def test_bisection_returns_a_boundary_on_a_non_monotone_bar():
    good = {3, 4, 9, 10}
    answer = bisect_budget(lambda b: b in good, 1, 10)
    assert answer in good and answer - 1 not in good


@pytest.mark.parametrize(("metric", "threshold", "message"), [
    ("top1", 0.5, "unknown metric 'top1'; valid metrics: top1_agreement, mean_kl, passkey"),
    ("top1_agreement", 1.5, "must be >= 0 and <= 1, got 1.5"),
    ("mean_kl", -0.1, "must be >= 0, got -0.1"),
    ("passkey", -1, "must be >= 0 and <= 1, got -1"),
])
def test_bad_metric_or_threshold(metric, threshold, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_metric(metric, threshold)


def test_meets_direction():
    assert meets("top1_agreement", 0.9, 0.9) and not meets("top1_agreement", 0.89, 0.9)
    assert meets("mean_kl", 0.1, 0.1) and not meets("mean_kl", 0.11, 0.1)


@pytest.mark.parametrize(("policy", "metric", "threshold"), [("streaming", "top1_agreement", 1.0),
                                                             ("h2o", "mean_kl", 0.002)])
def test_answer_meets_and_one_step_below_does_not(tiny_engine, one_thread, policy, metric, threshold):
    encoded = EncodedInput(prompt_ids(40, seed=8))
    result = tune_fidelity(tiny_engine, encoded, policy, metric, threshold, max_new_tokens=8)
    assert result.answer is not None
    budget = result.answer.budget
    assert budget > result.curve[0].budget, "the bar should not already hold at the smallest budget"
    # Independently: the dense continuation, then each budget's forced distributions.
    dense_out = tiny_engine.generate(encoded, build_policy("dense"), max_new_tokens=8, tier=0).output_ids
    dense = teacher_forced_logprobs(tiny_engine, encoded, build_policy("dense"), dense_out)

    def value(b: int) -> float:
        lp = teacher_forced_logprobs(tiny_engine, encoded, build_policy(policy, b), dense_out)
        return getattr(fidelity(dense, lp, dense_out), metric)

    assert meets(metric, value(budget), threshold)
    assert not meets(metric, value(budget - 1), threshold)
    assert result.answer.value == value(budget)
    assert [p.budget for p in result.curve] == sorted({p.budget for p in result.curve})
    doc = result.to_json()
    assert doc["kind"] == "tune" and doc["answer"]["budget"] == budget
    assert doc["answer"]["ratio"] == pytest.approx(max(0.0, 1 - budget / 40), abs=1e-6)


def test_tune_passkey_searches_accuracy_over_the_cases(tiny_engine, one_thread):
    """The tiny model's vocabulary has no digits, so its accuracy is exactly 0 at every budget."""
    from sparseety.analysis.tune import tune_passkey
    from sparseety.suites.passkey import make_cases

    cases = make_cases([60], [0.2, 0.8], seed=0)
    always = tune_passkey(tiny_engine, cases, "streaming", 0.0, max_new_tokens=3, min_budget=8, max_budget=40, step=8)
    assert always.answer is not None and always.answer.budget == 8 and always.answer.value == 0.0
    never = tune_passkey(tiny_engine, cases, "streaming", 0.5, max_new_tokens=3, min_budget=8, max_budget=40, step=8)
    assert never.answer is None
    assert [(p.budget, p.value, p.meets) for p in never.curve] == [(40, 0.0, False)]


def test_tune_fidelity_measures_pruning_beside_the_policy(tiny_engine, one_thread):
    """With ``prune`` in ``engine_options`` the curve is the fidelity of policy plus pruning, evaluated
    independently here at the largest budget (where the policy evicts nothing and only pruning differs)."""
    from sparseety.analysis.compare import dense_policy
    from sparseety.analysis.fidelity import fidelity, teacher_forced_logprobs
    from sparseety.analysis.tune import tune_fidelity
    from sparseety.engine import EncodedInput
    from sparseety.policies import build_policy
    from sparseety.prune_schedule import parse_prune_schedule
    from tiny_models import prompt_ids

    encoded = EncodedInput(prompt_ids(40, seed=3))
    schedule = parse_prune_schedule("1:0.5", {"keep_recent": 4, "sinks": 2})
    plain = tune_fidelity(tiny_engine, encoded, "streaming", "mean_kl", 10.0, max_new_tokens=4, min_budget=44,
                          max_budget=44)
    pruned = tune_fidelity(tiny_engine, encoded, "streaming", "mean_kl", 10.0, max_new_tokens=4, min_budget=44,
                           max_budget=44, engine_options={"prune": schedule})
    assert plain.curve[0].value == 0.0
    targets = tiny_engine.generate(encoded, dense_policy(), max_new_tokens=4, tier=0).output_ids
    dense_lp = teacher_forced_logprobs(tiny_engine, encoded, dense_policy(), targets)
    pruned_lp = teacher_forced_logprobs(tiny_engine, encoded, build_policy("streaming", 44), targets, prune=schedule)
    assert pruned.curve[0].value == fidelity(dense_lp, pruned_lp, targets).mean_kl > 0.0
