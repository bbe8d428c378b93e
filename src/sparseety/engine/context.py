"""The per-run context: which rows the hook point must compute, and what happens after each layer's attention.

State lives here, never on modules. The context is made active for the duration of one generation
(a ``ContextVar``), so the registered attention function finds it without any global patching.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from sparseety.engine.cache import SparseCache, SparseLayer
from sparseety.engine.carry import PrefillCarry
from sparseety.engine.events import ATTENDED, EVICTED, SKIPPED, WINDOW, EventLog
from sparseety.engine.layers import LayerSelection, topk_mass
from sparseety.engine.probe import ModuleProbes
from sparseety.engine.prune import PruneRun
from sparseety.engine.signals import LayerPlan, LayerSignals, group_mean
from sparseety.engine.window import window_edge
from sparseety.extract.scoring import FEATURES, ImportanceMode, score_row, slot_norms, weight_heads
from sparseety.policies.base import (
    Observation,
    Policy,
    ReconstructionChunk,
    Signal,
    protect,
    select_evict,
    select_keep,
)
from sparseety.policies.parts.rotary import inverse_frequencies

_ACTIVE: ContextVar[RunContext | None] = ContextVar("sparseety_run", default=None)


def active_context() -> RunContext | None:
    """The run context of the generation in progress on this thread, if any."""
    return _ACTIVE.get()


T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: ContextVar[T | None], value: T) -> Iterator[T]:
    """Set ``var`` to ``value`` inside the ``with`` block (this thread only), then restore it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def activate(ctx: RunContext) -> contextlib.AbstractContextManager[RunContext]:
    """Make ``ctx`` the active run context inside the ``with`` block."""
    return scoped(_ACTIVE, ctx)


