"""The engine core's side of eviction inside vLLM: per request, how many tokens it holds and when to compact.

vLLM counts a request's tokens logically (``num_computed_tokens``); after eviction the request physically
holds fewer. The ledger keeps the difference (``offset``): vLLM's full-attention block manager asks for
blocks for ``logical - offset`` tokens, and the worker writes the next token at slot ``logical - offset``.
Before each schedule :meth:`EvictionLedger.plan` decides, per running request whose prompt is complete,
whether to compact it to its budget: at the first step after the prompt (as the own engine evicts at the
prefill that completes the prompt) and then whenever it holds ``interval`` tokens past its budget. A plan is a
:class:`Compaction`: the scheduler frees the tail blocks it implies at once, and the worker moves the kept
K/V into the first slots before that step's forward. Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparseety.integrations.vllm.evict.orders import Compaction, StepReport
from sparseety.integrations.vllm.vllm_api.wire_messages import EvictedSlots, EvictionRecord


@dataclass
class RequestLedger:
    """What the ledger knows of one request: ``offset`` and ``compactions`` since vLLM last allocated it from
    scratch; the totals (``evicted``, ``freed_blocks``, ``peak``) over its whole life, preemptions included."""

    budget: int
    policy: str = ""
    offset: int = 0
    compactions: int = 0
    freed_blocks: int = 0
    evicted: int = 0  #: tokens per layer evicted, summed over compactions
    peak: int = 0  #: the most tokens it held at once (before a compaction)
    events: list[EvictedSlots] = field(default_factory=list)  #: the worker's evicted slots, step by step
    failure: str | None = None  #: why the worker stopped following the policy (the request then stops evicting)

    def record(self, rid: str) -> EvictionRecord:
        """What travels to the observer when the request finishes."""
        return EvictionRecord(rid, self.policy, self.budget, self.evicted, self.freed_blocks, self.compactions,
                              self.peak, EvictedSlots.joined(self.events), self.failure)


def refused_record(rid: str, policy: str, reason: str) -> EvictionRecord:
    """The record of a request whose ``vllm_xargs`` asked for an eviction that cannot run: it was served dense."""
    return EvictionRecord(rid, policy, refused=reason)


class EvictionLedger:
    """Offsets and compaction decisions for the requests that evict (one per engine core)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.requests: dict[str, RequestLedger] = {}
        self.totals = {"evicted_tokens": 0, "freed_blocks": 0, "compactions": 0}

    def track(self, rid: str, budget: int, policy: str = "") -> None:
        """Start tracking ``rid`` (keeping ``budget`` tokens per layer with ``policy``); its offset is zero."""
        self.requests[rid] = RequestLedger(budget, policy)

    def offset(self, rid: str) -> int:
        """Logical minus physical tokens of ``rid`` (0 when it does not evict)."""
        led = self.requests.get(rid)
        return led.offset if led is not None else 0

    def plan(self, rid: str, computed: int, prompt: int) -> Compaction | None:
        """The compaction of ``rid`` before the step that follows ``computed`` computed tokens, or None."""
        led = self.requests.get(rid)
        if led is None or computed < prompt or led.failure is not None:
            return None
        physical = computed - led.offset
        led.peak = max(led.peak, physical)
        if physical <= led.budget or (led.compactions and physical - led.budget < self.interval):
            return None
        return Compaction(rid, computed, physical, led.budget)

    def apply(self, order: Compaction, freed_blocks: int) -> None:
        """Record that ``order`` was carried out and freed ``freed_blocks`` blocks."""
        led = self.requests[order.rid]
        led.offset += order.evicted
        led.evicted += order.evicted
        led.compactions += 1
        led.freed_blocks += freed_blocks
        self.totals["evicted_tokens"] += order.evicted
        self.totals["freed_blocks"] += freed_blocks
        self.totals["compactions"] += 1

    def reset(self, rid: str) -> None:
        """vLLM freed all of ``rid``'s blocks (finished or preempted): a recompute starts from zero."""
        led = self.requests.get(rid)
        if led is not None:
            led.offset = 0
            led.compactions = 0

    def receive(self, report: StepReport) -> list[tuple[str, str]]:
        """The worker's report after a step (:meth:`.WorkerEviction.outbox`): evicted slots join their request;
        a request whose compaction failed stops evicting. The ``(request id, reason)`` newly failed."""
        for rid, slots in report.evicted.items():
            led = self.requests.get(rid)
            if led is not None and len(slots):
                led.events.append(slots)
        failed = []
        for rid, reason in report.failed.items():
            led = self.requests.get(rid)
            if led is not None and led.failure is None:
                led.failure = str(reason)
                failed.append((rid, led.failure))
        return failed

    def forget(self, rid: str) -> RequestLedger | None:
        return self.requests.pop(rid, None)
