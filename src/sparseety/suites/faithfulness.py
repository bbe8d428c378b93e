"""``bench faithfulness``: AOPC comprehensiveness and sufficiency of each importance ranking.

For a prompt and its dense greedy answer ``a``, a ranking orders the prompt's positions. Deleting
its top ``k`` % must hurt ``log p(a)`` most (comprehensiveness: ``log p(a | prompt) - log p(a |
prompt without them)``, higher is better); keeping only them must hurt least (sufficiency: ``log
p(a | prompt) - log p(a | only them)``, lower is better). AOPC is the mean over the fractions
(ERASER, DeYoung et al., 2020). Rankings: every ``--importance`` mode (as the engine ranks: special
tokens and sinks last), ``attention_sinkless`` (attention with position 0 last), random,
leave-one-out (one forward per position; the positions before the deleted one keep their cache, as
in AttriBoT, arXiv 2411.15102) and gradient x input (one backward); ``learned`` too when head
weights are given (:mod:`sparseety.extract.head_weights`), which :func:`add_learned` also adds to
finished cases that lack it (``--resume``) without redoing their other methods.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.extract.head_weights import HeadWeights
from sparseety.extract.scoring import FEATURES, ranking_order
from sparseety.policies import build_policy

FRACTIONS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.20)
METHODS: tuple[str, ...] = (*FEATURES, "attention_sinkless", "random", "leave_one_out", "grad_input")
LEARNED = "learned"  #: the method added when head weights are given


@dataclass
class FaithfulnessCase:
    """One prompt's figures: per method, the drop at each fraction (nats), and each mode's top 5 tokens."""

    case: int
    title: str
    prompt_tokens: int
    answer: str
    comprehensiveness: dict[str, list[float]]
    sufficiency: dict[str, list[float]]
    top5: dict[str, list[str]] = field(default_factory=dict)


def answer_logprob(model: torch.nn.Module, context: Sequence[int], answer: Sequence[int],
                   cache: DynamicCache | None = None, cached: int = 0) -> float:
    """``log p(answer | context)`` (greedy target, summed over its tokens); ``cache`` holds the first
    ``cached`` tokens of ``context + answer`` (cached < len(context)), which are then not fed again."""
    seq = list(context) + list(answer)
    ids = torch.tensor([seq[cached:]])
    logits = model(input_ids=ids, past_key_values=cache, use_cache=cache is not None).logits[0].float()
    first = len(context) - 1 - cached  # the row predicting answer[0]
    rows = logits[first : first + len(answer)].log_softmax(dim=-1)
    return float(rows.gather(1, torch.tensor(answer).view(-1, 1)).sum())


def counts(n: int, fractions: Sequence[float] = FRACTIONS) -> list[int]:
    """Tokens deleted (or kept) at each fraction of ``n`` prompt tokens: at least one."""
    return [max(1, round(f * n)) for f in fractions]


def deletion_curves(model: torch.nn.Module, prompt: Sequence[int], answer: Sequence[int], order: Sequence[int],
                    full: float, fractions: Sequence[float] = FRACTIONS) -> tuple[list[float], list[float]]:
    """``(comprehensiveness, sufficiency)`` per fraction of the ranking ``order`` (best first)."""
    comp, suff = [], []
    for k in counts(len(prompt), fractions):
        top = set(order[:k])
        comp.append(full - answer_logprob(model, [t for j, t in enumerate(prompt) if j not in top], answer))
        suff.append(full - answer_logprob(model, [t for j, t in enumerate(prompt) if j in top], answer))
    return comp, suff


def leave_one_out(model: torch.nn.Module, prompt: Sequence[int], answer: Sequence[int], full: float) -> list[float]:
    """``[n]`` drop of ``log p(answer)`` when each prompt position alone is deleted, reusing the prefix's KV."""
    out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    drops = []
    for j in range(len(prompt)):
        kept = list(prompt[:j]) + list(prompt[j + 1 :])
        cached = min(j, len(kept) - 1)
        cache = None
        if cached > 0:
            cache = DynamicCache()
            for index, (k, v) in enumerate(layers):
                cache.update(k[:, :, :cached], v[:, :, :cached], index)
        drops.append(full - answer_logprob(model, kept, answer, cache, cached))
    return drops


