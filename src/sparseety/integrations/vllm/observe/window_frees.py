"""In the engine core: the KV blocks vLLM's sliding-window layers free while a request runs, and the
blocks the request really holds at its peak.

vLLM's hybrid KV-cache manager keeps one block table per KV-cache group. A sliding-window group frees
the blocks whose tokens left every query's window (``SlidingWindowManager.remove_skipped_blocks``, on
each step before new blocks are allocated) and puts vLLM's null block in their place, so a freed block
is a null entry at the head of the request's table. The ``window-frees`` hook (:mod:`.plugin`) wraps
the coordinator's ``remove_skipped_blocks`` and calls :meth:`WindowFrees.before` and
:meth:`WindowFrees.after` around it:

- ``before``: the blocks the request holds now (its table minus the null entries) are a candidate for
  its peak; blocks allocated on the previous step are in the table by then;
- ``after``: each group's new null entries are the blocks vLLM just freed, at ``computed`` tokens.

Null entries sit at the head of a table (vLLM frees from the oldest block on, and a prefix-cache hit on a
windowed group starts with null blocks), so each group keeps a running count of leading nulls and a step
costs one comparison per group unless blocks were freed. When vLLM frees the request's blocks
(finished, aborted or preempted; the ``kv-blocks`` hook), :meth:`WindowFrees.finish` takes a last peak
and returns a :class:`.wire_messages.WindowPeak` (request id, peak bytes, peak blocks, and the window
frees: computed tokens, group, blocks). Bytes of a block: its group's page size times the group's layers (as ``kv-blocks``).
This module imports neither vLLM nor torch; it reads vLLM's objects through :mod:`.adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import Groups, WindowFree, WindowPeak


@dataclass
class _Held:
    """One request's running view of its block tables."""

    nulls: list[int]  #: per group: leading null entries of its table
    peak_blocks: int = 0
    peak_bytes: int = 0
    frees: list[WindowFree] = field(default_factory=list)


class WindowFrees:
    """The engine core's per-request window frees and held-block peaks (one per engine-core process)."""

    def __init__(self) -> None:
        self.groups: list[KVGroup] | None = None  #: read from the coordinator on first use
        self.requests: dict[str, _Held] = {}

    def _groups(self, coordinator: Any) -> list[KVGroup]:
        if self.groups is None:
            self.groups = adapter.kv_groups(coordinator)
        return self.groups

    def _measure(self, coordinator: Any, request_id: str, held: _Held | None) -> _Held | None:
        """Advance each group's leading-null count and take the held blocks as a peak candidate."""
        groups = self._groups(coordinator)
        tables = adapter.block_tables(coordinator, request_id)
        if tables is None:
            return held
        if held is None:
            held = self.requests[request_id] = _Held(nulls=[0] * len(groups))
        blocks = nbytes = 0
        for g, (table, null) in enumerate(tables):
            lead = held.nulls[g]
            while lead < len(table) and table[lead] is null:
                lead += 1
            held.nulls[g] = lead
            blocks += len(table) - lead
            nbytes += (len(table) - lead) * groups[g].block_bytes
        if blocks > held.peak_blocks:
            held.peak_blocks = blocks
        if nbytes > held.peak_bytes:
            held.peak_bytes = nbytes
        return held

    def before(self, coordinator: Any, request_id: str) -> list[int] | None:
        """Before vLLM frees what left the windows: the peak so far; returns each group's leading nulls."""
        held = self._measure(coordinator, request_id, self.requests.get(request_id))
        return list(held.nulls) if held is not None else None

    def after(self, coordinator: Any, request_id: str, computed: int, nulls: list[int]) -> None:
        """After: each windowed group's new leading nulls are blocks freed at ``computed`` tokens."""
        held = self.requests.get(request_id)
        tables = adapter.block_tables(coordinator, request_id)
        if held is None or tables is None:
            return
        for g, (table, null) in enumerate(tables):
            if self.groups is not None and self.groups[g].window is None:
                continue  # a full-attention group frees nothing before the request ends
            lead = nulls[g]
            while lead < len(table) and table[lead] is null:
                lead += 1
            held.nulls[g] = lead
            if lead > nulls[g]:
                held.frees.append(WindowFree(int(computed), g, lead - nulls[g]))

    def finish(self, coordinator: Any, request_id: str) -> WindowPeak | None:
        """vLLM frees the request's blocks: its peak and window frees (None when it never held a block here)."""
        held = self._measure(coordinator, request_id, self.requests.get(request_id))
        self.requests.pop(request_id, None)
        if held is None:
            return None
        return WindowPeak(request_id, held.peak_bytes, held.peak_blocks, tuple(held.frees))

    def groups_message(self) -> Groups:
        """The KV-cache groups, as the API server learns them."""
        return Groups(tuple(self.groups or ()))
