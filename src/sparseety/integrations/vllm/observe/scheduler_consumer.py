"""In the API server: what the engine core's scheduler hooks send, kept per request until it finishes.

The scheduler hooks (:mod:`.plugin`) send ``[kind, records]`` messages over this API server's scheduler
channel (:func:`.channels.client_channel`). :class:`SchedulerConsumer` binds its PULL end in a thread
and hands each message to :class:`RequestTable`, which keeps, per vLLM internal request id:

- ``chunk``: ``[request id, first position, tokens]`` per prefill chunk -> :attr:`RequestTable.chunks`;
- ``draft``: ``[request id, step, first position, draft ids, accepted]`` per verify step -> ``drafts``;
- ``kv``: ``[request id, bytes, blocks]`` when vLLM frees the request's blocks -> ``kv_held`` (the peak);
- ``owner``: ``[request id, API server]`` for requests another API server owns (API server 0 only) ->
  ``owners`` (read by :class:`.importance_consumer.ImportanceConsumer` to forward important tokens);
- ``window``: ``[request id, peak bytes, peak blocks, frees]`` when vLLM frees a request's blocks, with
  ``frees`` ``[[computed tokens, group, blocks], ...]`` its sliding-window groups freed -> ``kv_held`` (the
  peak) and ``window_frees``; ``groups``: the engine core's KV-cache groups (once per API server) ->
  :attr:`RequestTable.groups` (:mod:`.window_frees`).

Every table is bounded (``4 x SPARSEETY_QUEUE_SIZE`` requests); the oldest request goes first and is
counted in :attr:`RequestTable.dropped`. The finisher takes a request's entries when it writes its record.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from sparseety.integrations.vllm.vllm_api.messages import KVGroup

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
        self.evictions: OrderedDict[str, list] = OrderedDict()  #: ``on_evict``'s fields
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

    def on_chunks(self, records: list) -> None:
        for req_id, start, n in records:
            self._entry(self.chunks, req_id, list).append((int(start), int(n)))

    def on_drafts(self, records: list) -> None:
        """``[request id, step, first position, draft ids, accepted]`` per verify step (``drafts`` hook)."""
        for req_id, step, position, draft_ids, accepted in records:
            self._entry(self.drafts, req_id, list).append(
                (int(step), int(position), [int(t) for t in draft_ids], int(accepted)))

    def on_kv_blocks(self, records: list) -> None:
        """``[request id, bytes, blocks]`` when vLLM freed a request's blocks (``kv-blocks`` hook): the peak."""
        for req_id, nbytes, blocks in records:
            held = self._entry(self.kv_held, req_id, lambda: [0, 0, 0])
            held[0], held[1], held[2] = max(held[0], int(nbytes)), max(held[1], int(blocks)), int(nbytes)

    def on_window(self, records: list) -> None:
        """``[request id, peak bytes, peak blocks, frees]`` (``window`` hook): the peak, and the window frees."""
        groups = self.groups or []
        for req_id, nbytes, blocks, frees in records:
            held = self._entry(self.kv_held, req_id, lambda: [0, 0, 0])
            held[0], held[1] = max(held[0], int(nbytes)), max(held[1], int(blocks))
            held[2] += sum(int(n) * groups[int(g)].block_bytes for _, g, n in frees if int(g) < len(groups))
            self._entry(self.window_frees, req_id, list).extend([int(c), int(g), int(n)] for c, g, n in frees)

    def on_evict(self, records: list) -> None:
        """``[request id, policy, budget, evicted tokens per layer, freed blocks, compactions, peak tokens, evicted
        slots, failure, refusal]`` when a request that evicted inside vLLM's KV cache finished (``kv-eviction`` hook;
        the slots are rows of step, layer, kv head, position, score, recorded when the trace is at tier 1 or more),
        or one whose eviction was refused (``refusal``: why; it was served dense)."""
        for req_id, *fields in records:
            self._entry(self.evictions, req_id, list)[:] = fields

    def take_eviction(self, internal_id: str) -> dict | None:
        """A finished request's eviction inside vLLM's KV cache (None: it evicted nothing), forgetting it."""
        fields = self.evictions.pop(internal_id, None)
        if not fields:
            return None
        policy, budget, evicted, freed, compactions, peak, slots, failure, refusal = fields
        if refusal is not None:
            return {"policy": str(policy), "refused": str(refusal)}
        return {"policy": str(policy), "budget": int(budget), "evicted_tokens_per_layer": int(evicted),
                "freed_blocks": int(freed), "compactions": int(compactions), "peak_tokens": int(peak),
                "failure": failure, "slots": slots}

    def on_groups(self, records: list) -> None:
        """``[[-1, [[group, window, block bytes, kv heads, layers], ...]]]`` (once per engine core)."""
        for _, groups in records:
            if self.groups is None:
                self.groups = [KVGroup(group=int(g), window=int(w) if w else None, block_bytes=int(b),
                                       kv_heads=int(h), layers=tuple(int(n) for n in layers))
                               for g, w, b, h, layers in groups]

    def on_owners(self, records: list) -> None:
        """``[request id, API server]`` for requests another API server owns (``owners``, API server 0)."""
        for req_id, client in records:  # most are never sampled: the oldest simply go (not a loss)
            self.owners.setdefault(str(req_id), [int(client), 0])
            self.route_owners[str(req_id)] = int(client)
            while len(self.owners) > self.limit:
                self.owners.popitem(last=False)
            while len(self.route_owners) > self.limit:
                self.route_owners.popitem(last=False)

    def take(self, internal_id: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, list[int], int]],
                                              list[int] | None, list[list[int]]]:
        """``(chunks, drafts, kv held, window frees)`` of a finished request, forgetting them."""
        return (self.chunks.pop(internal_id, []), self.drafts.pop(internal_id, []),
                self.kv_held.pop(internal_id, None), self.window_frees.pop(internal_id, []))


class SchedulerConsumer:
    """The thread that binds this API server's scheduler channel and fills a :class:`RequestTable`."""

    def __init__(self, channel: str, table: RequestTable, stop: threading.Event) -> None:
        self.channel = channel
        self.table = table
        self._stop = stop
        self._handlers = {"chunk": table.on_chunks, "draft": table.on_drafts, "kv": table.on_kv_blocks,
                          "owner": table.on_owners, "window": table.on_window, "groups": table.on_groups,
                          "evict": table.on_evict}
        self.thread = threading.Thread(target=self._run, name="sparseety-vllm-chunks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.channel)
        except zmq.ZMQError:
            log.exception("sparseety: cannot bind the prefill-chunk channel %s", self.channel)
            return
        decode = msgspec.msgpack.Decoder(tuple[str, list]).decode
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                kind, records = decode(sock.recv())
                handler = self._handlers.get(kind)
                if handler is not None:
                    handler(records)
        except Exception:
            log.exception("sparseety: prefill-chunk receiver stopped")
        finally:
            sock.close(0)
            if self.channel.startswith("ipc://"):
                try:
                    os.unlink(self.channel[len("ipc://"):])
                except OSError:
                    pass

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
