"""``build_result``: a finished run's :class:`RunResult`, from its run context and the model that ran it.

What the engine recorded (the run context's event logs, importance sums, drafts, probes and pruning,
:mod:`.context`) becomes the result's arrays, ranked important tokens, sizes, timings and provenance.
Shared by ``SparseEngine.generate`` and the batched engine. Shapes: ``layers`` decoder layers,
``positions`` tokens seen.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

import numpy as np
import torch

from sparseety.engine.cache import SparseCache
from sparseety.engine.context import RunContext
from sparseety.engine.importance import important_tokens
from sparseety.engine.inputs import EncodedInput
from sparseety.engine.provenance import provenance
from sparseety.engine.result import RunResult
from sparseety.extract.scoring import find_sinks
from sparseety.policies.base import Policy


class TracedModel(Protocol):
    """What a result is built from besides the run context: the model that ran, its tokenizer and geometry
    (:class:`~sparseety.engine.generate.SparseEngine`; declared here so this module does not import it)."""

    model: torch.nn.Module
    tokenizer: Any
    model_name: str
    num_layers: int
    kv_heads: int
    head_dim: int

    def decode(self, token_id: int) -> str: ...


def build_result(engine: TracedModel, ctx: RunContext, encoded: EncodedInput, sequences: torch.Tensor, policy: Policy,
                 tier: int, top_k: int, request_id: str | None, min_score: float = 0.0) -> RunResult:
    """The :class:`RunResult` of a finished run: tokens, text, the recorded arrays (tier >= 1), the important
    tokens and probes (tier >= 2), the per-step importance (tier 3), sizes, timings and provenance."""
    prompt_ids = encoded.input_ids[0].tolist()
    output_ids = sequences[0, encoded.input_len:].tolist()
    token_ids = np.asarray(prompt_ids + output_ids, dtype=np.int64)
    cache = ctx.cache
    seen = cache.layers[0].seen
    element = next(engine.model.parameters()).element_size()
    arrays: dict[str, np.ndarray] = {}
    kept: dict[str, dict[str, list[int]]] | None = None
    records = []
    drafted = ctx.tokens.outcomes(prompt_ids + output_ids)
    if tier >= 1 and ctx.tokens.drafts:
        arrays.update(drafted)
    if tier >= 1:
        logs = (("evicted", ctx.evictions), ("attended", ctx.attended), ("skipped", ctx.skips),
                ("window", ctx.window_edges))
        for name, log in logs:
            if len(log):
                arrays.update({f"{name}.{k}": v for k, v in log.to_arrays(token_ids).items()})
        if ctx.prune is not None:
            arrays.update(ctx.prune.to_arrays(token_ids))
        if ctx.thresholded:  # a threshold policy: how much of each layer it kept (``[layers]``)
            arrays["kept_fraction"] = _kept_fraction(cache)
    recorded = list(ctx.importance.recorded_layers or ()) if tier >= 2 else None
    if tier >= 2:
        kept = {
            str(layer): {str(h): row.tolist() for h, row in enumerate(heads)}
            for layer, heads in enumerate(cache.kept_positions()) if heads is not None
        }
        sums = ctx.importance
        if sums.total is not None:
            importance = sums.total[:, :seen]
            arrays["importance"] = importance.numpy().astype(np.float16)
            special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
            sinks: list[int] = []
            if sums.attention is not None:  # value/output: sinks marked, left out of the rankings
                sinks = find_sinks(sums.attention[:, :seen], importance)
                arrays["sink.position"] = np.asarray(sinks, dtype=np.int64)
            records = important_tokens(token_ids[:seen], importance, len(prompt_ids), top_k, engine.decode, special,
                                       layers=recorded, min_score=min_score, sinks=sinks)
        arrays.update(_probe_arrays(ctx))
    if tier >= 3 and ctx.importance.step_vectors:
        arrays["step_importance"] = _step_importance(ctx.importance.step_vectors, engine.num_layers)
    return RunResult(
        request_id=request_id or uuid.uuid4().hex,
        model=engine.model_name,
        text=engine.tokenizer.decode(output_ids, skip_special_tokens=True),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        policy=policy.name,
        params=policy.params(),
        budget=policy.budget,
        tier=tier,
        evicted_positions=ctx.evictions.distinct_positions() if tier >= 1 else None,
        eviction_events=len(ctx.evictions) if tier >= 1 else None,
        skipped_events=ctx.skipped_count if tier >= 1 else None,
        kept_positions_final=kept,
        kv_cache_bytes_peak=ctx.peak_bytes,
        kv_cache_bytes_dense=2 * seen * engine.num_layers * engine.kv_heads * engine.head_dim * element,
        draft_tokens=ctx.tokens.draft_tokens,
        draft_rejected=int(drafted["drafted.rejected"].sum()),
        prefill_s=ctx.timings.prefill_s,
        decode_s=ctx.timings.decode_s,
        important_tokens=records,
        token_texts=engine.tokenizer.batch_decode([[int(i)] for i in token_ids]) if tier >= 2 else [],
        provenance=_provenance(engine, ctx, policy, tier, top_k, recorded),
        arrays=arrays,
        pruned_tokens=(ctx.prune.pruned_positions() if ctx.prune is not None else 0) if tier >= 1 else None,
        prune=ctx.prune.schedule.params() if ctx.prune is not None else None,
        layer_selection=ctx.settings.layers.text(),
        extraction_layers=recorded,
    )


def _provenance(engine: TracedModel, ctx: RunContext, policy: Policy, tier: int, top_k: int,
                recorded: list[int] | None) -> dict[str, Any]:
    """The trace's provenance; a ``value``/``output`` run names its importance mode in ``extraction``."""
    settings = ctx.settings
    made = provenance(engine.model, engine.model_name, policy, tier, top_k, layers=settings.layers.text(),
                      recorded_layers=recorded, prune=ctx.prune.schedule.params() if ctx.prune is not None else None)
    mode = settings.importance_mode
    if settings.head_weights is not None:
        made["extraction"] = {**made["extraction"], "importance": "learned", "importance_feature": mode,
                              "signal": f"learned head weights x {mode}-weighted attention received while generating"}
    elif mode != "attention":
        made["extraction"] = {**made["extraction"], "importance": mode,
                              "signal": f"{mode}-weighted attention received while generating"}
    return made


