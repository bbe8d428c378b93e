"""In the API server: what the engine core's scheduler hooks send, kept per request until it finishes.

The scheduler hooks (:mod:`.engine_core_hooks`, :mod:`..evict.hooks`) send typed messages
(:mod:`..vllm_api.wire_messages`) over this API server's scheduler channel (:func:`.channels.client_channel`).
:class:`SchedulerConsumer` receives them on a :class:`..transport.wire.WireInbox` and hands each kind to its
handler on :class:`RequestTable`, which keeps, per vLLM internal request id:

- :class:`Chunk` per prefill chunk -> :attr:`RequestTable.chunks` ``(first position, tokens)``;
- :class:`Draft` per verify step -> ``drafts``;
- :class:`KVHeld` when vLLM frees the request's blocks -> ``kv_held`` (the peak);
- :class:`Owner` for requests another API server owns (API server 0 only) -> ``owners`` (read by
  :class:`.importance_consumer.ImportanceConsumer` to forward important tokens);
- :class:`WindowPeak` when vLLM frees a request's blocks, with the blocks its sliding-window groups freed ->
  ``kv_held`` (the peak) and ``window_frees``; :class:`Groups`: the engine core's KV-cache groups (once per API
  server) -> :attr:`RequestTable.groups` (:mod:`.window_frees`);
- :class:`EvictionRecord` when a request that evicted inside vLLM (or was refused) finished -> ``evictions``.

Every table is bounded (``4 x SPARSEETY_QUEUE_SIZE`` requests); the oldest request goes first and is
counted in :attr:`RequestTable.dropped`. The finisher takes a request's entries when it writes its record.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from sparseety.integrations.vllm.transport.wire import WireInbox
from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import (
    Chunk,
    Draft,
    EvictionRecord,
    Groups,
    KVHeld,
    Owner,
    WindowPeak,
)

log = logging.getLogger("sparseety.vllm")


class RequestTable:
    """The engine core's per-request records, by vLLM's internal request id (bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  #: requests per table
        self.chunks: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()  #: ``(first position, tokens)``
        self.drafts: OrderedDict[str, list[tuple[int, int, list[int], int]]] = OrderedDict()
        #: ``[peak bytes, peak blocks, dense bytes]``; dense: held at the end plus what the windows freed
        self.kv_held: OrderedDict[str, list[int]] = OrderedDict()
        self.owners: OrderedDict[str, list[int]] = OrderedDict()  #: ``[API server, start forwarded]``
        self.route_owners: OrderedDict[str, int] = OrderedDict()  #: API server, for the MoE routing's forward
        self.window_frees: OrderedDict[str, list[list[int]]] = OrderedDict()  #: ``[computed, group, blocks]``
        self.evictions: OrderedDict[str, EvictionRecord] = OrderedDict()
        self.groups: list[KVGroup] | None = None  #: the KV-cache groups, from the first engine core that sent them
        self.dropped = 0  #: requests whose records were dropped (a table was full), or forwards that did not fit

    def _entry(self, table: OrderedDict, req_id: str, empty: Any) -> Any:
        """``table[req_id]``, created (``empty()``) if absent; the oldest request is dropped beyond the bound."""
        entry = table.get(req_id)
        if entry is None:
            if len(table) >= self.limit:
                table.popitem(last=False)
                self.dropped += 1
            entry = table[req_id] = empty()
        return entry

    def on_chunks(self, records: list[Chunk]) -> None:
        for r in records:
            self._entry(self.chunks, r.req_id, list).append((r.start, r.tokens))

    def on_drafts(self, records: list[Draft]) -> None:
        for r in records:
            self._entry(self.drafts, r.req_id, list).append((r.step, r.position, list(r.draft_ids), r.accepted))

    def on_kv_blocks(self, records: list[KVHeld]) -> None:
        """What a request held when vLLM freed its blocks: the peak, and (so far) its dense bytes."""
        for r in records:
            held = self._entry(self.kv_held, r.req_id, lambda: [0, 0, 0])
            held[0], held[1], held[2] = max(held[0], r.bytes), max(held[1], r.blocks), r.bytes

    def on_window(self, records: list[WindowPeak]) -> None:
        """A request's peak over the window checks, and the blocks its window groups freed (added to dense)."""
        groups = self.groups or []
        for r in records:
            held = self._entry(self.kv_held, r.req_id, lambda: [0, 0, 0])
            held[0], held[1] = max(held[0], r.peak_bytes), max(held[1], r.peak_blocks)
            held[2] += sum(f.blocks * groups[f.group].block_bytes for f in r.frees if 0 <= f.group < len(groups))
            self._entry(self.window_frees, r.req_id, list).extend([f.computed, f.group, f.blocks] for f in r.frees)

    def on_evict(self, records: list[EvictionRecord]) -> None:
        """A request that evicted inside vLLM's KV cache finished (the slots recorded at tier 1 or more), or one
        whose eviction was refused (it was served dense)."""
        for r in records:
            if len(self.evictions) >= self.limit and r.req_id not in self.evictions:
                self.evictions.popitem(last=False)
                self.dropped += 1
            self.evictions[r.req_id] = r

    def take_eviction(self, internal_id: str) -> dict | None:
        """A finished request's eviction inside vLLM's KV cache as its record's ``extra_json.vllm.eviction`` (None:
        it evicted nothing), forgetting it; ``slots`` (an :class:`.wire_messages.EvictedSlots`) is the finisher's."""
        r = self.evictions.pop(internal_id, None)
        if r is None:
            return None
        if r.refused is not None:
            return {"policy": r.policy, "refused": r.refused}
        return {"policy": r.policy, "budget": r.budget, "evicted_tokens_per_layer": r.evicted_tokens_per_layer,
                "freed_blocks": r.freed_blocks, "compactions": r.compactions, "peak_tokens": r.peak_tokens,
                "failure": r.failure, "slots": r.slots}

    def on_groups(self, records: list[Groups]) -> None:
        """The engine core's KV-cache groups (the first engine core's stand)."""
        for r in records:
            if self.groups is None:
                self.groups = list(r.groups)

    def on_owners(self, records: list[Owner]) -> None:
        """Requests another API server owns (API server 0)."""
        for r in records:  # most are never sampled: the oldest simply go (not a loss)
            self.owners.setdefault(r.req_id, [r.client, 0])
            self.route_owners[r.req_id] = r.client
            while len(self.owners) > self.limit:
                self.owners.popitem(last=False)
            while len(self.route_owners) > self.limit:
                self.route_owners.popitem(last=False)

    def handlers(self) -> dict[type, Any]:
        """The handler of each message kind of the scheduler channel."""
        return {Chunk: self.on_chunks, Draft: self.on_drafts, KVHeld: self.on_kv_blocks, Owner: self.on_owners,
                WindowPeak: self.on_window, Groups: self.on_groups, EvictionRecord: self.on_evict}

    def take(self, internal_id: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, list[int], int]],
                                              list[int] | None, list[list[int]]]:
        """``(chunks, drafts, kv held, window frees)`` of a finished request, forgetting them."""
        return (self.chunks.pop(internal_id, []), self.drafts.pop(internal_id, []),
                self.kv_held.pop(internal_id, None), self.window_frees.pop(internal_id, []))


class SchedulerConsumer:
    """The inbox of this API server's scheduler channel, filling a :class:`RequestTable`."""

    def __init__(self, channel: str, table: RequestTable) -> None:
        self.channel = channel
        self.table = table
        self.inbox = WireInbox(channel, table.handlers(), name="scheduler")

    def join(self, timeout: float) -> None:
        self.inbox.close(timeout)