def grad_input(model: torch.nn.Module, prompt: Sequence[int], answer: Sequence[int]) -> list[float]:
    """``[n]`` |∇_e log p(answer) · e| of each prompt token's input embedding (one backward)."""
    seq = torch.tensor([list(prompt) + list(answer)])
    with torch.inference_mode(False), torch.enable_grad():
        embeds = model.get_input_embeddings()(seq).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits[0].float()
        first = len(prompt) - 1
        logp = logits[first : first + len(answer)].log_softmax(-1).gather(1, torch.tensor(answer).view(-1, 1)).sum()
        (grad,) = torch.autograd.grad(logp, embeds)
    return (grad[0, : len(prompt)] * embeds[0, : len(prompt)].detach()).sum(-1).abs().tolist()


@contextlib.contextmanager
def plain_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the wrapped ``model`` runs transformers' own SDPA (which masks a cached prefix's
    continuation causally); the engine's attention function is switched back after."""
    held = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(held)


def engine_ranking(engine: SparseEngine, prompt: Sequence[int], mode: str, *, max_new_tokens: int, seed: int,
                   head_weights: HeadWeights | None = None) -> tuple[list[int], list[int], torch.Tensor]:
    """``(answer ids, ranking, importance summed over layers [n])`` of one ``--importance`` mode, ranked as the
    engine ranks (special tokens and sinks last)."""
    n = len(prompt)
    result = engine.generate(EncodedInput(torch.tensor([list(prompt)])), build_policy("dense"),
                             max_new_tokens=max_new_tokens, tier=2, importance=mode, seed=seed,
                             importance_weights=head_weights if mode == LEARNED else None)
    special = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    scores = torch.from_numpy(result.arrays["importance"].astype("float32")).sum(dim=0)[:n]
    excluded = {j for j, t in enumerate(prompt) if t in special}
    sinks = {int(p) for p in result.arrays.get("sink.position", ()) if p < n}
    return result.output_ids, ranking_order(scores, sorted(excluded | sinks)), scores


def run_case(engine: SparseEngine, case: int, title: str, prompt: Sequence[int], *, max_new_tokens: int = 16,
             seed: int = 0, fractions: Sequence[float] = FRACTIONS,
             head_weights: HeadWeights | None = None) -> FaithfulnessCase:
    """Every method's curves on one prompt (its dense greedy answer the target); ``learned`` with ``head_weights``."""
    model, n = engine.model, len(prompt)
    special = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    orders: dict[str, list[int]] = {}
    answer: list[int] | None = None
    top5: dict[str, list[str]] = {}
    modes = [*FEATURES, LEARNED] if head_weights is not None else list(FEATURES)
    for mode in modes:
        output, orders[mode], scores = engine_ranking(engine, prompt, mode, max_new_tokens=max_new_tokens, seed=seed,
                                                      head_weights=head_weights)
        if answer is None:
            answer = output
        assert output == answer, "importance changed the dense answer"
        if mode == "attention":
            orders["attention_sinkless"] = ranking_order(scores, sorted({j for j, t in enumerate(prompt)
                                                                         if t in special} | {0}))
        top5[mode] = [engine.decode(prompt[j]) for j in orders[mode][:5]]
    assert answer is not None
    comp, suff = {}, {}
    with plain_attention(model):
        with torch.inference_mode():
            full = answer_logprob(model, prompt, answer)
            loo = leave_one_out(model, prompt, answer, full)
        orders["leave_one_out"] = ranking_order(torch.tensor(loo))
        orders["grad_input"] = ranking_order(torch.tensor(grad_input(model, prompt, answer)))
        shuffled = list(range(n))
        random.Random(seed * 1_000_003 + case).shuffle(shuffled)
        orders["random"] = shuffled
        with torch.inference_mode():
            for method in (*METHODS, LEARNED):
                if method in orders:
                    comp[method], suff[method] = deletion_curves(model, prompt, answer, orders[method], full,
                                                                 fractions)
    return FaithfulnessCase(case=case, title=title, prompt_tokens=n, answer=engine.tokenizer.decode(answer),
                            comprehensiveness=comp, sufficiency=suff, top5=top5)


