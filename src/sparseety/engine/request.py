"""A request in the batched engine: its inputs, options, status and token lifecycle (as vLLM's ``Request``).

``GenerationOptions`` lives in :mod:`sparseety.options` (every door builds it) and is re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sparseety.engine.context import RunContext
from sparseety.engine.inputs import EncodedInput
from sparseety.options import GenerationOptions
from sparseety.policies.base import Policy

__all__ = ["GenerationOptions", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, prefilling its prompt, decoding, or finished."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED_STOPPED = "stop"  #: an end-of-sequence token
    FINISHED_LENGTH = "length"  #: ``max_new_tokens`` reached
    FINISHED_ABORTED = "abort"  #: cancelled (client left, server shutting down)
    FINISHED_ERROR = "error"  #: this request failed (its policy, options or a step); its neighbours go on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass
class Request:
    """One sequence in the batched engine.

    ``fed`` counts the prompt tokens already prefilled; ``output_ids`` grows by one token per step
    once the prompt is in. ``reserved_bytes`` is its worst-case KV footprint, held by the scheduler
    from admission until it finishes.
    """

    request_id: str
    encoded: EncodedInput
    policy: Policy
    options: GenerationOptions
    reserved_bytes: int
    status: RequestStatus = RequestStatus.WAITING
    ctx: RunContext | None = None
    fed: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return self.encoded.input_len

    def region_end(self) -> int:
        """Where the current prefill region ends: the context (long-document protocol), else the prompt."""
        compress = self.encoded.compress_len
        return compress if compress is not None and self.fed < compress else self.prompt_len

    def whole_region(self) -> bool:
        """True when the region must be prefilled in one forward (token pruning cuts rows inside it)."""
        return self.options.prune is not None and self.fed == 0

    def next_token_input(self) -> int:
        """The token a decode step feeds: the newest generated one."""
        return self.output_ids[-1]
