"""In API server 0: vLLM's KV events, counted, indexed and written as ``vllm-prefix-cache`` records.

:class:`KVConsumer` starts the subscriber (:class:`.kv_events.KVEventSubscriber`, one endpoint per
data-parallel rank) when the stat logger names vLLM's KV-event endpoint, and on each pass of the
observer's worker thread takes the changes it decoded: counts them (``sparseety:kv_blocks_*``), keeps
them in a window, and writes each window (at most :data:`KV_WINDOW_S` seconds or 4096 changes) as one
record per rank. The block index (:class:`.kv_events.RankedBlockIndex`) also answers which cached blocks
a finished request's prompt used (:meth:`prompt_blocks`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from sparseety.integrations.vllm.observe.kv_events import (
    KVChange,
    KVEventSubscriber,
    RankedBlockIndex,
    hash_text,
    rank_endpoint,
    subscriber_endpoint,
)
from sparseety.integrations.vllm.transport.record import KV_POLICY, EventGroup, VllmRun
from sparseety.integrations.vllm.transport.sink import TraceSink

log = logging.getLogger("sparseety.vllm")
KV_WINDOW_S = 1.0


class KVConsumer:
    """The KV-event subscriber's changes: metrics, the block index and the prefix-cache records."""

    def __init__(self, sink: TraceSink) -> None:
        self.sink = sink
        self.index = RankedBlockIndex()
        self.endpoints: list[str] = []  #: where the subscriber listens, one per DP rank
        self.subscriber: KVEventSubscriber | None = None
        self._tried = False
        self._window: list[KVChange] = []
        self._window_started = 0.0
        self._window_count = 0
        self._lost = 0

    def subscribe(self, endpoint: str, data_parallel_size: int) -> None:
        """Subscribe to rank 0's ``endpoint`` and each other rank's (once per process)."""
        if self._tried:
            return
        self._tried = True  # vLLM configures one stat logger per engine
        places = [subscriber_endpoint(rank_endpoint(endpoint, r)) for r in range(max(data_parallel_size, 1))]
        addresses, bind = [a for a, _ in places], places[0][1]
        subscriber = KVEventSubscriber(addresses, self.index, bind=bind).start()
        if subscriber.error is None:
            self.subscriber = subscriber
            self.endpoints = addresses
        else:
            log.warning("sparseety: cannot subscribe to KV events at %s (%s); prefix-cache blocks are "
                        "not recorded", ", ".join(addresses), subscriber.error)

    def prompt_blocks(self, prompt_ids: list[int], request_id: str, rank: int) -> list[Any]:
        """The cached blocks a finished request's prompt used (marked as used by it); none without events."""
        if not self.sink.block_size or self.subscriber is None:
            return []
        blocks = self.index.prompt_blocks(prompt_ids, self.sink.block_size, rank=rank)
        self.index.mark_used(blocks, request_id)
        return blocks

    def take(self) -> None:
        """Take the subscriber's changes into the window (and count them)."""
        sub = self.subscriber
        if sub is not None:
            lost = sub.dropped_changes + sub.seq_gaps
            if lost > self._lost:
                self.sink.metrics.kv_events_dropped.inc(lost - self._lost)
                self._lost = lost
            changes = sub.take()
            if changes:
                self._count(changes)
                if not self._window:
                    self._window_started = time.monotonic()
                self._window.extend(changes)

    def write(self, final: bool) -> None:
        """Write the window once it is old or large enough (or ``final``): one record per rank."""
        now = time.monotonic()
        if self._window and (final or now - self._window_started >= KV_WINDOW_S or len(self._window) > 4096):
            changes, self._window = self._window, []
            by_rank: dict[int, list[KVChange]] = {}
            for change in changes:
                by_rank.setdefault(change.rank, []).append(change)
            for rank in sorted(by_rank):
                self._record(rank, by_rank[rank])

    def _count(self, changes: list[KVChange]) -> None:
        m = self.sink.metrics
        for change in changes:
            engine = str(change.rank)
            if change.kind == "stored":
                m.kv_blocks_stored.labels(engine=engine).inc()
            else:
                m.kv_blocks_evicted.labels(engine=engine).inc()
                m.kv_tokens_evicted.labels(engine=engine).inc(len(change.block.token_ids))

    def _record(self, rank: int, changes: list[KVChange]) -> None:
        """One ``vllm-prefix-cache`` record: one DP rank's cache changes in one window."""
        stored, removed = EventGroup(), EventGroup()
        blocks = []
        for change in changes:
            block = change.block
            group = stored if change.kind == "stored" else removed
            group.extend_positions(change.seq, block.depth, block.first_position, block.token_ids, change.ts)
            blocks.append({"event": change.kind, "hash": hash_text(block.block_hash),
                           "parent": hash_text(block.parent), "depth": block.depth, "seq": change.seq,
                           "tokens": len(block.token_ids), "requests": list(block.requests)})
        if self.sink.writer is None:
            return
        first, last = changes[0].seq, changes[-1].seq
        self._window_count += 1
        arrays = {**(stored.arrays("kv_stored") if len(stored) else {}),
                  **(removed.arrays("kv_removed") if len(removed) else {})}
        sub = self.subscriber
        info = {"blocks": blocks, "first_seq": first, "last_seq": last,
                "stored_blocks": sum(b["event"] == "stored" for b in blocks),
                "removed_blocks": sum(b["event"] == "removed" for b in blocks),
                "removed_unknown_total": self.index.removed_unknown, "cleared_total": self.index.cleared,
                "dropped_changes_total": sub.dropped_changes if sub else 0,
                "seq_gaps_total": sub.seq_gaps if sub else 0, "data_parallel_rank": rank,
                "endpoint": self.endpoints[rank] if rank < len(self.endpoints) else None}
        run = VllmRun(
            request_id=f"vllm-kv-{os.getpid()}-r{rank}-{first}-{last}-{self._window_count}",
            model=self.sink.model, prompt_ids=[], output_ids=[], tier=2, policy=KV_POLICY,
            params=self.sink.params(), evicted_positions=len(removed), eviction_events=len(removed),
            provenance=self.sink.provenance(), arrays=arrays, vllm=info,
        )
        # the cache's own record is never sampled away: force it like a tier-3 run would be
        self.sink.submit(run, {"vllm_kv": info}, sample_rate=1.0)

    def stats(self) -> dict[str, int]:
        sub = self.subscriber
        return {"kv_batches": sub.batches if sub else 0, "kv_dropped": sub.dropped_changes if sub else 0,
                "kv_seq_gaps": sub.seq_gaps if sub else 0, "kv_removed_unknown": self.index.removed_unknown}

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()
