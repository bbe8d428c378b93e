"""The worker's view of one request that evicts inside vLLM's paged KV cache: what each slot holds, and its scores.

Every layer of a KV-cache group keeps the same number of slots (one block table), but each layer and KV head
keeps its own tokens: ``positions`` ``[layers, kv_heads, held]`` is the logical position of every slot since the
last compaction; slots past ``held`` hold the tokens computed since, in order. The policy is the own engine's,
fed one layer at a time with the :class:`~sparseety.policies.base.Observation` the own engine would build:

- policies that read attention (``snapkv``, ``tova``, ``h2o``) are scored inside the attention backend's
  ``forward`` of every layer, every forward (:meth:`EvictingRequest.observe`): the prompt's window rows, column
  sums (carried over prefill chunks) or last row, then each decode step's row, over the slots the request holds;
  their accumulator (``state``) follows the slots through every compaction;
- policies that read positions, keys or values only (``streaming``, ``knorm``, ``keydiff``) are scored at the
  compaction itself (in :meth:`EvictingRequest.moves`), from the keys read out of the cache;
- a policy that reads the hidden states entering attention (``kvzap``) scores each new token once, in the
  forward that writes it (its per-slot state), and protects its sinks and window at the compaction.

:meth:`EvictingRequest.moves` selects the kept slots with the own engine's ``select_keep`` (ties to the lower
position) and turns them into per-layer, per-head moves (:func:`.compaction.fill_holes`). Torch only; vLLM is
read by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparseety.extract.scoring import column_sums, group_mean, row_probs
from sparseety.integrations.vllm.evict.compaction import fill_holes, kept_positions
from sparseety.policies.base import Observation, Policy, Signal, select_keep

#: read(layer, n, values) -> ``[kv_heads, n, D]`` keys (or values) of the request's first ``n`` slots
SlotReader = Callable[[int, int, bool], torch.Tensor]


def _padded(state: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A policy's per-slot state ``[kv_heads, m]`` over ``n >= m`` slots: new slots hold 0, as in the own engine."""
    if state is None or state.shape[-1] >= n:
        return state
    return torch.nn.functional.pad(state, (0, n - state.shape[-1]))


