"""What rides vLLM's own step objects between the scheduler and the worker: the scheduler's :class:`StepOrders` on
the ``SchedulerOutput`` and the worker's :class:`StepReport` on the ``ModelRunnerOutput``, typed (vLLM carries them
to the worker process and back with the objects they ride on). Pure Python: no vLLM, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparseety.integrations.vllm.vllm_api.wire_messages import EvictedSlots


@dataclass(frozen=True)
class Compaction:
    """One order: request ``rid`` holds ``physical`` tokens of its ``logical`` ones, keeps ``kept``."""

    rid: str
    logical: int
    physical: int
    kept: int

    @property
    def evicted(self) -> int:
        return self.physical - self.kept


@dataclass(frozen=True)
class StepOrders:
    """What the worker needs this step: the compactions (their blocks are already free), each evicting request's
    offset (logical minus physical tokens) and the requests whose slot maps start afresh (preempted)."""

    compact: tuple[Compaction, ...] = ()
    offset: dict[str, int] = field(default_factory=dict)
    reset: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepReport:
    """What the scheduler learns after a step: each request's evicted slots since the last step, and the requests
    whose compaction fell back (why)."""

    evicted: dict[str, EvictedSlots] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