def _kept_fraction(cache: SparseCache) -> np.ndarray:
    """``[layers]`` float32: slots held per KV head over tokens seen, now."""
    return np.asarray([layer.num_slots() / max(1, layer.seen) for layer in cache.layers], dtype=np.float32)


def _probe_arrays(ctx: RunContext) -> dict[str, np.ndarray]:
    """The probes' arrays (float16): ``router.{layer}`` (each MoE layer's router probabilities per position) and
    ``activation.{maxabs,zero_frac}`` (``[layers, positions]``), realigned to every position after pruning."""
    probes, arrays = ctx.probes, {}
    if probes is None:
        return arrays
    realign = ctx.prune.expand if ctx.prune is not None else (lambda _layer, values: values)
    for layer, probs in probes.routers().items():
        arrays[f"router.{layer}"] = realign(layer, probs).astype(np.float16)
    maxabs, zero_frac = probes.activations()
    if maxabs:
        arrays["activation.maxabs"] = np.stack([realign(k, v) for k, v in maxabs.items()]).astype(np.float16)
        arrays["activation.zero_frac"] = np.stack([realign(k, v) for k, v in zero_frac.items()]).astype(np.float16)
    return arrays


def _step_importance(vectors: list[torch.Tensor], num_layers: int) -> np.ndarray:
    """Tier 3: the per-step ``[layers, seen]`` vectors as one ``[steps, layers, width]`` float16 array, NaN past
    each step's ``seen``."""
    width = max(v.shape[1] for v in vectors)
    stacked = np.full((len(vectors), num_layers, width), np.nan, dtype=np.float16)
    for i, v in enumerate(vectors):
        stacked[i, :, : v.shape[1]] = v.numpy()
    return stacked