@dataclass
class EvictingRequest:
    """One evicting request on the worker (``layers`` layers of ``kv_heads`` KV heads)."""

    rid: str
    policy: Policy
    prompt_len: int
    layers: int
    kv_heads: int
    positions: torch.Tensor | None = None  #: ``[layers, kv_heads, held]`` (None before the first compaction)
    prefilled: bool = False  #: the forward that completes the prompt was scored
    compacted: bool = False  #: compacted at least once since (re)start
    failure: str | None = None  #: why a compaction kept the newest tokens instead of the policy's choice
    warned: bool = False
    trace: bool = False  #: record each evicted slot (:attr:`evicted`)
    evicted: list[torch.Tensor] = field(default_factory=list)  #: ``[k, 5]`` step, layer, kv head, position, score
    scores: list[torch.Tensor | None] = field(default_factory=list)  #: per layer ``[kv_heads, n]``
    state: list[torch.Tensor | None] = field(default_factory=list)  #: per layer ``[kv_heads, n]``
    window: list[torch.Tensor | None] = field(default_factory=list)  #: prefill: last query rows ``[heads, w, d]``
    colsum: list[torch.Tensor | None] = field(default_factory=list)  #: prefill: ``[heads, n]`` summed so far

    def __post_init__(self) -> None:
        for name in ("scores", "state", "window", "colsum"):
            setattr(self, name, [None] * self.layers)

    @property
    def held(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[-1])

    @property
    def reads_values(self) -> bool:
        return bool(getattr(self.policy, "value_aware", False))

    def slot_positions(self, layer: int, n: int, end: int) -> torch.Tensor:
        """``[kv_heads, n]`` the logical position of each of the ``n`` slots held once position ``end - 1`` is in."""
        fresh = torch.arange(end - (n - self.held), end)
        if self.positions is None:
            return fresh.expand(self.kv_heads, n)
        return torch.cat([self.positions[layer], fresh.expand(self.kv_heads, -1)], dim=-1)

    def reset(self) -> None:
        """vLLM preempted the request: it recomputes from the prompt, evicted again as at the first time."""
        self.positions, self.prefilled, self.compacted = None, False, False
        self.__post_init__()

    # -- scoring ---------------------------------------------------------------------------------------------
    def observe(self, layer: int, query: torch.Tensor, end: int, n: int, scale: float, read: SlotReader,
                hidden: torch.Tensor | None = None) -> None:
        """One layer's forward over this request's new rows ``query`` ``[r, heads, d]`` (post-RoPE), the last at
        position ``end - 1``; ``n`` slots are held after it. Scores the slots once the prompt is complete; a
        policy that reads ``hidden`` (``[r, D]``, the rows entering attention) scores the new tokens now."""
        policy, prefill = self.policy, not self.prefilled
        if policy.needs_hidden:
            if hidden is None or hidden.shape[0] != query.shape[0]:
                raise RuntimeError(f"the hidden states entering layer {layer}'s attention were not captured")
            self._score(layer, self._keys(layer, n, read), None, end, n, prefill, read, hidden)
            return
        signal = policy.prefill_signal if prefill else policy.decode_signal
        if prefill and end < self.prompt_len:
            self._carry(layer, query, end, n, scale, signal, read)
            return
        if signal is Signal.NONE:
            return  # scored at the compaction
        keys = read(layer, n, False)
        attention = self._attention(layer, query, keys, end, n, scale, signal)
        self._score(layer, keys, attention, end, n, prefill, read)

    def _carry(self, layer: int, query: torch.Tensor, end: int, n: int, scale: float, signal: Signal,
               read: SlotReader) -> None:
        """A prefill chunk before the prompt's last: keep what the last chunk's signal needs."""
        if signal is Signal.WINDOW:
            self.window[layer] = self._window_rows(layer, query)
        elif signal is Signal.COLSUM:
            self.colsum[layer] = self._colsum(layer, query, read(layer, n, False), end, n, scale)

    def _window_rows(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """``[heads, w, d]`` the prompt's last ``window_rows()`` query rows so far: the carried ones, then ``query``."""
        rows = query.transpose(0, 1).float()
        old = self.window[layer]
        return (rows if old is None else torch.cat([old, rows], dim=1))[:, -self.policy.window_rows():]

    def _colsum(self, layer: int, query: torch.Tensor, keys: torch.Tensor, end: int, n: int,
                scale: float) -> torch.Tensor:
        """``[heads, n]`` column sums of the prompt's rows so far (sampled as the own engine samples them)."""
        r = query.shape[0]
        stride = self.policy.colsum_stride(self.prompt_len)
        part = column_sums(query.transpose(0, 1)[None], keys[None], scale, stride,
                           last=self.prompt_len - 1 - (end - r))[0]
        old = self.colsum[layer]
        if old is not None:
            part[:, : old.shape[-1]] += old
        return part

    def _attention(self, layer: int, query: torch.Tensor, keys: torch.Tensor, end: int, n: int, scale: float,
                   signal: Signal) -> torch.Tensor:
        """The policy's signal, averaged over each KV group's query heads: ``[1, kv_heads, (w,) n]``."""
        if signal is Signal.COLSUM:
            total = self._colsum(layer, query, keys, end, n, scale)
            self.colsum[layer] = None
            return group_mean(total[None], self.kv_heads)
        if signal is Signal.WINDOW:
            rows = self._window_rows(layer, query)
            self.window[layer] = None
            return group_mean(row_probs(rows[None], keys[None], scale), self.kv_heads)
        last = query[-1:].transpose(0, 1)[None]  # [1, heads, 1, d]
        return group_mean(row_probs(last, keys[None], scale)[:, :, 0], self.kv_heads)

    def _keys(self, layer: int, n: int, read: SlotReader) -> torch.Tensor:
        """``[kv_heads, n, D]`` the keys of the ``n`` slots held, read out of the cache only for a policy that reads
        them (else zero-width: :attr:`Policy.reads_keys`)."""
        return read(layer, n, False) if self.policy.reads_keys else torch.empty(self.kv_heads, n, 0)

    def _score(self, layer: int, keys: torch.Tensor, attention: torch.Tensor | None, end: int, n: int,
               prefill: bool, read: SlotReader, hidden: torch.Tensor | None = None) -> None:
        state = _padded(self.state[layer], n)
        obs = Observation(
            layer=layer, num_layers=self.layers, step=max(0, end - self.prompt_len), prefill=prefill,
            positions=self.slot_positions(layer, n, end)[None], keys=keys[None], attention=attention,
            state=None if state is None else state[None], seed=0,
            values=read(layer, n, True)[None] if self.reads_values else None, newest=end - 1,
            hidden=None if hidden is None else hidden[None],
        )
        scores, new_state = self.policy.score(obs)
        self.scores[layer] = scores[0]
        self.state[layer] = None if new_state is None else new_state[0]

    def _record(self, keep: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, step: int) -> None:
        """The slots ``keep`` [layers, kv_heads, kept] leaves out, as ``[k, 5]`` rows (step, layer, kv head,
        position, score), in layer, head and slot order."""
        out = torch.ones(positions.shape, dtype=torch.bool)
        out.scatter_(-1, keep, False)
        layer, head, slot = out.nonzero(as_tuple=True)
        self.evicted.append(torch.stack([torch.full_like(layer, step).double(), layer.double(), head.double(),
                                         positions[layer, head, slot].double(),
                                         scores[layer, head, slot].double()], dim=1))

    def take_evicted(self) -> list[list[float]]:
        """The evicted slots recorded since the last call, as rows of (step, layer, kv head, position, score)."""
        if not self.evicted:
            return []
        rows = torch.cat(self.evicted).tolist()
        self.evicted = []
        return rows

    def finish_forward(self, end: int) -> None:
        """After a forward whose last row is position ``end - 1``."""
        if end >= self.prompt_len:
            self.prefilled = True

    # -- compaction -----------------------------------------------------------------------------------------
    def moves(self, end: int, n: int, kept: int, read: SlotReader) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep ``kept`` of the ``n`` slots held (newest position ``end - 1``): ``(src, dst)`` ``[layers, kv_heads,
        m]`` per layer and head (:func:`.compaction.fill_holes`); the slot maps follow the moves. A policy that
        reads no attention at this point (the prompt's signal for the first compaction) is scored here, from the
        keys (and values) in the cache."""
        policy = self.policy
        if (policy.decode_signal if self.compacted else policy.prefill_signal) is Signal.NONE:
            try:
                for layer in range(self.layers):
                    self._score(layer, self._keys(layer, n, read), None, end, n, not self.compacted, read)
            except Exception as exc:
                self.failure = self.failure or f"scoring failed: {exc!r}"
        positions = torch.stack([self.slot_positions(layer, n, end) for layer in range(self.layers)])
        missing = [layer for layer, s in enumerate(self.scores) if s is None or s.shape[-1] != n]
        if missing:  # never stop the engine: keep the newest tokens this time
            self.failure = self.failure or f"no scores of the {n} slots held in layer {missing[0]}"
            scores = positions.float()
        else:
            scores = torch.stack([s for s in self.scores if s is not None])  # [layers, kv_heads, n]
        keep = select_keep(scores, kept, positions)
        if self.trace:
            self._record(keep, positions, scores, step=max(0, end - self.prompt_len))
        moves = fill_holes(keep, kept)
        self.positions = kept_positions(positions, moves, kept)
        for layer, state in enumerate(self.state):
            if state is not None:
                self.state[layer] = kept_positions(_padded(state, n), (moves[0][layer], moves[1][layer]), kept)
        self.scores = [None] * self.layers
        self.compacted = True
        return moves
