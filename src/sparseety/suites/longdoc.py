"""What every long-document benchmark shares (``bench passkey``, ``bench ruler``): one answer under a policy
with the context compressed and the question fed uncompressed, the run plan (dense first, then every policy
at every ratio), resuming a plan without redoing finished answers, and mean tables.

The protocol is kvpress's: the context is prefilled (and compressed by the policy at ``ratio``, the fraction
of the context removed) before the question is seen; the question then goes in at its true positions,
uncompressed, and the answer is greedy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sparseety.engine import EncodedInput, SparseEngine

DENSE = "dense"

C = TypeVar("C")
R = TypeVar("R")


@dataclass(frozen=True)
class Answer:
    """The greedy answer of one run, the KV bytes the cache held at its peak and the wall seconds."""

    text: str
    kv_cache_bytes_peak: int
    seconds: float


def answer_document(engine: SparseEngine, encoded: EncodedInput, policy_name: str, ratio: float | None, *,
                    options: dict[str, Any] | None = None, max_new_tokens: int = 16, seed: int = 0,
                    engine_options: dict[str, Any] | None = None) -> Answer:
    """Generate the answer to ``encoded`` (context ids, then question ids at ``encoded.compress_len``) with
    the context compressed by ``policy_name`` at ``ratio``.

    The budget is ``(1 - ratio)`` of the context's tokens (:func:`sparseety.policies.resolve_budget`);
    ``ratio=None`` gives no budget (a threshold policy such as ``kvzap threshold=T``);
    ``dense`` keeps everything and ignores ``engine_options`` (``prune``, ``attention_topk``), which apply
    beside every other policy.
    """
    from sparseety.policies import sized_policy

    policy = sized_policy(policy_name, None, None if policy_name == DENSE else ratio, encoded.compress_len or 0,
                          options or {})
    extras = {} if policy_name == DENSE else (engine_options or {})
    start = time.perf_counter()
    result = engine.generate(encoded, policy, max_new_tokens=max_new_tokens, tier=1, seed=seed, **extras)
    seconds = time.perf_counter() - start
    return Answer(text=result.text, kv_cache_bytes_peak=result.kv_cache_bytes_peak, seconds=round(seconds, 4))


def plan_runs(cases: Sequence[C], policies: Sequence[str], ratios: Sequence[float], *,
              dense: bool = True) -> list[tuple[str, float, C]]:
    """Every (policy, ratio, case) a run answers, in order: dense first at ratio 0 (when ``dense``), then each
    policy at each ratio, every case within each."""
    plan = ([(DENSE, 0.0)] if dense else []) + [(p, float(r)) for p in policies for r in ratios]
    return [(name, ratio, case) for name, ratio in plan for case in cases]


def run_plan(plan: Iterable[tuple[str, float, C]], answer: Callable[[str, float, C], R], *,
             key_of_case: Callable[[str, float, C], Hashable], key_of_result: Callable[[R], Hashable],
             finished: Sequence[R] = (), on_result: Callable[[R], None] | None = None) -> list[R]:
    """Answer every entry of ``plan`` in order, except those a ``finished`` result already answers.

    Returns every result in plan order (finished ones where they belong); ``on_result`` sees each new one.
    """
    done = {key_of_result(r): r for r in finished}
    results: list[R] = []
    for name, ratio, case in plan:
        key = key_of_case(name, ratio, case)
        if key in done:
            results.append(done[key])
            continue
        row = answer(name, ratio, case)
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results


def mean_by(results: Iterable[R], group: Callable[[R], str], column: Callable[[R], str],
            value: Callable[[R], float]) -> dict[str, dict[str, float]]:
    """``{group: {column: mean value}}``; groups in first-seen order, columns sorted numerically."""
    cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        cells[group(r)][column(r)].append(float(value(r)))
    return {g: {k: sum(v) / len(v) for k, v in sorted(row.items(), key=lambda kv: _number(kv[0]))}
            for g, row in cells.items()}


def _number(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)
