"""Fit ``--importance learned``'s head weights, in the manner of AT2 (Cohen-Wang et al., 2025, arXiv 2504.13752).

For each training prompt (a passage plus a question, :func:`sparseety.suites.faithfulness_prompts.make_prompts`)
and its dense greedy answer ``a``:

* features ``X[l, h, j]``: head ``h`` of layer ``l``'s score of prompt position ``j`` summed over the
  answer's query rows, exactly as the engine records it (:func:`sparseety.extract.scoring.head_scores`
  of the ``feature`` mode: the last prompt row and each fed answer token's row);
* targets: the drop of ``log p(a)`` when position ``j`` alone is deleted (leave-one-out, with the
  prefix's KV reused) and when ``ablations`` random sets of 1-20 % of the positions are deleted.

The surrogate predicts a deletion's drop as the sum, over the deleted positions, of ``Σ_lh θ_lh X[l, h, j]``;
``θ >= 0`` maximizes the mean, over prompts, of the Pearson correlation between predicted and actual
drops (projected Adam, from ``θ = 1``, i.e. the plain ``feature`` mode). Position 0 (the attention sink,
never ranked) is never deleted. ``θ`` is scaled to mean 1 so that scores keep the feature's scale.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.extract.head_weights import HeadWeights
from sparseety.extract.scoring import FEATURES, head_scores, slot_norms
from sparseety.policies import build_policy

STEPS = 400
LEARNING_RATE = 0.05


@dataclass
class TrainingPrompt:
    """One prompt's features ``[layers, heads, n]``, deletion masks ``[m, n]`` (1 = deleted) and drops ``[m]``."""

    title: str
    features: torch.Tensor
    masks: torch.Tensor
    drops: torch.Tensor


def head_features(engine: SparseEngine, prompt: Sequence[int], answer: Sequence[int], feature: str) -> torch.Tensor:
    """``[layers, heads, n]``: each head's ``feature`` score of each prompt position, summed over the
    query rows that predict ``answer`` (one eager forward of the prompt and the answer less its last token)."""
    if feature not in FEATURES:
        raise ValueError(f"feature must be one of {', '.join(FEATURES)}, got {feature!r}")
    model, n = engine.model, len(prompt)
    grams = engine.output_grams() if feature == "output" else None
    held = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(prompt) + list(answer[:-1])]), output_attentions=True,
                        use_cache=True)
    finally:
        model.set_attn_implementation(held)
    layers = []
    for layer, attention in enumerate(out.attentions):
        rows = attention[0, :, n - 1 :, :n].float().transpose(0, 1)  # [answer rows, heads, n]
        norms = None
        if feature != "attention":
            values = out.past_key_values.layers[layer].values[0, :, :n]  # [kv_heads, n, d]
            norms = slot_norms(values, feature, None if grams is None else grams[layer])  # type: ignore[arg-type]
        layers.append(head_scores(rows, norms).sum(dim=0))
    return torch.stack(layers)


def deletion_masks(n: int, ablations: int, rng: random.Random) -> torch.Tensor:
    """``[n - 1 + ablations, n]``: each position 1..n-1 alone, then ``ablations`` random sets of 1-20 %."""
    rows = [torch.nn.functional.one_hot(torch.tensor(j), n) for j in range(1, n)]
    for _ in range(ablations):
        k = max(1, round(rng.uniform(0.01, 0.20) * n))
        row = torch.zeros(n, dtype=torch.long)
        row[rng.sample(range(1, n), min(k, n - 1))] = 1
        rows.append(row)
    return torch.stack(rows).float()


