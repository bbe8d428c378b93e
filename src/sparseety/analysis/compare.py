"""``compare``: a dense baseline and a sparse run on the same input, with the diff, fidelity and quality."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparseety.analysis.fidelity import Fidelity, fidelity, teacher_forced_logprobs
from sparseety.analysis.quality import Quality, quality
from sparseety.analysis.token_diff import TokenDiff, token_diff

if TYPE_CHECKING:
    from sparseety.engine import EncodedInput, RunResult, SparseEngine
    from sparseety.policies import Policy
    from sparseety.policies.prune import PruneSchedule


@dataclass
class Comparison:
    """Both runs and what separates them."""

    baseline: RunResult
    sparse: RunResult
    diff: TokenDiff
    fidelity: Fidelity
    quality: Quality

    def section(self) -> dict[str, Any]:
        """The ``compare`` section stored with the sparse run's trace."""
        return {"baseline_request_id": self.baseline.request_id, "diff": self.diff.to_dict(),
                "fidelity": self.fidelity.to_dict(), "quality": self.quality.to_dict()}

    def to_json(self) -> dict[str, Any]:
        """The ``sparseety compare --json`` object."""
        return {"baseline": self.baseline.to_json(), "sparse": self.sparse.to_json(), "diff": self.diff.to_dict(),
                "fidelity": self.fidelity.to_dict(), "quality": self.quality.to_dict()}


def dense_policy() -> Policy:
    from sparseety.policies import build_policy

    return build_policy("dense")


def compare(engine: SparseEngine, encoded: EncodedInput, policy: Policy, *, max_new_tokens: int = 64,
            tier: int = 2, top_k: int = 16, speculative: int | None = None, seed: int = 0,
            embeddings: bool = True, prune: PruneSchedule | None = None, attention_topk: int | None = None,
            layers: str | None = None, min_score: float = 0.0, importance: str = "attention",
            importance_weights: Any = None, on_phase: Callable[[str], None] | None = None) -> Comparison:
    """Run dense and ``policy`` on ``encoded`` and measure the difference.

    Fidelity is teacher-forced along the dense output: both the dense and the sparse engine runs are
    fed the dense tokens, so every step compares distributions over the same next token. ``prune`` and
    ``attention_topk`` apply to the sparse side only; ``layers``, ``min_score``, ``importance`` and
    ``importance_weights`` (how the traces score important tokens) to both traces.
    ``on_phase`` is called after each of the four runs with its name (progress).
    """
    done = on_phase or (lambda _phase: None)
    common = dict(max_new_tokens=max_new_tokens, tier=tier, top_k=top_k, seed=seed, layers=layers, min_score=min_score,
                  importance=importance, importance_weights=importance_weights)
    baseline = engine.generate(encoded, dense_policy(), **common)
    done("dense baseline generated")
    sparse = engine.generate(encoded, policy, speculative=speculative, prune=prune, attention_topk=attention_topk,
                             **common)
    done(f"{policy.name} generated")
    targets = baseline.output_ids
    dense_lp = teacher_forced_logprobs(engine, encoded, dense_policy(), targets, seed=seed)
    done("dense teacher-forced")
    sparse_lp = teacher_forced_logprobs(engine, encoded, policy, targets, seed=seed, prune=prune,
                                        attention_topk=attention_topk)
    done(f"{policy.name} teacher-forced")
    return Comparison(
        baseline=baseline,
        sparse=sparse,
        diff=token_diff(baseline.output_ids, sparse.output_ids, engine.decode),
        fidelity=fidelity(dense_lp, sparse_lp, targets),
        quality=quality(baseline.text, sparse.text, embeddings=embeddings),
    )
