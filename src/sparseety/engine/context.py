"""The per-run context: which rows the hook point must compute, and what happens after each layer's attention.

State lives here, never on modules. The context is made active for the duration of one generation
(a ``ContextVar``), so the registered attention function finds it without any global patching.
:class:`RunContext` composes small parts with one job each: what the run was asked
(:mod:`.settings`), the forward in progress (:mod:`.forward`), what a chunked prefill carries
(:mod:`.carry`), a reconstructing policy's pass (:mod:`.reconstruction_state`), the importance
sums (:mod:`.importance_sums`), the token ids and drafts (:mod:`.tokens`) and the timings
(:mod:`.timings`); it scores and evicts through the policy after each layer's attention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from sparseety.engine.cache import SparseCache, SparseLayer
from sparseety.engine.carry import PrefillCarry
from sparseety.engine.events import ATTENDED, EVICTED, SKIPPED, WINDOW, EventLog
from sparseety.engine.forward import ForwardState
from sparseety.engine.importance_sums import ImportanceSums
from sparseety.engine.probe import ModuleProbes
from sparseety.engine.prune import PruneRun
from sparseety.engine.reconstruction_state import ReconstructionState
from sparseety.engine.settings import RunSettings
from sparseety.engine.signals import LayerPlan, LayerSignals, group_mean
from sparseety.engine.stacked import StackedSlots
from sparseety.engine.timings import Timings
from sparseety.engine.tokens import TokenRecord
from sparseety.engine.window import window_edge
from sparseety.extract.scoring import slot_norms
from sparseety.policies.base import Observation, Policy, protect, select_evict, select_keep
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
    """Everything one traced generation needs and records, in parts with one job each.

    Parameters
    ----------
    settings : what the run was asked (:class:`~sparseety.engine.settings.RunSettings`: the options whole,
        the policy, the model's geometry, the input's lengths).
    cache : the run's :class:`SparseCache`.
    probes : router and activation collector (tier >= 2), or None.
    prune : token pruning of the prompt forward, or None.

    The parts it composes: :attr:`forward` the forward in progress (:mod:`.forward`), :attr:`carry` what
    a chunked prefill carries between chunks (:mod:`.carry`), :attr:`reconstruction` a reconstructing
    policy's pass (:mod:`.reconstruction_state`), :attr:`importance` the importance sums
    (:mod:`.importance_sums`), :attr:`tokens` the ids fed and the drafts (:mod:`.tokens`), :attr:`timings`
    (:mod:`.timings`). It holds itself the event logs, the counts and the budgets a policy allocated.

    A prefill may come in chunks (continuous batching): the policy then scores once, at the end of
    the chunk that completes the prompt (or the context), from signals carried over the earlier
    chunks, exactly as one prefill forward would; earlier chunks evict nothing and record no importance.
    """

    settings: RunSettings
    cache: SparseCache
    probes: ModuleProbes | None = None
    prune: PruneRun | None = None
    forward: ForwardState = field(default_factory=ForwardState)
    carry: PrefillCarry = field(default_factory=PrefillCarry)
    reconstruction: ReconstructionState = field(default_factory=ReconstructionState)
    importance: ImportanceSums = field(init=False)
    tokens: TokenRecord = field(default_factory=TokenRecord)
    timings: Timings = field(default_factory=Timings)
    evictions: EventLog = field(default_factory=lambda: EventLog(EVICTED))
    attended: EventLog = field(default_factory=lambda: EventLog(ATTENDED))  #: top-k sets (tier 2)
    skips: EventLog = field(default_factory=lambda: EventLog(SKIPPED))  #: their complements (tier 3)
    window_edges: EventLog = field(default_factory=lambda: EventLog(WINDOW, all_heads=True))  #: sliding layers (tier 2)
    skipped_count: int = 0  #: (row, kv_head, slot) triples left out: top-k attention and sliding windows (tier >= 1)
    peak_bytes: int = 0  #: the most KV bytes held after a step
    thresholded: bool = False  #: the policy chose its kept counts by threshold (:meth:`Policy.keep_count`)
    allocated_budgets: dict[int, int] = field(default_factory=dict)  #: per layer, budgets the policy allocated
    failure: BaseException | None = None  #: this sequence failed inside a packed forward; it leaves the batch alone
    _rotary: dict[int, torch.Tensor | None] = field(default_factory=dict)  #: per layer, RoPE inverse frequencies
    stack: StackedSlots | None = None  #: the layers' slots stacked for one-slot decode evictions (:mod:`.stacked`)

    def __post_init__(self) -> None:
        s = self.settings
        self.importance = ImportanceSums(s.num_layers, s.kv_heads, s.tier, s.layers, s.auto_k, s.importance_mode,
                                         s.head_weights)
        if s.importance_mode != "attention" and s.tier >= 2:  # norms are written with each value
            for layer, cache_layer in enumerate(self.cache.layers):
                grams = None if s.out_grams is None else s.out_grams[layer]
                cache_layer.norm_fn = functools.partial(slot_norms, mode=s.importance_mode, grams=grams)

    # -- forward lifecycle (called by model hooks) -------------------------------------------------
    def begin_forward(self, q_len: int, input_ids: torch.Tensor | None = None) -> None:
        """Called before every model forward with the number of new tokens (and their ids ``[b, q]``)."""
        now = self.forward
        if self.reconstruction.chunk is not None:  # kvzip's pass: no step, no token, nothing recorded
            now.plan, now.recording_plan, now.stacked = _RECONSTRUCTION_PLAN, _RECONSTRUCTION_PLAN, False
            self.timings.start()
            return
        settings, seen = self.settings, self.cache.layers[0].seen
        region = now.begin(settings, seen, q_len)
        if region is not None:
            self.reconstruction.region = region
        drafts = now.drafts
        self.tokens.draft_tokens += drafts
        if self.prune is not None:
            self.prune.begin(q_len, seen, prunable=now.prompt and now.index == 0, drafts=drafts)
        if drafts and settings.tier >= 1:
            self.tokens.add_drafts(now.index, now.step, seen + q_len - drafts, drafts, input_ids)
        if settings.policy.needs_token_ids:
            self.tokens.feed(seen, q_len, input_ids)
        if settings.tier >= 3 and not now.partial_prefill:
            self.importance.new_step(seen + q_len)
        now.stacked = stacked_step(self, q_len)
        self.timings.start()

    @property
    def wants_hidden(self) -> bool:
        """True when this forward must hand the policy each layer's attention-input hidden states."""
        now = self.forward
        return self.settings.policy.needs_hidden and (now.evicting or now.carrying) and self.reconstruction.chunk is None

    def take_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Keep layer ``layer``'s attention-input hidden states ``[b, q, D]`` of this forward for the policy."""
        self.forward.hidden[layer] = hidden

    def end_forward(self) -> None:
        """Called after every model forward."""
        if self.forward.stacked and self.stack is not None:  # every layer's one-slot eviction of this step
            self.stack.evict(self.settings.policy, self.forward.step, self.settings.seed, self.cache.layers[0].seen)
        elapsed = self.timings.elapsed()
        if self.reconstruction.chunk is not None:
            self.timings.add(elapsed, prefill=True)  # kvzip's extra prefill cost
            return
        now = self.forward
        self.reconstruction.pending = self.reconstruction.pending or now.reconstruct_after
        if now.shared_scores:  # a sharing policy's prefill: every layer is scored, now share and evict
            scored, now.shared_scores = now.shared_scores, {}
            self.share_out(scored, now.step)
        if self.prune is not None:
            self.prune.end()
        if self.importance.recorded_layers is None:
            self.importance.choose_layer()
        self.timings.add(elapsed, prefill=now.prompt)
        if not now.partial_prefill and not now.reconstruct_after:  # held after each step (a prefill's transient before compression is not)
            self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())

    def prune_rows(self, layer: int) -> int:
        """Last query rows layer ``layer`` must score for token pruning (0: it does not prune now)."""
        return self.prune.score_rows(layer) if self.prune is not None else 0

    # -- per layer (called by the hook point) ---------------------------------------------------------
    def plan(self, layer: int, q: int, n: int) -> LayerPlan:
        """Which attention rows layer ``layer`` must compute for ``q`` new queries over ``n`` slots.

        The plan depends on the forward (phase, ``q``) and on whether the layer records importance,
        so it is made at most twice per forward.
        """
        now = self.forward
        plan = now.plan
        if plan is None:
            plan = now.forward_plan(self.settings.policy, q, self.settings.attention_topk)
        if plan.last_row or not self.importance.records(layer, now.partial_prefill):
            return plan
        if now.recording_plan is None:
            now.recording_plan = dataclasses.replace(plan, last_row=True)
        return now.recording_plan

    def layer_budget(self, layer: int) -> int | None:
        """The policy's budget for layer ``layer`` now; a sliding layer's only where it is below the window."""
        cache_layer = self.cache.layers[layer]
        budget = self.allocated_budgets.get(layer)
        if budget is None:
            budget = self.settings.policy.layer_budget(layer, self.settings.num_layers, cache_layer.seen)
        window = cache_layer.window
        return None if budget is None or (window is not None and budget >= window) else budget

    def rotary(self, layer: int, module: torch.nn.Module) -> torch.Tensor | None:
        """RoPE inverse frequencies of ``module``'s layer (read from its config once per run)."""
        if layer not in self._rotary:
            self._rotary[layer] = inverse_frequencies(module)
        return self._rotary[layer]

    def will_evict(self, layer: int, n: int) -> bool:
        """True when layer ``layer`` holding ``n`` slots evicts after this step's attention."""
        if not self.forward.evicting or self.forward.stacked:  # a stacked step: every layer holds budget + 1
            return self.forward.evicting
        budget = self.layer_budget(layer)
        return budget is not None and n > budget

    def observe(self, layer: int, key: torch.Tensor, seen: LayerSignals) -> None:
        """Record what layer ``layer`` attended to, let the policy score and evict; a sliding layer then slides."""
        if self.reconstruction.chunk is not None:
            self.reconstruction.take(layer, seen.reconstruction)
            self.cache.layers[layer].truncate(len(self.reconstruction.chunk.ids))
            return
        if self.forward.stacked and self.stack is not None:  # evicted with every layer at the forward's end
            self.stack.take(layer, seen.last_row)
            return
        self._observe(layer, key, seen)
        if self.cache.layers[layer].window is not None:
            slide(self, layer)

    def _observe(self, layer: int, key: torch.Tensor, seen: LayerSignals) -> None:
        now, settings = self.forward, self.settings
        if now.prompt and settings.on_prefill_layer is not None:
            settings.on_prefill_layer(layer, settings.num_layers)
        cache_layer = self.cache.layers[layer]
        positions = cache_layer.positions
        assert positions is not None
        hidden = now.hidden.pop(layer, None)
        if now.carrying:  # an earlier prefill chunk: keep its signals for the chunk that completes the prefill
            self.carry.keep(layer, seen, hidden)
            return
        if seen.last_row is not None and self.importance.records(layer, now.partial_prefill):
            self.importance.add_row(layer, cache_layer, seen.last_row, now.choosing_layer)
        if seen.attended is not None and settings.tier >= 1:
            self._record_skips(layer, positions, seen.attended, seen.skipped)
        if not now.evicting:
            return
        self.carry.join(layer, seen, hidden)
        budget = self.layer_budget(layer)
        if budget is not None and not (now.prompt or now.drafts or settings.tier) \
                and evict_unscored(settings.policy, cache_layer, positions, budget):
            return
        scores = self._score(layer, cache_layer, key, seen, settings.kv_heads)
        if now.prompt and settings.policy.shares_budget and cache_layer.window is None:
            now.shared_scores[layer] = scores  # evicted at the end of this forward (:meth:`share_out`)
            return
        keep = settings.policy.keep_count(scores)  # a threshold policy's own count, under its cap
        if keep is not None:
            self.thresholded = True
            budget = keep if budget is None else min(budget, keep)
        if budget is not None and positions.shape[-1] > budget:
            self._evict(layer, eviction_order(hidden_first(scores, cache_layer), cache_layer, now.drafts), budget, now.step)

    def observe_split(self, layer: int, signal: torch.Tensor | None) -> None:
        """A layer split per KV head: record the newest row's attention (``signal`` ``[1, 1, capacity]``, each
        slot's from its KV group, 0 on free slots), then let the policy score the layer's row and evict each
        head down to its own count."""
        now, settings = self.forward, self.settings
        if now.prompt and settings.on_prefill_layer is not None:
            settings.on_prefill_layer(layer, settings.num_layers)
        cache_layer = self.cache.layers[layer]
        regions = cache_layer.regions
        assert regions is not None
        if signal is not None and self.importance.records(layer, now.partial_prefill):
            self.importance.add_split(layer, cache_layer, signal)
        if not now.evicting:
            return
        seen = LayerSignals(last_row=signal, hidden=now.hidden.pop(layer, None))  # kvzap scores new tokens
        scores = self._score(layer, cache_layer, regions.k, seen, 1)
        excess = regions.excess()
        if excess <= 0:
            return
        scores = eviction_order(scores, cache_layer, now.drafts)
        evicted, owners, positions = regions.evict_over_budget(scores[0, 0])
        if settings.tier >= 1:
            self.evictions.add(now.step, layer, positions.view(1, -1),
                               scores[0, 0, evicted.to(scores.device)].view(1, -1), heads=owners)

    def _score(self, layer: int, cache_layer: SparseLayer, key: torch.Tensor, seen: LayerSignals,
               kv_heads: int) -> torch.Tensor:
        """The policy's ``[b, kv_heads, n]`` scores of ``cache_layer``'s slots (its state updated), from its own
        signal: the window vote, else column sums, else the newest row."""
        settings, positions = self.settings, cache_layer.positions
        signal = seen.window if seen.window is not None else seen.colsum if seen.colsum is not None else seen.last_row
        obs = Observation(
            layer=layer, num_layers=settings.num_layers, step=self.forward.step, prefill=self.forward.prompt,
            positions=positions, keys=key,
            attention=None if signal is None else group_mean(signal, kv_heads),
            state=cache_layer.state, seed=settings.seed,
            queries=seen.queries, values=seen.values, rotary=seen.rotary,
            token_ids=self.tokens.slot_ids(positions) if settings.policy.needs_token_ids else None,
            hidden=seen.hidden, owners=None if cache_layer.regions is None else cache_layer.regions.owner,
            newest=cache_layer.seen - 1,
        )
        scores, cache_layer.state = settings.policy.score(obs)
        return scores

    def _evict(self, layer: int, scores: torch.Tensor, budget: int, step: int) -> None:
        """Keep layer ``layer``'s ``budget`` best slots by ``scores`` ``[b, kv_heads, n]``; record the rest at ``step``."""
        cache_layer = self.cache.layers[layer]
        slots = select_evict(scores, budget, cache_layer.positions)
        if self.settings.tier < 1 and slots.shape[0] * slots.shape[-1] == 1:  # a decode step recording nothing: no gather
            cache_layer.evict_one(slots)
            return
        evicted_slots, evicted_positions = cache_layer.evict(slots)
        if self.settings.tier >= 1:
            self.evictions.add(step, layer, evicted_positions[0], scores[0].gather(-1, evicted_slots[0]))

    # -- sharing a budget among layers (a prefill, or the end of a reconstruction) -----------------
    def share_out(self, scored: dict[int, torch.Tensor], step: int) -> None:
        """Let the policy share the budget among the layers of ``scored`` (``[b, kv_heads, n]`` each) that
        compress (:meth:`Policy.allocate`), then evict each layer to its share (events at ``step``)."""
        uniform = {layer: budget for layer in scored if (budget := self.layer_budget(layer)) is not None
                   and self.cache.layers[layer].window is None and scored[layer].shape[-1] > budget}
        allocated = self.settings.policy.allocate({layer: scored[layer] for layer in uniform}, uniform)
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
        if self.settings.tier >= 1:
            for i, (slots, where) in enumerate(evicted):
                self.evictions.add(0, layer, where[0], scores[0, i : i + 1].gather(-1, slots[0]),
                                   heads=torch.full((slots.shape[-1],), i))

    def _record_skips(self, layer: int, positions: torch.Tensor, attended: torch.Tensor, skipped: int) -> None:
        self.skipped_count += skipped
        if self.settings.tier >= 2:
            kept = positions[0][attended[0]].reshape(positions.shape[1], -1)
            self.attended.add(self.forward.step, layer, kept, None)
        if self.settings.tier >= 3:
            left_out = positions[0][~attended[0]].reshape(positions.shape[1], -1)
            self.skips.add(self.forward.step, layer, left_out, None)


