"""Teacher-forced fidelity: feed the dense output to a policy's engine run and compare next-token distributions.

The forward structure is that of :meth:`SparseEngine.generate`: the prompt in one forward (for the
long-document protocol the context first, compressed on its own, then the question), then one output
token per forward. So the cache the policy builds sees exactly the forwards generation would make, only
with the dense tokens fed instead of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparseety.errors import InputError

if TYPE_CHECKING:
    from sparseety.engine import EncodedInput, SparseEngine
    from sparseety.policies import Policy
    from sparseety.prune_schedule import PruneSchedule


def teacher_forced_logprobs(engine: SparseEngine, encoded: EncodedInput, policy: Policy,
                            target_ids: Sequence[int], *, seed: int = 0, prune: PruneSchedule | None = None,
                            attention_topk: int | None = None) -> torch.Tensor:
    """Log-probabilities that predict each target token under ``policy``, the targets fed one at a time.

    Parameters
    ----------
    engine : the engine (its model runs through the policy).
    encoded : the prompt, or context plus question (``compress_len`` set).
    policy : KV policy with its budget resolved.
    target_ids : ``[steps]`` the tokens to force (the dense output).
    prune, attention_topk : token pruning and top-k attention applied with the policy, as in ``generate``.

    Returns
    -------
    ``[steps, vocab]`` float64 log-softmax; row ``i`` is the distribution over token ``i`` given the
    prompt and ``target_ids[:i]``.
    """
    targets = [int(t) for t in target_ids]
    if not targets:
        raise InputError("teacher forcing needs at least one target token")
    ids = encoded.input_ids
    rows: list[torch.Tensor] = []
    with engine.open_run(encoded, policy, tier=1, seed=seed, prune=prune, attention_topk=attention_topk) as ctx:
        start = 0
        if encoded.compress_len is not None:
            ctx.settings.input_len = encoded.compress_len  # the context is the prompt of the first forward
            engine.model(input_ids=ids[:, : encoded.compress_len], past_key_values=ctx.cache, use_cache=True)
            ctx.settings.input_len = encoded.input_len
            engine.reconstruct(ctx, encoded)  # kvzip's pass over the context, if its policy has one
            start = encoded.compress_len
        out = engine.model(input_ids=ids[:, start:], past_key_values=ctx.cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1])
        engine.reconstruct(ctx, encoded)  # kvzip's pass over a plain prompt, before the first decode step
        for token in targets[:-1]:
            step = torch.tensor([[token]], dtype=ids.dtype)
            out = engine.model(input_ids=step, past_key_values=ctx.cache, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


@dataclass(frozen=True)
class Fidelity:
    """How far a policy's next-token distributions are from dense along the dense continuation.

    ``kl_per_step[i]`` is KL(dense || sparse) in nats at step ``i``; ``top1_agreement`` the fraction of
    steps whose argmax agrees; ``ppl_*`` the perplexity of the dense continuation under each.
    """

    mean_kl: float
    max_kl: float
    top1_agreement: float
    ppl_dense: float
    ppl_sparse: float
    kl_per_step: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {"mean_kl": self.mean_kl, "max_kl": self.max_kl, "top1_agreement": self.top1_agreement,
                "ppl_dense": self.ppl_dense, "ppl_sparse": self.ppl_sparse, "kl_per_step": self.kl_per_step}


def fidelity(dense: torch.Tensor, sparse: torch.Tensor, target_ids: Sequence[int]) -> Fidelity:
    """Compare two ``[steps, vocab]`` log-probability tensors along ``target_ids`` ``[steps]``."""
    if dense.shape != sparse.shape or dense.ndim != 2 or dense.shape[0] != len(target_ids):
        raise InputError(f"log-probabilities must both be [steps={len(target_ids)}, vocab]; "
                         f"got {list(dense.shape)} and {list(sparse.shape)}")
    dense, sparse = dense.double(), sparse.double()
    kl = (dense.exp() * (dense - sparse)).sum(dim=-1).clamp(min=0.0)
    agree = (dense.argmax(dim=-1) == sparse.argmax(dim=-1)).double().mean().item()
    index = torch.tensor([int(t) for t in target_ids]).unsqueeze(1)
    nll_dense = -dense.gather(1, index).mean().item()
    nll_sparse = -sparse.gather(1, index).mean().item()
    return Fidelity(
        mean_kl=kl.mean().item(), max_kl=kl.max().item(), top1_agreement=agree,
        ppl_dense=math.exp(nll_dense), ppl_sparse=math.exp(nll_sparse), kl_per_step=kl.tolist(),
    )
