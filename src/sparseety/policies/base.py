"""The policy contract: a small, pure scorer plus one shared, deterministic selection rule.

A policy sees one layer at a time through an :class:`Observation` and returns a score per cache
slot (higher means keep). Slots are not always in position order (the cache reuses freed slots), so
selection orders ties by position: the lower position is kept among equal scores. Protected slots (attention sinks,
recent windows) get ``+inf`` and are never evicted while the budget allows.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparseety.errors import ConfigError


class BudgetTooSmall(ConfigError):
    """A budget below the least a policy can hold; ``minimum`` is that least, ``why`` what sets it
    (``streaming``: ``"its 4 sinks"``)."""

    def __init__(self, message: str, minimum: int, why: str) -> None:
        super().__init__(message)
        self.minimum, self.why = minimum, why


class Signal(enum.Enum):
    """Which attention probabilities a policy needs from the hook point.

    NONE: nothing. LAST_ROW: the last query row, ``[b, heads, n]``. WINDOW: the last ``window`` query
    rows, ``[b, heads, w, n]``. COLSUM: the attention every key receives, summed over all query rows
    (block by block, never a full ``[heads, q, n]`` matrix), ``[b, heads, n]``.
    """

    NONE = "none"
    LAST_ROW = "last_row"
    WINDOW = "window"
    COLSUM = "colsum"


@dataclass(frozen=True)
class Observation:
    """What a policy may look at for one layer after one forward step.

    Attributes
    ----------
    layer : layer index.
    num_layers : number of layers in the model.
    step : output tokens already produced (0 during prefill).
    prefill : True for the forward that processed the prompt.
    positions : ``[b, kv_heads, n]`` original token position of every slot (not necessarily ascending:
        the prefill's slots are, later slots may have been reused).
    keys : ``[b, kv_heads, n, d]`` cached keys (RoPE applied).
    attention : probabilities as requested by the policy's signal, already averaged over the query
        heads of each KV group: ``[b, kv_heads, n]`` (LAST_ROW, COLSUM) or ``[b, kv_heads, w, n]``
        (WINDOW); None for NONE.
    state : ``[b, kv_heads, n]`` the per-slot accumulator this policy returned last time (compacted
        with the cache; new slots hold 0), or None before the first call.
    seed : run seed, for policies that draw random numbers.
    queries : ``[b, heads, w, d]`` the last ``w <= Policy.query_rows()`` query rows (RoPE applied) of
        this forward (a chunked prefill: of the whole prompt, carried across chunks), for policies
        whose :meth:`Policy.query_rows` is > 0; None otherwise. Row ``j`` is the token of slot
        ``n - w + j`` (new tokens are always the last slots).
    values : ``[b, kv_heads, n, d]`` cached values (the live view, no copy).
    rotary : ``[rotary_dim // 2]`` float32 RoPE inverse frequencies of this layer (the first
        ``rotary_dim`` dims of a head are rotated, ``rotate_half`` layout), with ``queries``; None when
        the model has none.
    token_ids : ``[b, kv_heads, n]`` token id of every slot (-1 where unknown), only for policies whose
        :attr:`Policy.needs_token_ids` is True; None otherwise.
    hidden : ``[b, r, hidden_size]`` the hidden states that entered this layer's attention block for the
        ``r`` tokens fed since the policy's previous call (a chunked prefill: every chunk's), the tokens of
        the last ``r`` slots in order (on a layer stored per KV head: the ``r`` newest positions of every
        head); only for policies whose :attr:`Policy.needs_hidden` is True.
    owners : ``[b, 1, n]`` on a layer stored per KV head (after a policy gave its heads their own counts;
        every head's slots in one row, so ``positions`` is ``[b, 1, n]`` and free slots hold position -1):
        the KV head each slot belongs to (heads' slots lie together, in head order, and a head's slots of the
        ``r`` newest positions are its last ``r`` live ones); None otherwise.
    newest : the newest position fed (every head holds it), or None: read from ``positions``.
    """

    layer: int
    num_layers: int
    step: int
    prefill: bool
    positions: torch.Tensor
    keys: torch.Tensor
    attention: torch.Tensor | None
    state: torch.Tensor | None
    seed: int
    queries: torch.Tensor | None = None
    values: torch.Tensor | None = None
    rotary: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    owners: torch.Tensor | None = None
    newest: int | None = None


@dataclass(frozen=True)
class ReconstructionChunk:
    """One forward of a reconstructing policy's own pass (:meth:`Policy.reconstruction_chunks`): it feeds
    ``ids`` over the region's cache and scores the region's positions ``start .. end - 1`` from those rows.

    ``sinks`` is how many of the first positions join the scoring softmax (``min(policy.sinks, start)``).
    """

    ids: tuple[int, ...]
    start: int
    end: int
    sinks: int
    local: bool = False  #: the rows attend to the scoring set only (``attend="chunk"``), not the whole context


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may learn about the model it runs on (:meth:`Policy.bind`).

    ``fingerprint`` is a callable so that only a policy that asks pays for hashing the weights.
    """

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int | None
    fingerprint: Callable[[], str]


@dataclass
class Policy:
    """Base class for a KV policy. Subclasses are dataclasses whose fields are the policy's options."""

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    prefill_signal: ClassVar[Signal] = Signal.NONE
    decode_signal: ClassVar[Signal] = Signal.NONE
    #: False for policies that never delete keys (``dense``, ``topk_attention``).
    evicts: ClassVar[bool] = True
    #: True when decode steps attend only to the top-``budget`` keys (nothing deleted).
    attends_topk: ClassVar[bool] = False
    #: True for policies that score the region after its prefill from a teacher-forced pass of their own
    #: (``kvzip``): the engine defers the region's eviction, runs the forwards
    #: :meth:`reconstruction_chunks` declares, discards their KV, then evicts.
    reconstructs: ClassVar[bool] = False
    #: True for policies that read :attr:`Observation.token_ids` (the engine fills it only for them).
    needs_token_ids: ClassVar[bool] = False
    #: True for policies that read :attr:`Observation.hidden` (the engine captures it only for them).
    needs_hidden: ClassVar[bool] = False
    #: False for policies whose scores never read :attr:`Observation.keys` (an engine that must copy keys out
    #: of its cache to build the observation, vLLM's worker, then hands a zero-width ``[b, kv_heads, n, 0]``).
    reads_keys: ClassVar[bool] = True

    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget <= 0):
            raise ConfigError(f"budget must be a positive integer, got {self.budget!r}")

    # -- options -----------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """The policy's options (without the budget), for provenance."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "budget"}

    def window_rows(self) -> int:
        """Query rows needed for :attr:`Signal.WINDOW`."""
        return 0

    def query_rows(self) -> int:
        """Last query rows a policy reads as :attr:`Observation.queries` (0: none, the engine copies nothing)."""
        return 0

    def colsum_stride(self, q_len: int) -> int:
        """Row sampling stride for :attr:`Signal.COLSUM` over ``q_len`` query rows (1: every row, exact)."""
        return 1

    def layer_budget(self, layer: int, num_layers: int, seen: int | None = None) -> int | None:
        """Slots this layer may hold per KV head (None: unbounded), once ``seen`` tokens were seen."""
        return self.budget

    @classmethod
    def needs_budget(cls, options: dict[str, Any]) -> bool:
        """True when, with ``options``, an evicting policy must be given a budget (False: a threshold policy)."""
        return cls.evicts or cls.attends_topk

    def keep_count(self, scores: torch.Tensor) -> int | None:
        """Slots per KV head to keep after this step, chosen from the scores ``[b, kv_heads, n]`` just returned
        by :meth:`score` (a threshold policy); None (the default): the layer budget decides."""
        return None

    def allocate(self, scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> dict[int, int | list[int]]:
        """Per-layer budgets once every layer's region is scored at once (a reconstructing policy's pass).

        ``scores``: per compressing layer ``[b, kv_heads, n]`` from :meth:`score`; ``budgets``: their
        uniform budgets. A layer's entry is an int (slots per KV head) or a list with one count per
        KV head (the engine then stores that layer per head). The default keeps the budgets; ``kvzip``
        shares them out by score over all layers.
        """
        return dict(budgets)

    @property
    def shares_budget(self) -> bool:
        """True when the prefill that completes a region scores every layer first and then shares the budgets
        out among them with :meth:`allocate` before evicting (``kvzap``); False (the default): each layer
        evicts as soon as it is scored."""
        return False

    @property
    def splits_heads(self) -> bool:
        """True when :meth:`allocate` gives each KV head its own count (the layer is stored per head)."""
        return False

    def reconstruction_chunks(self, context_ids: list[int], tokenizer: Any) -> list[ReconstructionChunk]:
        """The extra forwards of a reconstructing policy's pass over a region holding ``context_ids`` (in
        order), run by the engine after the region's prefill (:attr:`reconstructs`); none by default."""
        return []

    def bind(self, model: ModelInfo) -> None:
        """Called when a run context is created for this policy on ``model``; raise :class:`ConfigError`
        when the policy cannot run on it. The default accepts every model."""

    # -- scoring -----------------------------------------------------------------------------
    def evict_one(self, positions: torch.Tensor, seen: int) -> torch.Tensor | None:
        """A decode step's shortcut, where each head must drop one slot and no score is recorded: ``[b, kv_heads, 1]``
        the slot :func:`select_evict` would pick from :meth:`score`, found from ``positions`` ``[b, kv_heads, n]``
        (all below ``seen``) alone, the policy's state untouched; None (the default): the engine scores and selects."""
        return None

    def stacks_decode(self) -> bool:
        """True when a decode step may score every layer at once: one :class:`Observation` whose batch axis holds
        the layers (``positions``, ``state``, ``attention``, ``keys``, ``values`` ``[layers, kv_heads, n, ...]``,
        ``layer`` 0, ``newest`` given), which requires that a slot's score depend only on its own layer's
        tensors (never on ``layer``, queries, hidden states or token ids), that :meth:`evict_one` work on such
        positions, that :meth:`keep_count` be None and that every layer have the same budget. False by default."""
        return False

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score every slot of one layer.

        Returns
        -------
        scores : ``[b, kv_heads, n]`` float, higher is kept; ``+inf`` marks protected slots.
        state : ``[b, kv_heads, n]`` accumulator to hand back next step, or None.
        """
        raise NotImplementedError


def share_layers(scores: dict[int, torch.Tensor], budgets: dict[int, int],
                 per_rank: Callable[[torch.Tensor], torch.Tensor], floor: float = 0.0) -> dict[int, int]:
    """Slots per layer when the layers of ``scores`` (``[b, kv_heads, n]`` each) share the sum of ``budgets``.

    Layer ``l``'s ``j+1``-th slot gains ``per_rank`` of its heads' ``j+1``-th best scores (``per_rank`` maps the
    sorted ``[b, kv_heads, n]`` to ``[n]``, e.g. their sum or max); the largest gains win (ties: the lower
    layer, then slot). Every layer keeps at least one slot, and at least ``ceil(floor * budget)`` of them.
    """
    layers = sorted(scores)
    flat, owner = [], []
    for i, layer in enumerate(layers):
        gain = per_rank(scores[layer].float().sort(dim=-1, descending=True).values).cpu().clone()
        gain[: max(1, math.ceil(floor * budgets[layer]))] = float("inf")
        flat.append(gain)
        owner.append(torch.full((gain.numel(),), i))
    total = sum(budgets[layer] for layer in layers)
    won = torch.cat(owner)[torch.sort(torch.cat(flat), descending=True, stable=True).indices[:total]]
    shares = torch.bincount(won, minlength=len(layers)).tolist()
    return {layer: int(shares[i]) for i, layer in enumerate(layers)}


def head_counts(scores: dict[int, torch.Tensor], budgets: dict[int, int], layers: list[int]) -> dict[int, list[int]]:
    """Per layer of ``layers``, the slots each KV head keeps when one ranking over all their (layer, head,
    slot) scores (``[1, kv_heads, n]`` each) keeps the best ``sum(budgets) x kv_heads``.

    Every head's best slot (its first, on ties) ranks first, so each keeps at least one and the counts
    add up to exactly that total; other ties go to the lower layer, head, then slot (a stable sort).
    """
    heads = [scores[layer].shape[1] for layer in layers]
    ranked = []
    for layer in layers:
        s = scores[layer][0].float().cpu().clone()
        s.scatter_(-1, s.argmax(dim=-1, keepdim=True), float("inf"))
        ranked.append(s.reshape(-1))
    owner = torch.cat([torch.arange(kv_heads).repeat_interleave(scores[layer].shape[2]) + sum(heads[:i])
                       for i, (layer, kv_heads) in enumerate(zip(layers, heads))])  # each slot's (layer, head), flat
    total = sum(budgets[layer] * kv_heads for layer, kv_heads in zip(layers, heads))
    won = owner[torch.sort(torch.cat(ranked), descending=True, stable=True).indices[:total]]
    counts = torch.bincount(won, minlength=sum(heads)).split(heads)
    return {layer: c.tolist() for layer, c in zip(layers, counts)}


def share_heads(scores: dict[int, torch.Tensor], budgets: dict[int, int], across_layers: bool) -> dict[int, list[int]]:
    """Per layer of ``scores`` one count per KV head (:func:`head_counts`): each layer's heads share its budget,
    or with ``across_layers`` every layer's heads share the budgets' sum."""
    groups = [sorted(scores)] if across_layers else [[layer] for layer in sorted(scores)]
    return {layer: counts for group in groups for layer, counts in head_counts(scores, budgets, group).items()}


def recent_mask(positions: torch.Tensor, window: int, newest: int | None = None) -> torch.Tensor:
    """``[b, kv_heads, n]`` bool: the slots among the ``window`` most recent positions of each head (``newest``:
    the newest position, held by every head, when the caller knows it; else each head's largest)."""
    if window <= 0:
        return torch.zeros_like(positions, dtype=torch.bool)
    if newest is not None:
        return positions > newest - window
    return positions > positions.amax(dim=-1, keepdim=True) - window


def accumulated(obs: Observation) -> torch.Tensor:
    """``[b, kv_heads, n]`` this step's attention added to the slot accumulator (H2O-style).

    The accumulator ``obs.state`` is updated in place (the engine stores what :meth:`Policy.score` returns
    as the new state, so no copy is made each decode step)."""
    assert obs.attention is not None
    if obs.state is None:
        return obs.attention
    if obs.state.shape == obs.attention.shape and obs.state.dtype == obs.attention.dtype:
        return obs.state.add_(obs.attention)
    return obs.state + obs.attention


def protect(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return ``scores`` with the slots in ``mask`` set to ``+inf``."""
    return scores.masked_fill(mask, float("inf"))


def select_keep(scores: torch.Tensor, budget: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``budget`` best slots per head, ascending; ties go to the lower position.

    Parameters
    ----------
    scores : ``[b, kv_heads, n]``.
    budget : slots to keep, ``<= n``.
    positions : ``[b, kv_heads, n]`` original position of every slot (a ``SparseCache`` reuses freed
        slots, so slot order is not position order); None: slots are in ascending position order.

    Returns
    -------
    ``[b, kv_heads, budget]`` long slot indices, sorted ascending.
    """
    n = scores.shape[-1]
    if positions is None:
        positions = torch.arange(n, device=scores.device).expand(scores.shape)
    if n - budget == 1:  # the common decode step: drop the newest slot among the lowest scores
        lowest = scores == scores.amin(dim=-1, keepdim=True)
        evict = torch.where(lowest, positions, -1).argmax(dim=-1, keepdim=True)
        slots = torch.arange(n - 1, device=scores.device).expand(*scores.shape[:-1], n - 1)
        return slots + (slots >= evict).long()
    by_position = positions.argsort(dim=-1, stable=True)
    order = torch.sort(scores.gather(-1, by_position), dim=-1, descending=True, stable=True).indices
    return by_position.gather(-1, order[..., :budget]).sort(dim=-1).values


def select_evict(scores: torch.Tensor, budget: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The complement of :func:`select_keep`: ``[b, kv_heads, n - budget]`` slot indices to evict (any order)."""
    n = scores.shape[-1]
    if positions is None:
        positions = torch.arange(n, device=scores.device).expand(scores.shape)
    if n - budget == 1:  # the common decode step: the newest slot among the lowest scores
        lowest = scores == scores.amin(dim=-1, keepdim=True)
        return torch.where(lowest, positions, -1).argmax(dim=-1, keepdim=True)
    by_position = positions.argsort(dim=-1, stable=True)
    order = torch.sort(scores.gather(-1, by_position), dim=-1, descending=True, stable=True).indices
    return by_position.gather(-1, order[..., budget:])


def select_evict_by_head(scores: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor,
                         budgets: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """:func:`select_evict` for slots of several KV heads in one row (a layer split per head): ``[e]`` slot
    indices (any order, none when every head is within budget) leaving KV head ``i`` its ``budgets[i]``
    best slots; ties go to the lower position. Slots at position -1 are free: never chosen, never counted.

    Parameters
    ----------
    scores, positions, heads : ``[n]`` each slot's score, original position and KV head.
    budgets : ``[kv_heads]`` long.
    counts : the live slots of each head, when the caller knows them (else counted here).
    """
    live = positions >= 0
    if counts is None:
        counts = torch.bincount(heads[live], minlength=budgets.numel()).tolist()
    excess = [n - b for n, b in zip(counts, budgets.tolist())]
    if max(excess) <= 0:
        return heads.new_zeros(0)
    over = torch.tensor([x > 0 for x in excess], device=heads.device)
    if max(excess) == 1:  # the decode step: per head over budget, the newest live slot among its lowest scores
        scores = scores.masked_fill(~live, float("inf"))
        lowest = scores.new_full(budgets.shape, float("inf")).scatter_reduce(0, heads, scores, "amin")
        tied = scores == lowest[heads]
        newest = positions.new_full(budgets.shape, -1).scatter_reduce(0, heads, torch.where(tied, positions, -1), "amax")
        return (tied & (positions == newest[heads]) & over[heads] & live).nonzero(as_tuple=True)[0]
    scores = scores.masked_fill(~live, float("-inf"))  # free slots rank last, and are dropped from the answer
    by_position = positions.argsort(stable=True)
    order = by_position[torch.sort(scores[by_position], descending=True, stable=True).indices]  # best first
    order = order[torch.sort(heads[order], stable=True).indices]  # head after head, best first within each
    owner = heads[order]
    per_head = torch.bincount(heads, minlength=budgets.numel())
    rank = torch.arange(order.numel(), device=order.device) - (per_head.cumsum(0) - per_head)[owner]
    chosen = order[rank >= budgets[owner]]
    return chosen[live[chosen]]


def check_finite(policy: str, field: str, value: Any, what: str = "a finite number") -> None:
    """Raise :class:`ConfigError` when ``value`` is a float infinity or NaN (``inf`` is no more a setting than
    ``nan``, and neither is JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{policy}: {field} must be {what}, got {value!r}")


def check_positive_int(policy: str, field: str, value: Any, minimum: int = 1) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int ``>= minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{policy}: {field} must be an integer >= {minimum}, got {value!r}")
