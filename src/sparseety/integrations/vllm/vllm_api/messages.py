"""SparSEEty's own types for what the vLLM adapter reads out of vLLM's objects.

:mod:`.adapter` is the only module that touches a vLLM object; it fills these small dataclasses, and the
rest of the integration (observer, capture, stat logger) works on them. None of them holds a vLLM object.
This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FinishedRequest:
    """What the frontend (vLLM's ``OutputProcessor``) knew about one finished request, completed by the
    stat logger's ``FinishedRequestStats`` (:class:`FinishedStats`) when one reports it."""

    #: the row's id: the id the client knows (vLLM's ``external_req_id``); with ``n > 1`` each choice's own,
    #: ``<index>_<id>`` (vLLM's child id without its random tail, the id the worker samples by)
    request_id: str
    internal_id: str  #: vLLM's internal request id (the engine core's and the worker's key)
    prompt_ids: list[int]
    output_ids: list[int]
    num_cached_tokens: int
    preempted_at: list[int]  #: output tokens generated before each preemption
    per_step_drafted: list[int] | None
    per_step_accepted: list[int] | None
    num_draft_tokens: int
    num_accepted_tokens: int
    text: str = ""
    finish_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    num_preemptions: int | None = None
    engine: int | None = None  #: the engine (data-parallel rank) that served it, from its stat logger
    finished_at: float = field(default_factory=time.monotonic)
    join_id: str = ""  #: the id vLLM's ``FinishedRequestStats`` carries (``external_req_id``, shared by choices)
    choice: int | None = None  #: with ``n > 1``: which of the ``n`` choices (``None`` otherwise)


@dataclass(frozen=True)
class FinishedStats:
    """One of vLLM's ``FinishedRequestStats``: the engine's own view of a finished request."""

    request_id: str
    finish_reason: str | None
    num_cached_tokens: int
    num_preemptions: int
    timings: dict[str, float]  #: ``e2e_s``, ``queued_s``, ``prefill_s``, ``decode_s``, ``inference_s``


@dataclass(frozen=True)
class ServedConfig:
    """What the API server's ``VllmConfig`` says about the model being served (the stat logger reads it)."""

    model: str  #: the name clients use (``--served-model-name``, else the model directory's name)
    tokenizer: str  #: where vLLM loaded its tokenizer from (token texts)
    model_path: str  #: vLLM's model argument (provenance)
    block_size: int | None  #: the KV block size when prefix caching is on, else None
    kv_endpoint: str | None  #: rank 0's KV-event endpoint (None: vLLM publishes none)
    data_parallel_size: int
    api_server: int  #: this API server's index (vLLM's client index; 0 with one)
    config: dict[str, Any]  #: the settings recorded in each trace's ``params``


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer of the served model, as the worker's forward context holds it."""

    name: str  #: vLLM's layer name (``model.layers.3.self_attn.attn``)
    impl: Any  #: the backend implementation object (its class is the one the capture wraps)
    variant: str | None  #: why the capture's softmax does not fit it (soft cap, ALiBi, sinks), or None
    window: int | None = None  #: its sliding window in tokens (a query at ``p`` sees ``p - w + 1 .. p``), or None


@dataclass(frozen=True)
class ImplShape:
    """The head layout of an attention implementation (from the backend object)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV-cache groups (the engine core's ``KVCacheConfig``): layers sharing one block table."""

    group: int  #: its index in ``kv_cache_groups``
    window: int | None  #: the sliding window of its layers in tokens (None: full attention)
    block_bytes: int  #: bytes one block of the group holds over all its layers (page size x layers)
    kv_heads: int  #: KV heads per layer (0 when the spec has none)
    layers: tuple[int, ...]  #: the decoder-layer numbers of its layers (``model.layers.N...``)