#: every layer's plan in a reconstruction forward: the hook point computes the output only
_RECONSTRUCTION_PLAN = LayerPlan(last_row=False, window_rows=0, colsum_stride=0, topk=None)


def slide(ctx: RunContext, layer: int) -> None:
    """A sliding layer ``layer`` of ``ctx``: record the newest row's window edge (step, layer) and free what no
    later query can see."""
    cache_layer = ctx.cache.layers[layer]
    assert cache_layer.window is not None
    edge = window_edge(cache_layer.seen - 1, cache_layer.window)
    tier = ctx.settings.tier
    if ctx.forward.emits and edge > 0 and tier >= 1:
        ctx.skipped_count += edge * ctx.settings.kv_heads
        if tier >= 2:
            ctx.window_edges.add(ctx.forward.step, layer, torch.tensor([[edge]]), None)
    cache_layer.expire()


def stacked_step(ctx: RunContext, q_len: int) -> bool:
    """True when the forward ``ctx`` begins, feeding ``q_len`` tokens, is a decode step whose one-slot evictions run
    once for every layer at its end (:class:`StackedSlots`, made here when every layer first holds its budget):
    one token, nothing recorded, no drafts, a policy that scores layers stacked, every layer at one budget."""
    now, settings = ctx.forward, ctx.settings
    if not now.evicting or now.prompt or q_len != 1 or now.drafts or settings.tier or ctx.prune is not None \
            or settings.attention_topk is not None or ctx.allocated_budgets or not settings.policy.stacks_decode():
        return False
    budget = ctx.layer_budget(0)
    if budget is None:
        return False
    if ctx.stack is None or not ctx.stack.holds(budget):
        ctx.stack = StackedSlots.adopt(ctx.cache.layers, budget)
    return ctx.stack is not None


