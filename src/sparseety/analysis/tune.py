"""``tune``: the smallest budget whose teacher-forced fidelity (or passkey accuracy) meets a bar.

The search is a bisection over budgets ``lo, lo + step, ..., hi``: it evaluates ``hi`` (if even that
fails there is no answer), then ``lo``, then halves the interval between a failing and a meeting
budget. The answer therefore always meets the bar and the budget one ``step`` below it does not.
Fidelity usually improves with the budget; where it does not, the answer is the boundary the
bisection found, and the curve shows every budget it evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sparseety.errors import ConfigError

if TYPE_CHECKING:
    from sparseety.suites.passkey import PasskeyCase
    from sparseety.engine import EncodedInput, SparseEngine

#: metric -> (higher is better, smallest valid threshold, largest valid threshold)
METRICS: dict[str, tuple[bool, float, float]] = {
    "top1_agreement": (True, 0.0, 1.0),
    "mean_kl": (False, 0.0, float("inf")),
    "passkey": (True, 0.0, 1.0),
}


def check_metric(metric: str, threshold: float) -> None:
    """Reject unknown metrics and thresholds outside the metric's range."""
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; valid metrics: {', '.join(METRICS)}")
    _, low, high = METRICS[metric]
    if not low <= threshold <= high:
        upper = "" if high == float("inf") else f" and <= {high:g}"
        raise ConfigError(f"--threshold for {metric} must be >= {low:g}{upper}, got {threshold:g}")


def check_tunable(policy: str, options: dict[str, str] | None = None) -> None:
    """Refuse a policy that never evicts (every budget keeps the whole cache, so any answer is meaningless), or
    one that ``options`` (``--policy-opt``) put in a mode without a budget (kvzap's ``threshold=``)."""
    from sparseety.policies.registry import get_policy_class, list_policies

    cls = get_policy_class(policy)
    if not cls.evicts:
        evicting = ", ".join(cls.name for cls in list_policies() if cls.evicts)
        raise ConfigError(f"policy {policy!r} never evicts, so its budget changes nothing and no budget can be "
                          f"tuned; tune a policy that evicts: {evicting}")
    if options and not cls.needs_budget(options):
        given = ", ".join(f"{k}={v}" for k, v in options.items())
        raise ConfigError(f"tune searches the budget, but --policy-opt {given} runs {policy} without one (it keeps "
                          "what scores above the threshold instead); drop threshold= from --policy-opt to tune "
                          "its budget")


def meets(metric: str, value: float, threshold: float) -> bool:
    """Whether ``value`` meets the bar (>= for agreement and accuracy, <= for KL)."""
    return value >= threshold if METRICS[metric][0] else value <= threshold


@dataclass(frozen=True)
class TunePoint:
    budget: int
    ratio: float
    value: float
    meets: bool


@dataclass
class TuneResult:
    """The evaluated curve (ascending budget) and the answer (None when even the largest budget fails)."""

    policy: str
    metric: str
    threshold: float
    curve: list[TunePoint] = field(default_factory=list)
    answer: TunePoint | None = None

    def to_json(self) -> dict[str, Any]:
        answer = None if self.answer is None else {k: v for k, v in asdict(self.answer).items() if k != "meets"}
        return {"kind": "tune", "policy": self.policy, "metric": self.metric, "threshold": self.threshold,
                "curve": [asdict(p) for p in self.curve], "answer": answer}


def bisect_budget(ok: Callable[[int], bool], lo: int, hi: int, step: int = 1) -> int | None:
    """Smallest budget on the grid ``lo, lo+step, ..., hi`` (``hi`` always included) at a boundary of ``ok``.

    Returns a budget ``b`` with ``ok(b)`` and ``b == lo`` or ``not ok(previous grid point)``; None when
    ``ok(hi)`` is false. ``ok`` is called O(log n) times.
    """
    if step <= 0:
        raise ConfigError(f"--step must be positive, got {step}")
    if not 1 <= lo <= hi:
        raise ConfigError(f"need 1 <= --min-budget <= --max-budget, got {lo} and {hi}")
    grid = list(range(lo, hi, step)) + [hi]
    if not ok(grid[-1]):
        return None
    if ok(grid[0]):
        return grid[0]
    bad, good = 0, len(grid) - 1
    while good - bad > 1:
        mid = (bad + good) // 2
        if ok(grid[mid]):
            good = mid
        else:
            bad = mid
    return grid[good]


def smallest_valid_budget(policy: str, options: dict[str, Any], upper: int) -> int:
    """The smallest budget ``build_policy`` accepts for ``policy`` with ``options`` (at most ``upper``)."""
    from sparseety.policies import build_policy

    for budget in range(1, upper + 1):
        try:
            build_policy(policy, budget, options)
            return budget
        except ConfigError:
            continue
    build_policy(policy, upper, options)  # raises the policy's own message
    return upper


OnPoint = Callable[[TunePoint, TuneResult, int], None]
"""Called after each newly evaluated budget: the point, the result so far, and about how many
evaluations the whole search takes."""


def evaluations(lo: int, hi: int, step: int) -> int:
    """About how many budgets the bisection of ``lo..hi`` evaluates (for progress)."""
    points = len(range(lo, hi, step)) + 1
    return 1 if points == 1 else 2 + max(0, math.ceil(math.log2(points - 1)))