@dataclass
class RunContext:
    """Everything one traced generation needs and records.

    Parameters
    ----------
    policy : the KV policy.
    cache : the run's :class:`SparseCache`.
    num_layers, kv_heads : model geometry.
    tier : 0 nothing, 1 counts and timings, 2 tokens/events/importance, 3 per-step vectors.
    input_len : tokens fed before generation starts (prompt, or context plus question).
    compress_once : evict only at the end of the context (the long-document protocol: the context is
        compressed, the question and answer never are).
    compress_len : with ``compress_once``, the context length (the prompt's first ``compress_len`` tokens).

    A prefill may come in chunks (continuous batching): the policy then scores once, at the end of
    the chunk that completes the prompt (or the context), from signals carried over the earlier
    chunks (column sums added up, the observation window's rows kept), exactly as one prefill
    forward would; earlier chunks evict nothing and record no importance.
    seed : run seed for seeded policies.
    prune : token pruning of the prompt forward, or None.
    layers : which layers record importance (tier >= 2): all, a list, or ``auto`` (the layer with
        the highest top-``auto_k`` mass of the last prompt row, chosen after the first forward).
    """

    policy: Policy
    cache: SparseCache
    num_layers: int
    kv_heads: int
    tier: int
    input_len: int
    compress_once: bool = False
    compress_len: int | None = None
    seed: int = 0
    on_prefill_layer: Callable[[int, int], None] | None = None
    probes: ModuleProbes | None = None  #: router and activation collector (tier >= 2)
    prune: PruneRun | None = None
    layers: LayerSelection = field(default_factory=LayerSelection)
    auto_k: int = 16
    attention_topk: int | None = None  #: decode attends to this many highest-scoring held slots, any policy

    recorded_layers: tuple[int, ...] | None = None  #: layers recording importance (None: not chosen yet)
    layer_mass: dict[int, float] = field(default_factory=dict)  #: ``auto``: top-k mass of the last prompt row per layer

    forward_index: int = -1
    step: int = 0
    q_len: int = 0
    drafts_in_forward: int = 0
    prompt_forward: bool = True
    partial_prefill: bool = False  #: a prefill chunk that does not complete the prompt (or the context)
    choosing_layer: bool = False  #: the forward whose last row chooses the ``auto`` layer
    evicting: bool = False
    carrying: bool = False  #: an earlier prefill chunk: the policy's signals are kept for the completing chunk
    prefill_rows: tuple[int, int] = (0, 0)  #: (first row of this forward, rows of the region it belongs to)
    evictions: EventLog = field(default_factory=lambda: EventLog(EVICTED))
    attended: EventLog = field(default_factory=lambda: EventLog(ATTENDED))  #: top-k sets (tier 2)
    skips: EventLog = field(default_factory=lambda: EventLog(SKIPPED))  #: their complements (tier 3)
    window_edges: EventLog = field(default_factory=lambda: EventLog(WINDOW, all_heads=True))  #: sliding layers (tier 2)
    emits: bool = False  #: this forward's newest row produces an output token
    skipped_count: int = 0
    draft_tokens: int = 0
    peak_bytes: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_forwards: int = 0
    importance: torch.Tensor | None = None  #: ``[layers, positions]`` attention received while generating
    step_vectors: list[torch.Tensor] = field(default_factory=list)  #: tier 3: ``[layers, seen]`` float16 each
    drafts: list[tuple[int, int, int, int]] = field(default_factory=list)  #: per drafted token: (forward, step, position, token_id)
    _t0: float = 0.0
    carry: PrefillCarry = field(default_factory=PrefillCarry)  #: signals of earlier prefill chunks (:mod:`.carry`)
    _rotary: dict[int, torch.Tensor | None] = field(default_factory=dict)  #: per layer, RoPE inverse frequencies
    _plan: LayerPlan | None = None
    _recording_plan: LayerPlan | None = None
    reconstruct_after: bool = False  #: this forward completes a region a reconstructing policy (kvzip) scores after it
    reconstruction_pending: bool = False  #: the region is prefilled; the engine must run :meth:`reconstruct` next
    reconstruction: ReconstructionChunk | None = None  #: the reconstruction forward in progress, if any
    reconstruction_region: int = 0  #: positions ``0 .. region - 1`` the reconstruction scores
    _reconstruction_scores: dict[int, torch.Tensor] = field(default_factory=dict)  #: per layer ``[b, kv_heads, region]``
    _shared_scores: dict[int, torch.Tensor] = field(default_factory=dict)  #: per layer ``[b, kv_heads, n]``, awaiting :meth:`_share_out`
    allocated_budgets: dict[int, int] = field(default_factory=dict)  #: per layer, budgets a reconstruction allocated
    _token_ids: torch.Tensor | None = None  #: ``[b, seen]`` ids fed so far, kept only for policies that need them
    failure: BaseException | None = None  #: this sequence failed inside a packed forward; it leaves the batch alone
    importance_mode: ImportanceMode = "attention"  #: what importance records (:mod:`sparseety.extract.scoring`)
    out_grams: list[torch.Tensor] | None = None  #: ``output`` mode: per layer ``[kv_heads, g, d, d]`` W_O Gram matrices
    attention_importance: torch.Tensor | None = None  #: ``value``/``output``: ``[layers, positions]`` plain attention too
    head_weights: torch.Tensor | None = None  #: ``learned``: ``[layers, heads]`` weights of each head's score
    _hidden: dict[int, torch.Tensor] = field(default_factory=dict)  #: per layer, this forward's ``[b, q, D]`` hidden states
    thresholded: bool = False  #: the policy chose its kept counts by threshold (:meth:`Policy.keep_count`)

    def __post_init__(self) -> None:
        self.recorded_layers = self.layers.fixed(self.num_layers) if self.tier >= 2 else ()
        if self.importance_mode not in FEATURES:
            raise ValueError(f"importance_mode must be one of {', '.join(FEATURES)}, got {self.importance_mode!r}")
        if self.importance_mode != "attention" and self.tier >= 2:  # norms are written with each value
            if self.importance_mode == "output" and (self.out_grams is None or len(self.out_grams) != self.num_layers):
                raise ValueError("importance 'output' needs the output projection's Gram matrices of every layer")
            for layer, cache_layer in enumerate(self.cache.layers):
                grams = None if self.out_grams is None else self.out_grams[layer]
                cache_layer.norm_fn = functools.partial(slot_norms, mode=self.importance_mode, grams=grams)

    # -- forward lifecycle (called by model hooks) -------------------------------------------------
    def begin_forward(self, q_len: int, input_ids: torch.Tensor | None = None) -> None:
        """Called before every model forward with the number of new tokens (and their ids ``[b, q]``)."""
        if self.reconstruction is not None:  # kvzip's pass: no step, no token, nothing recorded
            self._plan = self._recording_plan = LayerPlan(last_row=False, window_rows=0, colsum_stride=0, topk=None)
            self._t0 = time.perf_counter()
            return
        self.forward_index += 1
        seen = self.cache.layers[0].seen
        self.q_len = q_len
        self._plan = self._recording_plan = None
        self.prompt_forward = seen < self.input_len
        self.step = max(0, seen + 1 - self.input_len)
        context_end = self.compress_len if self.compress_once and self.compress_len is not None else self.input_len
        region_end = context_end if seen < context_end else self.input_len  # the context, else the prompt
        self.partial_prefill = self.prompt_forward and seen + q_len < region_end
        self.emits = seen + q_len >= self.input_len
        self.choosing_layer = seen < context_end <= seen + q_len
        self.prefill_rows = (seen, region_end)
        scoring = not self.compress_once or seen < context_end  # the long-document protocol compresses the context only
        self.evicting = self.policy.evicts and scoring and not self.partial_prefill
        self.carrying = self.policy.evicts and scoring and self.partial_prefill
        # A reconstructing policy scores the completed region in passes of its own, after this forward (none
        # when the long-document protocol's context fits every budget: nothing is ever evicted then).
        self.reconstruct_after = False
        if self.policy.reconstructs and self.evicting and self.prompt_forward:
            self.evicting, self.reconstruction_region = False, region_end
            self.reconstruct_after = not self.compress_once or any(
                (b := self.policy.layer_budget(layer, self.num_layers, region_end)) is not None and b < region_end
                for layer in range(self.num_layers))
        # Tokens fed beyond the one(s) this forward must process are speculative drafts.
        self.drafts_in_forward = max(0, q_len - max(1, self.input_len - seen))
        self.draft_tokens += self.drafts_in_forward
        if self.prune is not None:
            self.prune.begin(q_len, seen, prunable=self.prompt_forward and self.forward_index == 0,
                             drafts=self.drafts_in_forward)
        if self.drafts_in_forward and self.tier >= 1:
            first = seen + q_len - self.drafts_in_forward
            ids = input_ids[0, -self.drafts_in_forward:].tolist() if input_ids is not None else [-1] * self.drafts_in_forward
            self.drafts.extend((self.forward_index, self.step, first + i, token) for i, token in enumerate(ids))
        if self.policy.needs_token_ids:
            self._feed_ids(seen, q_len, input_ids)
        if self.tier >= 3 and not self.partial_prefill:
            self.step_vectors.append(torch.zeros(self.num_layers, seen + q_len, dtype=torch.float16))
        self._t0 = time.perf_counter()

    def _feed_ids(self, seen: int, q_len: int, input_ids: torch.Tensor | None) -> None:
        """Write this forward's token ids at positions ``seen .. seen + q_len`` (-1 when not given, e.g. embeddings)."""
        ids = torch.full((1, q_len), -1, dtype=torch.long) if input_ids is None else input_ids[:, -q_len:].long().cpu()
        held = self._token_ids
        if held is None or held.shape[0] != ids.shape[0]:
            held = torch.full((ids.shape[0], 0), -1, dtype=torch.long)
        if held.shape[1] < seen + q_len:
            grown = torch.full((ids.shape[0], seen + q_len), -1, dtype=torch.long)
            grown[:, : min(seen, held.shape[1])] = held[:, :seen]
            held = grown
        held[:, seen: seen + q_len] = ids
        self._token_ids = held

    def slot_token_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[b, kv_heads, n]`` token id of every slot (positions ``[b, kv_heads, n]``), -1 where unknown."""
        held = self._token_ids
        if held is None:
            return torch.full_like(positions, -1)
        where = positions.cpu().long()
        b = where.shape[0]
        rows = held if held.shape[0] == b else held[:1].expand(b, -1)
        ids = rows.gather(1, where.reshape(b, -1).clamp(0, max(0, held.shape[1] - 1))).reshape(where.shape)
        return torch.where(where < held.shape[1], ids, -1).to(positions.device)

    @property
    def wants_hidden(self) -> bool:
        """True when this forward must hand the policy each layer's attention-input hidden states."""
        return self.policy.needs_hidden and (self.evicting or self.carrying) and self.reconstruction is None

    def take_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Keep layer ``layer``'s attention-input hidden states ``[b, q, D]`` of this forward for the policy."""
        self._hidden[layer] = hidden

    def kept_fraction(self) -> np.ndarray:
        """``[layers]`` float32: slots held per KV head over tokens seen, now."""
        return np.asarray([layer.num_slots() / max(1, layer.seen) for layer in self.cache.layers], dtype=np.float32)

    def draft_outcomes(self, sequence: list[int]) -> dict[str, np.ndarray]:
        """Per drafted token: ``drafted.{step,position,token_id,rejected}`` given the final ``sequence``.

        Generation is greedy, so a draft is accepted exactly when it and every earlier draft of its
        forward equal the tokens the sequence holds at their positions.
        """
        rows, forward, agreeing = [], None, True
        for index, step, position, token in self.drafts:
            if index != forward:
                forward, agreeing = index, True
            agreeing = agreeing and position < len(sequence) and sequence[position] == token
            rows.append((step, position, token, 0 if agreeing else 1))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        return {f"drafted.{name}": table[:, i] for i, name in enumerate(("step", "position", "token_id", "rejected"))}

    def end_forward(self) -> None:
        """Called after every model forward."""
        elapsed = time.perf_counter() - self._t0
        if self.reconstruction is not None:
            self.prefill_s += elapsed  # kvzip's extra prefill cost
            return
        self.reconstruction_pending = self.reconstruction_pending or self.reconstruct_after
        if self._shared_scores:  # a sharing policy's prefill: every layer is scored, now share and evict
            scored, self._shared_scores = self._shared_scores, {}
            self._share_out(scored, self.step)
        if self.prune is not None:
            self.prune.end()
        if self.recorded_layers is None:
            self._choose_layer()
        if self.prompt_forward:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
            self.decode_forwards += 1
        if not self.partial_prefill and not self.reconstruct_after:  # held after each step (a prefill's transient before compression is not)
            self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())

    def _choose_layer(self) -> None:
        """``auto``: keep the layer with the highest top-k mass (ties: the lower layer); drop the others' records."""
        if not self.layer_mass:
            return
        chosen = max(sorted(self.layer_mass), key=lambda layer: self.layer_mass[layer])
        self.recorded_layers = (chosen,)
        others = [layer for layer in range(self.num_layers) if layer != chosen]
        for total in (self.importance, self.attention_importance):
            if total is not None:
                total[others] = 0
        for vector in self.step_vectors:
            vector[others] = 0

    def records(self, layer: int) -> bool:
        """True when layer ``layer`` records importance this forward (before ``auto`` chooses: every layer)."""
        if self.tier < 2 or self.partial_prefill:
            return False
        return self.recorded_layers is None or layer in self.recorded_layers

    def prune_rows(self, layer: int) -> int:
        """Last query rows layer ``layer`` must score for token pruning (0: it does not prune now)."""
        return self.prune.score_rows(layer) if self.prune is not None else 0

    # -- per layer (called by the hook point) ---------------------------------------------------------
    def plan(self, layer: int, q: int, n: int) -> LayerPlan:
        """Which attention rows layer ``layer`` must compute for ``q`` new queries over ``n`` slots.

        The plan depends on the forward (phase, ``q``) and on whether the layer records importance,
        so it is made at most twice per forward.
        """
        plan = self._forward_plan(q)
        if plan.last_row or not self.records(layer):
            return plan
        if self._recording_plan is None:
            self._recording_plan = dataclasses.replace(plan, last_row=True)
        return self._recording_plan

    def _forward_plan(self, q: int) -> LayerPlan:
        if self._plan is None:
            policy = self.policy
            signal = Signal.NONE
            if self.evicting or self.carrying:
                signal = policy.prefill_signal if self.prompt_forward else policy.decode_signal
            first, region_end = self.prefill_rows
            window_rows = 0
            if signal is Signal.WINDOW:  # this forward's rows among the region's last ``window`` rows
                window_rows = max(0, min(q, first + q - max(first, region_end - policy.window_rows())))
            self._plan = LayerPlan(
                last_row=signal is Signal.LAST_ROW and not self.carrying,
                window_rows=window_rows,
                # a prefill chunk samples the rows of its whole region, a decode step its own rows
                colsum_stride=policy.colsum_stride(region_end if self.prompt_forward else q)
                if signal is Signal.COLSUM else 0,
                topk=None if self.prompt_forward else (policy.budget if policy.attends_topk else self.attention_topk),
                colsum_last=region_end - 1 - first if self.prompt_forward else q - 1,
                query_rows=self._query_rows(q),
            )
        return self._plan

    def layer_budget(self, layer: int) -> int | None:
        """The policy's budget for layer ``layer`` now; a sliding layer's only where it is below the window."""
        cache_layer = self.cache.layers[layer]
        budget = self.allocated_budgets.get(layer)
        if budget is None:
            budget = self.policy.layer_budget(layer, self.num_layers, cache_layer.seen)
        window = cache_layer.window
        return None if budget is None or (window is not None and budget >= window) else budget

    def _query_rows(self, q: int) -> int:
        """This forward's query rows the policy reads: at a prefill, those among the region's last ``query_rows()``."""
        wanted = self.policy.query_rows() if self.evicting or self.carrying else 0
        if wanted <= 0:
            return 0
        if not self.prompt_forward:
            return min(q, wanted)
        first, region_end = self.prefill_rows
        return max(0, min(q, first + q - max(first, region_end - wanted)))

    def rotary(self, layer: int, module: torch.nn.Module) -> torch.Tensor | None:
        """RoPE inverse frequencies of ``module``'s layer (read from its config once per run)."""
        if layer not in self._rotary:
            self._rotary[layer] = inverse_frequencies(module)
        return self._rotary[layer]

    def will_evict(self, layer: int, n: int) -> bool:
        """True when layer ``layer`` holding ``n`` slots evicts after this step's attention."""
        if not self.evicting:
            return False
        budget = self.layer_budget(layer)
        return budget is not None and n > budget

    def observe(self, layer: int, key: torch.Tensor, seen: LayerSignals) -> None:
        """Record what layer ``layer`` attended to, let the policy score and evict; a sliding layer then slides."""
        if self.reconstruction is not None:
            self._observe_reconstruction(layer, seen)
            return
        self._observe(layer, key, seen)
        if self.cache.layers[layer].window is not None:
            self._slide(layer)

    def _slide(self, layer: int) -> None:
        """Record the newest row's window edge (step, layer) and free what no later query can see."""
        cache_layer = self.cache.layers[layer]
        assert cache_layer.window is not None
        edge = window_edge(cache_layer.seen - 1, cache_layer.window)
        if self.emits and edge > 0 and self.tier >= 1:
            self.skipped_count += edge * self.kv_heads
            if self.tier >= 2:
                self.window_edges.add(self.step, layer, torch.tensor([[edge]]), None)
        cache_layer.expire()

    def _observe(self, layer: int, key: torch.Tensor, seen: LayerSignals) -> None:
        if self.prompt_forward and self.on_prefill_layer is not None:
            self.on_prefill_layer(layer, self.num_layers)
        cache_layer = self.cache.layers[layer]
        positions = cache_layer.positions
        assert positions is not None
        hidden = self._hidden.pop(layer, None)
        if self.carrying:  # an earlier prefill chunk: keep its signals for the chunk that completes the prefill
            self.carry.keep(layer, seen, hidden)
            return
        if seen.last_row is not None and self.records(layer):
            attention = group_mean(seen.last_row, self.kv_heads)[0]
            if self.importance_mode == "attention" and self.head_weights is None:
                self._record_importance(layer, positions[0], attention)
            else:
                weights = None if self.head_weights is None else self.head_weights[layer]
                scored = score_row(weight_heads(seen.last_row, weights), cache_layer.norms, self.kv_heads)[0]
                self._record_importance(layer, positions[0], scored, attention)
            if self.recorded_layers is None and self.choosing_layer:
                self.layer_mass[layer] = topk_mass(seen.last_row, self.auto_k)
        if seen.attended is not None and self.tier >= 1:
            self._record_skips(layer, positions, seen.attended, seen.skipped)
        if not self.evicting:
            return
        self.carry.join(layer, seen, hidden)
        scores = self._score(layer, cache_layer, key, seen, self.kv_heads)
        if self.prompt_forward and self.policy.shares_budget and cache_layer.window is None:
            self._shared_scores[layer] = scores  # evicted at the end of this forward (:meth:`_share_out`)
            return
        budget = self.layer_budget(layer)
        keep = self.policy.keep_count(scores)  # a threshold policy's own count, under its cap
        if keep is not None:
            self.thresholded = True
            budget = keep if budget is None else min(budget, keep)
        if budget is not None and positions.shape[-1] > budget:
            self._evict(layer, self._eviction_order(hidden_first(scores, cache_layer), cache_layer), budget, self.step)

    def observe_split(self, layer: int, signal: torch.Tensor | None) -> None:
        """A layer split per KV head: record the newest row's attention (``signal`` ``[1, 1, capacity]``, each
        slot's from its KV group, 0 on free slots), then let the policy score the layer's row and evict each
        head down to its own count."""
        if self.prompt_forward and self.on_prefill_layer is not None:
            self.on_prefill_layer(layer, self.num_layers)
        cache_layer = self.cache.layers[layer]
        regions = cache_layer.regions
        assert regions is not None
        if signal is not None and self.records(layer):
            where, attention = regions.live_values(regions.pos), regions.live_values(signal)
            if (self.importance_mode == "attention" or regions.norm is None) and self.head_weights is None:
                self._record_importance(layer, where, attention)
            else:  # the signal is already each KV group's mean: ``output`` (and ``learned``) use group means here
                scored = attention
                if regions.norm is not None:
                    scored = scored * regions.live_values(regions.norm.mean(dim=-1))
                if self.head_weights is not None:
                    group = self.head_weights[layer].view(self.kv_heads, -1).mean(dim=-1)
                    scored = scored * regions.live_values(group.to(regions.owner.device)[regions.owner])
                self._record_importance(layer, where, scored, attention)
        if not self.evicting:
            return
        seen = LayerSignals(last_row=signal, hidden=self._hidden.pop(layer, None))  # kvzap scores new tokens
        scores = self._score(layer, cache_layer, regions.k, seen, 1)
        excess = regions.excess()
        if excess <= 0:
            return
        scores = self._eviction_order(scores, cache_layer)
        evicted, owners, positions = regions.evict_over_budget(scores[0, 0])
        if self.tier >= 1:
            self.evictions.add(self.step, layer, positions.view(1, -1),
                               scores[0, 0, evicted.to(scores.device)].view(1, -1), heads=owners)

    def _score(self, layer: int, cache_layer: SparseLayer, key: torch.Tensor, seen: LayerSignals,
               kv_heads: int) -> torch.Tensor:
        """The policy's ``[b, kv_heads, n]`` scores of ``cache_layer``'s slots (its state updated), from its own
        signal: the window vote, else column sums, else the newest row."""
        positions = cache_layer.positions
        signal = next((x for x in (seen.window, seen.colsum, seen.last_row) if x is not None), None)
        obs = Observation(
            layer=layer, num_layers=self.num_layers, step=self.step, prefill=self.prompt_forward,
            positions=positions, keys=key,
            attention=None if signal is None else group_mean(signal, kv_heads),
            state=cache_layer.state, seed=self.seed,
            queries=seen.queries, values=seen.values, rotary=seen.rotary,
            token_ids=self.slot_token_ids(positions) if self.policy.needs_token_ids else None,
            hidden=seen.hidden, owners=None if cache_layer.regions is None else cache_layer.regions.owner,
        )
        scores, cache_layer.state = self.policy.score(obs)
        return scores

    def _eviction_order(self, scores: torch.Tensor, cache_layer: SparseLayer) -> torch.Tensor:
        """``scores`` with this forward's unverified drafts above every other protected slot."""
        if not self.drafts_in_forward:
            return scores
        return protect(scores.clamp(max=torch.finfo(scores.dtype).max),
                       cache_layer.positions >= cache_layer.seen - self.drafts_in_forward)

    def _evict(self, layer: int, scores: torch.Tensor, budget: int, step: int) -> None:
        """Keep layer ``layer``'s ``budget`` best slots by ``scores`` ``[b, kv_heads, n]``; record the rest at ``step``."""
        cache_layer = self.cache.layers[layer]
        evicted_slots, evicted_positions = cache_layer.evict(select_evict(scores, budget, cache_layer.positions))
        if self.tier >= 1:
            self.evictions.add(step, layer, evicted_positions[0], scores[0].gather(-1, evicted_slots[0]))

    # -- a reconstructing policy's own pass (kvzip) --------------------------------------------------
    @contextlib.contextmanager
    def reconstructing(self, chunk: ReconstructionChunk) -> Iterator[None]:
        """Inside the block, forwards are the reconstruction ``chunk``: each layer scores the region's slots
        from its queries, then drops the chunk's KV; probes and pruning see nothing of it."""
        if not self._reconstruction_scores:
            for layer, cache_layer in enumerate(self.cache.layers):
                positions = cache_layer.positions
                assert positions is not None
                if cache_layer.window is not None:  # a sliding layer holds only its window: scored by recency
                    continue
                expected = torch.arange(self.reconstruction_region, device=positions.device)
                if positions.shape[-1] != self.reconstruction_region or not bool((positions == expected).all()):
                    raise RuntimeError("reconstruction needs the region's slots, in position order, nothing evicted")
                self._reconstruction_scores[layer] = torch.zeros(positions.shape, dtype=torch.float32,
                                                                 device=positions.device)
        held = self.probes, self.prune
        self.reconstruction, self.probes, self.prune = chunk, None, None
        try:
            yield
        finally:
            self.reconstruction = None
            self.probes, self.prune = held

    def _observe_reconstruction(self, layer: int, seen: LayerSignals) -> None:
        chunk = self.reconstruction
        assert chunk is not None
        if seen.reconstruction is not None:
            self._reconstruction_scores[layer][..., chunk.start : chunk.end] = seen.reconstruction
        self.cache.layers[layer].truncate(len(chunk.ids))

    def finish_reconstruction(self) -> None:
        """Score every layer by its reconstruction attention, let the policy share the budget among the layers
        that compress (:meth:`Policy.allocate`) and evict to it (step 0 events)."""
        scored: dict[int, torch.Tensor] = {}
        for layer, cache_layer in enumerate(self.cache.layers):
            positions = cache_layer.positions
            assert positions is not None
            default = positions.float() if cache_layer.window is not None else torch.zeros(positions.shape)
            scores = self._reconstruction_scores.pop(layer, default.to(positions.device))  # sliding: the newest first
            obs = Observation(layer=layer, num_layers=self.num_layers, step=0, prefill=True, positions=positions,
                              keys=cache_layer.keys, attention=scores, state=None, seed=self.seed)
            scored[layer], cache_layer.state = self.policy.score(obs)
        self._share_out(scored, 0)
        self.reconstruction_pending = False
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())

    def _share_out(self, scored: dict[int, torch.Tensor], step: int) -> None:
        """Let the policy share the budget among the layers of ``scored`` (``[b, kv_heads, n]`` each) that
        compress (:meth:`Policy.allocate`), then evict each layer to its share (events at ``step``)."""
        uniform = {layer: budget for layer in scored if (budget := self.layer_budget(layer)) is not None
                   and self.cache.layers[layer].window is None and scored[layer].shape[-1] > budget}
        allocated = self.policy.allocate({layer: scored[layer] for layer in uniform}, uniform)
        self.allocated_budgets = {layer: share for layer, share in allocated.items() if isinstance(share, int)}
        for layer, scores in scored.items():
            share = allocated.get(layer)
            if isinstance(share, list):
                self._split(layer, scores, share)
                continue
            budget = self.layer_budget(layer)
            if budget is not None and scores.shape[-1] > budget:
                self._evict(layer, hidden_first(scores, self.cache.layers[layer]), budget, step)

    def _split(self, layer: int, scores: torch.Tensor, counts: list[int]) -> None:
        """Store layer ``layer`` per KV head, head ``i`` keeping its ``counts[i]`` best slots by ``scores``
        ``[1, kv_heads, n]`` (and that many from then on); record the rest as step-0 evictions."""
        cache_layer = self.cache.layers[layer]
        positions = cache_layer.positions
        assert positions is not None
        keep = [select_keep(scores[:, i : i + 1], count, positions[:, i : i + 1])[0, 0] for i, count in enumerate(counts)]
        evicted = cache_layer.split(keep, counts)
        if self.tier >= 1:
            for i, (slots, where) in enumerate(evicted):
                self.evictions.add(0, layer, where[0], scores[0, i : i + 1].gather(-1, slots[0]),
                                   heads=torch.full((slots.shape[-1],), i))

    def _record_importance(self, layer: int, positions: torch.Tensor, per_slot: torch.Tensor,
                           attention: torch.Tensor | None = None) -> None:
        """Add the newest row's score to layer ``layer``'s importance: ``per_slot`` (any shape, the KV
        groups' mean) the score each slot at ``positions`` (same shape) got; ``attention`` (same shape, not
        in ``attention`` mode) the plain attention, kept for the sink rule."""
        seen = self.cache.layers[layer].seen
        where = positions.reshape(-1).cpu()
        row = per_slot.float().reshape(-1).cpu() / self.kv_heads
        # added straight into the running totals (one index_add per row; a position held by several KV
        # heads gets each head's share)
        self.importance = self._grown(self.importance, seen)
        self.importance[layer].index_add_(0, where, row)
        if attention is not None:
            self.attention_importance = self._grown(self.attention_importance, seen)
            self.attention_importance[layer].index_add_(0, where, attention.float().reshape(-1).cpu() / self.kv_heads)
        if self.tier >= 3:
            vector = torch.zeros(seen, dtype=torch.float32).index_add_(0, where, row)
            self.step_vectors[-1][layer, :seen] = vector.to(torch.float16)

    def _grown(self, total: torch.Tensor | None, seen: int) -> torch.Tensor:
        """``total`` ``[layers, >= seen]``, reallocated (doubling) when shorter."""
        if total is None or total.shape[1] < seen:
            grown = torch.zeros(self.num_layers, max(seen, 2 * (0 if total is None else total.shape[1])))
            if total is not None:
                grown[:, : total.shape[1]] = total
            total = grown
        return total

    def _record_skips(self, layer: int, positions: torch.Tensor, attended: torch.Tensor, skipped: int) -> None:
        self.skipped_count += skipped
        if self.tier >= 2:
            kept = positions[0][attended[0]].reshape(positions.shape[1], -1)
            self.attended.add(self.step, layer, kept, None)
        if self.tier >= 3:
            left_out = positions[0][~attended[0]].reshape(positions.shape[1], -1)
            self.skips.add(self.step, layer, left_out, None)


def hidden_first(scores: torch.Tensor, cache_layer: SparseLayer) -> torch.Tensor:
    """``scores`` ``[b, kv_heads, slots]`` with what a sliding layer's window hides at ``-inf``: evicted first."""
    hidden = cache_layer.hidden_slots()
    return scores if hidden is None else scores.masked_fill(hidden, float("-inf"))
