"""One request's failure is its own: a fault in one sequence leaves every neighbour's tokens and trace as they are alone.

A fault is injected into one sequence's policy (its ``score`` raises) at the prefill, at a chunk edge
(the chunk that completes a prompt prefilled over several steps, where the policy first scores) and
mid-decode (a packed forward over every running sequence), and into its binding at admission and its
result at the end. Seven neighbours with other policies and prompt lengths run beside it; each must
equal the same request run alone through ``SparseEngine.generate``, and the failed request must be
retired alone with its own error and its reservation freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from test_engine_batch import assert_same_trace
from tiny_models import prompt_ids

from sparseety.engine import EncodedInput
from sparseety.engine.batch import BatchEngine
from sparseety.engine.request import GenerationOptions, RequestStatus
from sparseety.errors import ConfigError
from sparseety.policies import build_policy
from sparseety.policies.base import ModelInfo, Observation
from sparseety.policies.h2o import H2OPolicy

NEW = 8
NEIGHBOURS = [("dense", None, {}, 12), ("streaming", 16, {}, 40), ("h2o", 20, {}, 33), ("snapkv", 18, {"window": 6}, 57),
              ("tova", 17, {}, 25), ("kvzip", 19, {"window": "4"}, 44), ("knorm", 21, {}, 70)]


class InjectedFault(RuntimeError):
    pass


@dataclass
class FaultyH2O(H2OPolicy):
    """``h2o`` whose ``score`` raises once the sequence reaches output step ``fail_step`` (0: the prefill)."""

    name: ClassVar[str] = "h2o"
    fail_step: int = 0

    def score(self, obs: Observation):
        if obs.step >= self.fail_step:
            raise InjectedFault(f"injected fault at step {obs.step}, layer {obs.layer}")
        return super().score(obs)


@dataclass
class BindsOnce(H2OPolicy):
    """Binds at ``add`` and fails the second time, when its context is built at admission."""

    name: ClassVar[str] = "h2o"
    binds: int = 0

    def bind(self, model: ModelInfo) -> None:
        self.binds += 1
        if self.binds > 1:
            raise InjectedFault("bind failed at admission")


@dataclass
class BadParams(H2OPolicy):
    """Runs fine; its parameters (read when its result is built) raise."""

    name: ClassVar[str] = "h2o"

    def params(self):
        raise InjectedFault("params failed")


def neighbours():
    return [(EncodedInput(prompt_ids(n, seed=n)), build_policy(name, budget, opts)) for name, budget, opts, n in NEIGHBOURS]


def run_with_fault(engine, faulty, faulty_len, prefill_chunk, arrive_at=0):
    """Run seven neighbours and the faulty request (joining at step ``arrive_at``); outcomes by request id."""
    batch = BatchEngine(engine, max_batch=8, prefill_chunk=prefill_chunk)
    options = GenerationOptions(max_new_tokens=NEW, tier=3)
    for i, (e, p) in enumerate(neighbours()):
        batch.add(e, p, options, request_id=f"n{i}")
    outputs, step = [], 0
    while batch.has_work() or step <= arrive_at:
        if step == arrive_at:
            batch.add(EncodedInput(prompt_ids(faulty_len, seed=99)), faulty, options, request_id="bad")
        outputs += batch.step()
        step += 1
    return batch, outputs


def assert_neighbours_untouched(engine, outputs):
    results = {o.request.request_id: o.result for o in outputs if o.result is not None}
    assert sorted(results) == [f"n{i}" for i in range(len(NEIGHBOURS))]
    for i, (e, p) in enumerate(neighbours()):
        assert_same_trace(engine.generate(e, p, max_new_tokens=NEW, tier=3), results[f"n{i}"])


@pytest.mark.parametrize("where, fail_step, faulty_len, chunk, arrive_at, stage, tokens", [
    ("prefill", 0, 30, 256, 0, "prefill", 0),  # the whole prompt in the first forward, beside the others' prefill
    ("chunk edge", 0, 60, 16, 2, "prefill", 0),  # prefilled over several steps, beside running decodes
    ("mid-decode", 3, 30, 256, 0, "decode", 3),  # a packed decode forward over all eight
])
def test_a_policy_fault_fails_its_request_alone(where, fail_step, faulty_len, chunk, arrive_at, stage, tokens, engine_for):
    engine = engine_for("llama")
    batch, outputs = run_with_fault(engine, FaultyH2O(budget=20, fail_step=fail_step), faulty_len, chunk, arrive_at)
    failed = [o for o in outputs if o.failure is not None]
    assert len(failed) == 1, where
    out = failed[0]
    assert out.request.request_id == "bad" and out.request.status is RequestStatus.FINISHED_ERROR
    assert out.finished and out.result is None and out.request.ctx is None
    assert isinstance(out.failure.error, InjectedFault)
    assert (out.failure.stage, out.failure.step) == (stage, tokens)
    assert len(out.request.output_ids) == tokens
    assert batch.failures["bad"] is out.failure and "request bad failed at " + stage in out.failure.message()
    assert batch.reserved_bytes == 0 and not batch.has_work()
    assert_neighbours_untouched(engine, outputs)


def test_a_failure_at_admission_or_in_the_result_is_the_requests_own(engine_for):
    engine = engine_for("llama")
    for faulty, stage in ((BindsOnce(budget=20), "admission"), (BadParams(budget=20), "result")):
        batch, outputs = run_with_fault(engine, faulty, 30, 32)
        (out,) = [o for o in outputs if o.failure is not None]
        assert out.request.request_id == "bad" and out.failure.stage == stage, stage
        assert batch.reserved_bytes == 0
        assert_neighbours_untouched(engine, outputs)


def test_a_request_that_cannot_bind_is_refused_before_it_joins_the_batch(engine_for):
    """``learned`` without a predictor file: refused by ``add`` with its own error, nothing queued."""
    engine = engine_for("llama")
    batch = BatchEngine(engine)
    with pytest.raises(ConfigError, match="learned: no predictor file given"):
        batch.add(EncodedInput(prompt_ids(20)), build_policy("learned", 16), GenerationOptions(max_new_tokens=4))
    assert not batch.has_work() and batch.reserved_bytes == 0


def test_generate_batch_raises_the_failure_of_its_request(engine_for):
    engine = engine_for("llama")
    encoded = [EncodedInput(prompt_ids(20, seed=1)), EncodedInput(prompt_ids(25, seed=2))]
    with pytest.raises(InjectedFault, match="injected fault at step 2"):
        engine.generate_batch(encoded, [build_policy("dense"), FaultyH2O(budget=16, fail_step=2)],
                              GenerationOptions(max_new_tokens=NEW, tier=2))
