"""Run passkey cases through the long-document protocol for each policy and ratio, and tabulate accuracy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sparseety.suites.longdoc import DENSE, answer_document, mean_by, plan_runs, run_plan
from sparseety.suites.passkey import ANSWER_PREFIX, QUESTION, PasskeyCase, is_correct

if TYPE_CHECKING:
    from sparseety.engine import SparseEngine

__all__ = ["DENSE", "PasskeyReport", "PasskeyResult", "answer_case", "plan_cases", "result_key", "run_passkey"]


@dataclass(frozen=True)
class PasskeyResult:
    """One (policy, ratio, case) answer."""

    policy: str
    ratio: float
    length: int
    depth: float
    passkey: str
    answer: str
    correct: bool
    kv_cache_bytes_peak: int
    seconds: float


@dataclass
class PasskeyReport:
    """Cases, results and the accuracy tables (the ``passkey.json`` document)."""

    model: str
    seed: int
    cases: list[PasskeyCase]
    results: list[PasskeyResult] = field(default_factory=list)

    def accuracy(self) -> dict[str, dict[str, float]]:
        """``{policy: {str(ratio): fraction correct}}`` over every case."""
        return _mean_by(self.results, lambda r: str(float(r.ratio)))

    def by_depth(self) -> dict[str, dict[str, float]]:
        """``{policy: {str(depth): fraction correct}}`` over every ratio and length."""
        return _mean_by(self.results, lambda r: str(float(r.depth)))

    def to_json(self) -> dict[str, Any]:
        return {"kind": "passkey", "model": self.model, "seed": self.seed,
                "cases": [c.to_dict() for c in self.cases], "results": [asdict(r) for r in self.results],
                "accuracy": self.accuracy(), "by_depth": self.by_depth()}


def _mean_by(results: Sequence[PasskeyResult], key: Callable[[PasskeyResult], str]) -> dict[str, dict[str, float]]:
    return mean_by(results, lambda r: r.policy, key, lambda r: r.correct)


def answer_case(engine: SparseEngine, case: PasskeyCase, policy_name: str, ratio: float, *,
                options: dict[str, Any] | None = None, max_new_tokens: int = 16, chat: bool | None = None,
                seed: int = 0, engine_options: dict[str, Any] | None = None) -> PasskeyResult:
    """Ask ``QUESTION`` about ``case.context`` with the context compressed by ``policy_name`` at ``ratio``.

    ``engine_options`` (``prune``, ``attention_topk``) apply beside every policy but the dense sanity row.
    """
    from sparseety.engine import encode_document
    from sparseety.engine.inputs import encode_with_answer_prefix, use_chat

    if use_chat(engine.tokenizer, chat):
        encoded = encode_document(engine.tokenizer, case.context, QUESTION, chat)
    else:  # a base model (no chat template): an answer prefix, as RULER's tasks, so it answers rather than continues
        encoded = encode_with_answer_prefix(engine.tokenizer, case.context, QUESTION, ANSWER_PREFIX, chat)
    answer = answer_document(engine, encoded, policy_name, ratio, options=options, max_new_tokens=max_new_tokens,
                             seed=seed, engine_options=engine_options)
    return PasskeyResult(
        policy=policy_name, ratio=float(ratio), length=case.length, depth=case.depth, passkey=case.passkey,
        answer=answer.text, correct=is_correct(case.passkey, answer.text),
        kv_cache_bytes_peak=answer.kv_cache_bytes_peak, seconds=answer.seconds,
    )


def run_passkey(engine: SparseEngine, cases: Sequence[PasskeyCase], policies: Sequence[str],
                ratios: Sequence[float], *, model: str, seed: int = 0, max_new_tokens: int = 16,
                chat: bool | None = None, dense: bool = True,
                on_result: Callable[[PasskeyResult], None] | None = None,
                engine_options: dict[str, Any] | None = None,
                finished: Sequence[PasskeyResult] = (),
                policy_options: dict[str, dict[str, Any]] | None = None) -> PasskeyReport:
    """Every case under dense (the sanity row, when ``dense``) and under each policy at each ratio.

    ``finished`` results (of a resumed run) are kept and their cases not run again; ``policy_options``
    gives each policy its options by name (``learned``'s ``model=FILE``).
    """
    results = run_plan(
        plan_cases(cases, policies, ratios, dense=dense),
        lambda name, ratio, case: answer_case(engine, case, name, ratio, max_new_tokens=max_new_tokens, chat=chat,
                                              seed=seed, engine_options=engine_options,
                                              options=(policy_options or {}).get(name)),
        key_of_case=lambda name, ratio, case: (name, float(ratio), case.length, float(case.depth)),
        key_of_result=result_key, finished=finished, on_result=on_result)
    return PasskeyReport(model=model, seed=seed, cases=list(cases), results=results)


def plan_cases(cases: Sequence[PasskeyCase], policies: Sequence[str], ratios: Sequence[float], *,
               dense: bool = True) -> list[tuple[str, float, PasskeyCase]]:
    """Every (policy, ratio, case) a run answers, in order: dense first (when ``dense``)."""
    return plan_runs(cases, policies, ratios, dense=dense)


def result_key(result: PasskeyResult) -> tuple[str, float, int, float]:
    """What identifies a result's case within a run: policy, ratio, length, depth."""
    return (result.policy, float(result.ratio), int(result.length), float(result.depth))