def _search(policy: str, metric: str, threshold: float, evaluate: Callable[[int], float], lo: int, hi: int,
            step: int, context_len: float, known: dict[int, float] | None = None,
            on_point: OnPoint | None = None) -> TuneResult:
    result = TuneResult(policy=policy, metric=metric, threshold=threshold)
    seen: dict[int, TunePoint] = {}
    estimate = evaluations(lo, hi, step)

    def point(budget: int, value: float) -> TunePoint:
        return TunePoint(budget, round(max(0.0, 1.0 - budget / context_len), 6), value, meets(metric, value, threshold))

    def ok(budget: int) -> bool:
        if budget not in seen:
            if known is not None and budget in known:  # evaluated before a resumed run was killed
                seen[budget] = point(budget, float(known[budget]))
            else:
                seen[budget] = point(budget, float(evaluate(budget)))
                if on_point is not None:
                    result.curve = [seen[b] for b in sorted(seen)]
                    on_point(seen[budget], result, estimate)
        return seen[budget].meets

    answer = bisect_budget(ok, lo, hi, step)
    result.curve = [seen[b] for b in sorted(seen)]
    result.answer = None if answer is None else seen[answer]
    return result


def tune_fidelity(engine: SparseEngine, encoded: EncodedInput, policy: str, metric: str, threshold: float, *,
                  options: dict[str, Any] | None = None, max_new_tokens: int = 64, min_budget: int | None = None,
                  max_budget: int | None = None, step: int = 1, seed: int = 0,
                  engine_options: dict[str, Any] | None = None, known: dict[int, float] | None = None,
                  on_point: OnPoint | None = None) -> TuneResult:
    """Search the budget of ``policy`` on one input by teacher-forced ``top1_agreement`` or ``mean_kl``.

    ``engine_options`` (``prune``, ``attention_topk``) apply beside the policy at every budget.
    ``known`` budgets (of a resumed run) are not evaluated again; ``on_point`` follows each new one.

    The dense output is generated once; each budget costs one teacher-forced pass of the sparse policy.
    ``max_budget`` defaults to a budget that never evicts (the compressed context for the
    long-document protocol, else prompt plus output).
    """
    from sparseety.analysis.compare import dense_policy
    from sparseety.analysis.fidelity import fidelity, teacher_forced_logprobs
    from sparseety.policies import build_policy

    check_metric(metric, threshold)
    check_tunable(policy)
    if metric == "passkey":
        raise ConfigError("the passkey metric builds its own cases; use tune_passkey")
    options = options or {}
    context_len = encoded.compress_len or encoded.input_len
    hi = max_budget or (encoded.compress_len or encoded.input_len + max_new_tokens)
    lo = min_budget or smallest_valid_budget(policy, options, hi)
    baseline = engine.generate(encoded, dense_policy(), max_new_tokens=max_new_tokens, tier=0, seed=seed)
    targets = baseline.output_ids
    dense_lp = teacher_forced_logprobs(engine, encoded, dense_policy(), targets, seed=seed)

    def evaluate(budget: int) -> float:
        sparse_lp = teacher_forced_logprobs(engine, encoded, build_policy(policy, budget, options), targets, seed=seed,
                                            **(engine_options or {}))
        return getattr(fidelity(dense_lp, sparse_lp, targets), metric)

    return _search(policy, metric, threshold, evaluate, lo, hi, step, context_len, known, on_point)


def tune_passkey(engine: SparseEngine, cases: Sequence[PasskeyCase], policy: str, threshold: float, *,
                 options: dict[str, Any] | None = None, max_new_tokens: int = 16, min_budget: int | None = None,
                 max_budget: int | None = None, step: int = 1, seed: int = 0, chat: bool | None = None,
                 engine_options: dict[str, Any] | None = None, known: dict[int, float] | None = None,
                 on_point: OnPoint | None = None) -> TuneResult:
    """Search the budget of ``policy`` by passkey accuracy over ``cases`` (long-document protocol);
    ``engine_options`` (``prune``, ``attention_topk``) apply beside the policy; ``known`` and
    ``on_point`` as in :func:`tune_fidelity`."""
    from sparseety.suites.passkey import QUESTION, is_correct
    from sparseety.engine import encode_document
    from sparseety.policies import build_policy

    check_metric("passkey", threshold)
    check_tunable(policy)
    if not cases:
        raise ConfigError("the passkey metric needs at least one case")
    options = options or {}
    encoded = [encode_document(engine.tokenizer, c.context, QUESTION, chat) for c in cases]
    longest = max(e.compress_len or 0 for e in encoded)
    mean_len = sum(e.compress_len or 0 for e in encoded) / len(encoded)
    hi = max_budget or longest
    lo = min_budget or smallest_valid_budget(policy, options, hi)

    def evaluate(budget: int) -> float:
        kv = build_policy(policy, budget, options)
        right = 0
        for case, enc in zip(cases, encoded):
            out = engine.generate(enc, kv, max_new_tokens=max_new_tokens, tier=0, seed=seed, **(engine_options or {}))
            right += is_correct(case.passkey, out.text)
        return right / len(cases)

    return _search(policy, "passkey", threshold, evaluate, lo, hi, step, mean_len, known, on_point)
