"""Run RULER-style cases through the long-document protocol for each policy and ratio, and tabulate recall.

The same plan, resume and answer code as ``bench passkey`` (:mod:`sparseety.suites.longdoc`); only the cases,
their encoding (question plus RULER's answer prefix) and the scoring (recall of the expected items) differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sparseety.suites.longdoc import DENSE, answer_document, mean_by, plan_runs, run_plan
from sparseety.suites.ruler import RulerCase, encode_case, score

if TYPE_CHECKING:
    from sparseety.engine import SparseEngine

__all__ = ["DENSE", "RulerReport", "RulerResult", "answer_ruler_case", "result_key", "run_ruler"]


@dataclass(frozen=True)
class RulerResult:
    """One (policy, ratio, case) answer; ``score`` is the fraction of ``expected`` found in ``answer``."""

    policy: str
    ratio: float
    task: str
    length: int
    index: int
    expected: list[str]
    answer: str
    score: float
    kv_cache_bytes_peak: int
    seconds: float


@dataclass
class RulerReport:
    """Cases, results and the tables (the ``ruler.json`` document)."""

    model: str
    seed: int
    cases: list[RulerCase]
    results: list[RulerResult] = field(default_factory=list)

    def by_task(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{task: {policy: {str(ratio): mean score}}}`` over that task's cases and lengths."""
        tasks = list(dict.fromkeys(r.task for r in self.results))
        return {t: mean_by([r for r in self.results if r.task == t], lambda r: r.policy,
                           lambda r: str(float(r.ratio)), lambda r: r.score) for t in tasks}

    def accuracy(self) -> dict[str, dict[str, float]]:
        """``{policy: {str(ratio): mean score}}`` over every task (each weighted by its number of cases)."""
        return mean_by(self.results, lambda r: r.policy, lambda r: str(float(r.ratio)), lambda r: r.score)

    def by_length(self) -> dict[str, dict[str, float]]:
        """``{policy@ratio: {str(length): mean score}}`` over every task."""
        return mean_by(self.results, lambda r: f"{r.policy}@{float(r.ratio)}", lambda r: str(r.length),
                       lambda r: r.score)

    def kv_bytes(self) -> dict[str, dict[str, float]]:
        """``{policy: {str(ratio): mean peak KV-cache bytes}}``."""
        return mean_by(self.results, lambda r: r.policy, lambda r: str(float(r.ratio)),
                       lambda r: r.kv_cache_bytes_peak)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "ruler", "model": self.model, "seed": self.seed,
                "tasks": list(dict.fromkeys(c.task for c in self.cases)),
                "cases": [c.to_dict() for c in self.cases], "results": [asdict(r) for r in self.results],
                "accuracy": self.accuracy(), "by_task": self.by_task(), "by_length": self.by_length(),
                "kv_bytes": self.kv_bytes()}


def answer_ruler_case(engine: SparseEngine, case: RulerCase, policy_name: str, ratio: float, *,
                      options: dict[str, Any] | None = None, max_new_tokens: int | None = None,
                      chat: bool | None = None, seed: int = 0,
                      engine_options: dict[str, Any] | None = None) -> RulerResult:
    """Ask ``case``'s question with its context compressed by ``policy_name`` at ``ratio``; score the answer.

    ``max_new_tokens`` None: the task's own limit (:data:`sparseety.suites.ruler.MAX_NEW_TOKENS`).
    """
    encoded = encode_case(engine.tokenizer, case, chat)
    answer = answer_document(engine, encoded, policy_name, ratio, options=options,
                             max_new_tokens=max_new_tokens or case.max_new_tokens, seed=seed,
                             engine_options=engine_options)
    return RulerResult(policy=policy_name, ratio=float(ratio), task=case.task, length=case.length, index=case.index,
                       expected=list(case.expected), answer=answer.text, score=score(case.expected, answer.text),
                       kv_cache_bytes_peak=answer.kv_cache_bytes_peak, seconds=answer.seconds)


def run_ruler(engine: SparseEngine, cases: Sequence[RulerCase], policies: Sequence[str], ratios: Sequence[float], *,
              model: str, seed: int = 0, max_new_tokens: int | None = None, chat: bool | None = None,
              dense: bool = True, options: dict[str, dict[str, Any]] | None = None,
              on_result: Callable[[RulerResult], None] | None = None,
              engine_options: dict[str, Any] | None = None, finished: Sequence[RulerResult] = ()) -> RulerReport:
    """Every case under dense (when ``dense``) and under each policy at each ratio (``options`` per policy).

    ``finished`` results (of a resumed run) are kept and their cases not run again.
    """
    results = run_plan(
        plan_runs(cases, policies, ratios, dense=dense),
        lambda name, ratio, case: answer_ruler_case(
            engine, case, name, ratio, options=(options or {}).get(name), max_new_tokens=max_new_tokens, chat=chat,
            seed=seed, engine_options=engine_options),
        key_of_case=lambda name, ratio, case: (name, float(ratio), case.task, case.length, case.index),
        key_of_result=result_key, finished=finished, on_result=on_result)
    return RulerReport(model=model, seed=seed, cases=list(cases), results=results)


def result_key(result: RulerResult) -> tuple[str, float, str, int, int]:
    """What identifies a result's case within a run: policy, ratio, task, length, index."""
    return (result.policy, float(result.ratio), result.task, int(result.length), int(result.index))
