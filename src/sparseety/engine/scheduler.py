"""The scheduler of the batched engine: admits requests by reserved KV bytes and plans every step.

Each :meth:`Scheduler.schedule` call (one per engine step, as in vLLM's v1 scheduler) admits waiting
requests first come, first served while their worst-case KV bytes fit under the memory limit and the
batch has room, then plans the step: every decoding request feeds one token, and at most
``prefill_chunk`` prompt tokens of prefilling requests (oldest first) ride along in the same forward.
A prompt that token pruning must see whole is prefilled in a forward of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sparseety.engine.request import Request, RequestStatus
from sparseety.errors import InputError

DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_BATCH = 8


class KVLimitError(InputError):
    """A request whose worst-case KV bytes can never fit under the engine's memory limit."""


@dataclass(frozen=True)
class Chunk:
    """``request`` feeds its tokens ``start .. end - 1`` (prompt positions, or its newest output token)."""

    request: Request
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class StepPlan:
    """The forwards of one step; each forward is a list of chunks run as one packed model call."""

    forwards: list[list[Chunk]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(self.forwards)

    def batch_size(self) -> int:
        """Sequences taking part in this step."""
        return sum(len(f) for f in self.forwards)


@dataclass
class Scheduler:
    """Admission and step planning.

    Parameters
    ----------
    max_batch : sequences running (prefilling or decoding) at once.
    prefill_chunk : prompt tokens prefilled per step, across requests.
    kv_memory_limit : bytes of KV reserved at most (None: no limit).
    """

    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    kv_memory_limit: int | None = None
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0  #: the most ever reserved at once
    peak_running: int = 0  #: the most requests ever in the batch at once

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise InputError(f"max_batch must be a positive number of sequences, got {self.max_batch}")
        if self.prefill_chunk <= 0:
            raise InputError(f"prefill_chunk must be a positive number of tokens, got {self.prefill_chunk}")
        if self.kv_memory_limit is not None and self.kv_memory_limit <= 0:
            raise InputError(f"kv_memory_limit must be a positive number of bytes, got {self.kv_memory_limit}")

    def add(self, request: Request) -> None:
        """Queue a request; refuse one that could never be admitted."""
        if self.kv_memory_limit is not None and request.reserved_bytes > self.kv_memory_limit:
            raise KVLimitError(
                f"request {request.request_id!r} needs {request.reserved_bytes} bytes of KV cache at worst, "
                f"more than the kv_memory_limit of {self.kv_memory_limit} bytes; lower max_tokens or use an "
                "evicting policy with a budget")
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while they fit (first come, first served; no overtaking)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            if self.kv_memory_limit is not None and self.reserved_bytes + head.reserved_bytes > self.kv_memory_limit:
                break
            self.waiting.popleft()
            head.status = RequestStatus.PREFILLING
            self.reserved_bytes += head.reserved_bytes
            self.running.append(head)
            admitted.append(head)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def schedule(self) -> StepPlan:
        """Plan one step over the running requests (call :meth:`admit` first)."""
        shared: list[Chunk] = [Chunk(r, r.prompt_len + len(r.output_ids) - 1, r.prompt_len + len(r.output_ids))
                               for r in self.running if r.status is RequestStatus.DECODING]
        plan = StepPlan([shared])
        budget = self.prefill_chunk
        for request in self.running:
            if request.status is not RequestStatus.PREFILLING:
                continue
            if request.whole_region():
                if not any(c.request is request for f in plan.forwards for c in f):
                    plan.forwards.append([Chunk(request, 0, request.region_end())])
                continue
            if budget <= 0:
                continue
            end = min(request.region_end(), request.fed + budget)
            shared.append(Chunk(request, request.fed, end))
            budget -= end - request.fed
        plan.forwards = [f for f in plan.forwards if f]
        return plan

    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out (its reservation is released)."""
        if request in self.running:
            self.running.remove(request)
            self.reserved_bytes -= request.reserved_bytes
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in [*self.running, *self.waiting] if r.request_id == request_id), None)