def training_prompt(engine: SparseEngine, title: str, prompt: Sequence[int], *, feature: str, ablations: int,
                    max_new_tokens: int, seed: int) -> TrainingPrompt:
    """Features, masks and measured drops of one prompt (its dense greedy answer the target)."""
    from sparseety.suites.faithfulness import answer_logprob, leave_one_out, plain_attention

    n = len(prompt)
    if n < 3:
        raise ValueError(f"a training prompt needs at least 3 tokens, got {n} ({title})")
    answer = engine.generate(EncodedInput(torch.tensor([list(prompt)])), build_policy("dense"),
                             max_new_tokens=max_new_tokens, tier=0).output_ids
    features = head_features(engine, prompt, answer, feature)
    masks = deletion_masks(n, ablations, random.Random(seed * 1_000_003 + n))
    with plain_attention(engine.model), torch.inference_mode():
        full = answer_logprob(engine.model, prompt, answer)
        drops = leave_one_out(engine.model, prompt, answer, full)[1:]
        for row in masks[n - 1 :]:
            kept = [t for j, t in enumerate(prompt) if not row[j]]
            drops.append(full - answer_logprob(engine.model, kept, answer))
    return TrainingPrompt(title, features, masks, torch.tensor(drops, dtype=torch.float32))


def _correlation(predicted: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    p, a = predicted - predicted.mean(), actual - actual.mean()
    return (p * a).sum() / (p.norm() * a.norm()).clamp(min=1e-12)


def mean_correlation(prompts: Sequence[TrainingPrompt], weights: torch.Tensor) -> float:
    """Mean over ``prompts`` of the correlation between the surrogate's predicted drops and the measured ones."""
    with torch.no_grad():
        return float(sum(_correlation(_design(p) @ weights.reshape(-1), p.drops) for p in prompts) / len(prompts))


def _design(prompt: TrainingPrompt) -> torch.Tensor:
    """``[m, layers * heads]``: each deletion's summed features."""
    return prompt.masks @ prompt.features.reshape(-1, prompt.features.shape[-1]).T


def fit_weights(prompts: Sequence[TrainingPrompt], steps: int = STEPS, lr: float = LEARNING_RATE) -> torch.Tensor:
    """``[layers, heads]`` θ >= 0 (mean 1) maximizing the mean correlation (see the module docstring)."""
    if not prompts:
        raise ValueError("no training prompts")
    shape = prompts[0].features.shape[:2]
    designs = [_design(p) for p in prompts]
    theta = torch.ones(shape.numel(), requires_grad=True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    with torch.inference_mode(False), torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad()
            loss = -sum(_correlation(d @ theta, p.drops) for d, p in zip(designs, prompts)) / len(prompts)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                theta.clamp_(min=0)
    learned = theta.detach().reshape(shape)
    return learned / learned.mean().clamp(min=1e-12)


def learn_head_weights(engine: SparseEngine, prompts: Sequence[tuple[str, list[int]]], *, feature: str = "output",
                       ablations: int = 32, max_new_tokens: int = 16, seed: int = 0, steps: int = STEPS,
                       on_prompt: Callable[[TrainingPrompt], None] | None = None) -> HeadWeights:
    """Measure every prompt (each reported to ``on_prompt``), fit θ, and return the weights with their provenance."""
    measured = []
    for title, prompt in prompts:
        row = training_prompt(engine, title, prompt, feature=feature, ablations=ablations,
                              max_new_tokens=max_new_tokens, seed=seed)
        measured.append(row)
        if on_prompt is not None:
            on_prompt(row)
    weights = fit_weights(measured, steps)
    uniform = torch.ones_like(weights)
    provenance = {"method": "AT2-style: non-negative per-head weights maximizing the correlation of predicted and "
                            "measured drops of log p(answer)",
                  "targets": f"leave-one-out and {ablations} random deletions of 1-20% per prompt",
                  "texts": [p.title for p in measured], "max_new_tokens": max_new_tokens, "seed": seed,
                  "steps": steps, "train_correlation": round(mean_correlation(measured, weights), 4),
                  "train_correlation_uniform": round(mean_correlation(measured, uniform), 4)}
    return HeadWeights(weights, feature, engine.model_name, engine.model_info.fingerprint(), provenance)