def add_learned(engine: SparseEngine, row: FaithfulnessCase, prompt: Sequence[int], head_weights: HeadWeights, *,
                max_new_tokens: int = 16, seed: int = 0, fractions: Sequence[float] = FRACTIONS) -> FaithfulnessCase:
    """``row`` (a finished case of ``prompt``) with the ``learned`` method's curves and top 5 added (its
    other methods are not redone)."""
    answer, order, _ = engine_ranking(engine, prompt, LEARNED, max_new_tokens=max_new_tokens, seed=seed,
                                      head_weights=head_weights)
    if engine.tokenizer.decode(answer) != row.answer:
        raise ValueError(f"case {row.case} ({row.title}): the dense answer is not the one recorded; start over")
    with plain_attention(engine.model), torch.inference_mode():
        full = answer_logprob(engine.model, prompt, answer)
        comp, suff = deletion_curves(engine.model, prompt, answer, order, full, fractions)
    row.comprehensiveness[LEARNED], row.sufficiency[LEARNED] = comp, suff
    row.top5[LEARNED] = [engine.decode(prompt[j]) for j in order[:5]]
    return row


def methods_of(cases: Sequence[FaithfulnessCase]) -> list[str]:
    """The methods every case has, in table order (:data:`METHODS`, then ``learned``)."""
    return [m for m in (*METHODS, LEARNED) if cases and all(m in c.comprehensiveness for c in cases)]


def summarize(cases: Sequence[FaithfulnessCase], fractions: Sequence[float] = FRACTIONS) -> dict[str, Any]:
    """Per method: mean curves, AOPC (mean over fractions) of both, and comprehensiveness AOPC over leave-one-out's."""
    table: dict[str, Any] = {}
    if not cases:
        return table
    for method in methods_of(cases):
        comp = [sum(c.comprehensiveness[method][i] for c in cases) / len(cases) for i in range(len(fractions))]
        suff = [sum(c.sufficiency[method][i] for c in cases) / len(cases) for i in range(len(fractions))]
        table[method] = {"comprehensiveness": comp, "sufficiency": suff,
                         "aopc_comprehensiveness": sum(comp) / len(comp), "aopc_sufficiency": sum(suff) / len(suff)}
    ceiling = table["leave_one_out"]["aopc_comprehensiveness"]
    for row in table.values():
        row["of_leave_one_out"] = row["aopc_comprehensiveness"] / ceiling if ceiling else None
    return table


def report_document(model: str, fractions: Sequence[float], cases: Sequence[FaithfulnessCase],
                    weights: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``faithfulness.json`` document (without ``complete`` and ``run``, which the CLI adds); ``weights``:
    the learned method's :meth:`~sparseety.extract.head_weights.HeadWeights.identity`."""
    return {"kind": "faithfulness", "model": model, "fractions": list(fractions), "importance_weights": weights,
            "methods": methods_of(cases) or list(METHODS),
            "summary": summarize(cases, fractions), "results": [asdict(c) for c in cases]}


def run_faithfulness(engine: SparseEngine, prompts: Sequence[tuple[str, list[int]]], *, max_new_tokens: int = 16,
                     seed: int = 0, finished: Sequence[FaithfulnessCase] = (),
                     on_result: Callable[[FaithfulnessCase], None] | None = None,
                     head_weights: HeadWeights | None = None) -> list[FaithfulnessCase]:
    """Every prompt not in ``finished`` (by index), each reported to ``on_result`` as it completes."""
    done = {c.case for c in finished}
    cases = list(finished)
    for index, (title, prompt) in enumerate(prompts):
        if index in done:
            continue
        row = run_case(engine, index, title, prompt, max_new_tokens=max_new_tokens, seed=seed,
                       head_weights=head_weights)
        cases.append(row)
        if on_result is not None:
            on_result(row)
    return sorted(cases, key=lambda c: c.case)