def eviction_order(scores: torch.Tensor, cache_layer: SparseLayer, drafts: int) -> torch.Tensor:
    """``scores`` ``[b, kv_heads, slots]`` with the ``drafts`` unverified drafts above every other protected slot."""
    if not drafts:
        return scores
    return protect(scores.clamp(max=torch.finfo(scores.dtype).max), cache_layer.positions >= cache_layer.seen - drafts)


def evict_unscored(policy: Policy, cache_layer: SparseLayer, positions: torch.Tensor, budget: int) -> bool:
    """A decode step that records nothing: where each head of a global layer holding ``positions`` ``[1, kv_heads,
    budget + 1]`` drops one slot, let ``policy`` choose it without scoring (:meth:`Policy.evict_one`). True when it did."""
    if cache_layer.window is not None or positions.shape[0] != 1 or positions.shape[-1] != budget + 1:
        return False
    slots = policy.evict_one(positions, cache_layer.seen)
    if slots is None:
        return False
    cache_layer.evict_one(slots)
    return True


def hidden_first(scores: torch.Tensor, cache_layer: SparseLayer) -> torch.Tensor:
    """``scores`` ``[b, kv_heads, slots]`` with what a sliding layer's window hides at ``-inf``: evicted first."""
    hidden = cache_layer.hidden_slots()
    return scores if hidden is None else scores.masked_fill(hidden, float("-inf"))
