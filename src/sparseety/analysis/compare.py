"""``compare``: a dense baseline and a sparse run on the same input, with the diff, fidelity and quality."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparseety.analysis.fidelity import Fidelity, fidelity, teacher_forced_logprobs
from sparseety.analysis.quality import Quality, quality
from sparseety.analysis.token_diff import TokenDiff, token_diff
from sparseety.options import GenerationOptions, options_from

if TYPE_CHECKING:
    from sparseety.engine import EncodedInput, RunResult, SparseEngine
    from sparseety.policies import Policy


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


def compare(engine: SparseEngine, encoded: EncodedInput, policy: Policy | None = None,
            options: GenerationOptions | None = None, *, embeddings: bool = True,
            on_phase: Callable[[str], None] | None = None, **fields: Any) -> Comparison:
    """Run dense and ``policy`` on ``encoded`` and measure the difference.

    Fidelity is teacher-forced along the dense output: both the dense and the sparse engine runs are
    fed the dense tokens, so every step compares distributions over the same next token. ``options``
    (or its ``fields``, as in :meth:`SparseEngine.generate`; ``policy`` None builds the options' policy)
    set both runs; ``speculative``, ``prune`` and ``attention_topk`` apply to the sparse side only, the
    importance options (how the traces score important tokens) to both traces.
    ``on_phase`` is called after each of the four runs with its name (progress).
    """
    done = on_phase or (lambda _phase: None)
    options = options_from(options, **fields)
    if policy is None:
        policy = options.policy_for(encoded.compress_len or encoded.input_len)
    dense = options.replace(speculative=None, prune=None, prune_opts={}, attention_topk=None)
    baseline = engine.generate(encoded, dense_policy(), dense)
    done("dense baseline generated")
    sparse = engine.generate(encoded, policy, options)
    done(f"{policy.name} generated")
    targets = baseline.output_ids
    dense_lp = teacher_forced_logprobs(engine, encoded, dense_policy(), targets, seed=options.seed)
    done("dense teacher-forced")
    sparse_lp = teacher_forced_logprobs(engine, encoded, policy, targets, seed=options.seed,
                                        prune=options.prune_schedule(engine.num_layers),
                                        attention_topk=options.attention_topk)
    done(f"{policy.name} teacher-forced")
    return Comparison(
        baseline=baseline,
        sparse=sparse,
        diff=token_diff(baseline.output_ids, sparse.output_ids, engine.decode),
        fidelity=fidelity(dense_lp, sparse_lp, targets),
        quality=quality(baseline.text, sparse.text, embeddings=embeddings),
    )
