"""The scheduler of the batched engine: admits requests by reserved KV bytes and plans every step.

Each :meth:`Scheduler.schedule` call (one per engine step, as in vLLM's v1 scheduler) admits waiting
requests first come, first served while their worst-case KV bytes fit under the memory limit and the
batch has room, then plans the step: every decoding request feeds one token, and at most
``prefill_chunk`` prompt tokens of prefilling requests (oldest first) ride along in the same forward.
A prompt that token pruning must see whole is prefilled in a forward of its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparseety.engine.request import Request, RequestStatus
from sparseety.errors import InputError

if TYPE_CHECKING:
    from sparseety.policies import Policy

DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_BATCH = 8


class KVLimitError(InputError):
    """A request whose worst-case KV bytes can never fit under the engine's memory limit."""


def kv_limit_message(who: str, needed: int, limit: int, *, prompt_len: int, max_new_tokens: int, policy: Policy,
                     limit_name: str = "kv_memory_limit", tokens_name: str = "max_new_tokens") -> str:
    """Why ``needed`` worst-case KV bytes do not fit under ``limit``, with the figures that would.

    The bytes are proportional to the slots a layer holds at worst (the prompt plus ``max_new_tokens - 1``,
    or an evicting policy's budget + 1 when smaller), so ``limit`` holds ``held * limit // needed`` of
    them: the advice is a budget (and ratio of the ``prompt_len``-token prompt), a ``tokens_name`` and a
    ``limit_name`` that fit.
    """
    seen = prompt_len + max_new_tokens - 1
    given = policy.budget if policy.evicts else None
    held = seen if given is None else min(seen, given + 1)
    fit = held * limit // needed
    budget = fit - 1  # a decode step appends one slot before it evicts
    advice = []
    if budget >= 1:
        ratio = math.ceil((1 - budget / prompt_len) * 1000) / 1000
        advice.append(f"{'an evicting policy with a' if given is None else 'a smaller'} budget (at most {budget} "
                      f"slots{f', a ratio of at least {ratio}' if budget < prompt_len else ''})")
    tokens = fit - prompt_len + 1
    if 1 <= tokens < max_new_tokens:
        advice.append(f"fewer {tokens_name} (at most {tokens})")
    advice.append(f"a larger {limit_name} (at least {needed} bytes)")
    under = "" if given is None else f" with budget {given}"
    use = advice[0] if len(advice) == 1 else ", ".join(advice[:-1]) + " or " + advice[-1]
    return (f"{who} needs {needed} bytes of KV cache at worst ({prompt_len} prompt tokens + {tokens_name} "
            f"{max_new_tokens} under policy {policy.name!r}{under}: {held} slots per layer and KV head), more than "
            f"the {limit_name} of {limit} bytes (room for {fit}); use {use}")


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
            raise KVLimitError(kv_limit_message(
                f"request {request.request_id!r}", request.reserved_bytes, self.kv_memory_limit,
                prompt_len=request.prompt_len, max_new_tokens=request.options.max_new_tokens, policy=request.policy))
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
