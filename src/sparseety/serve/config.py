"""``ServeConfig``: every setting of ``sparseety serve``, validated once at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from sparseety.config import ValidatedConfig
from sparseety.models.registry import DEFAULT_MODEL
from sparseety.options import GenerationOptions, ImportanceMode, default_of

if TYPE_CHECKING:
    from sparseety.engine import SparseEngine
    from sparseety.store.sandbox import SqlLimits


class ServeConfig(ValidatedConfig):
    """Settings of the OpenAI-compatible server.

    Attributes
    ----------
    model : built-in model name, local directory or Hugging Face id; also the name ``/v1/models`` lists.
    host, port : where uvicorn listens.
    policy, budget, ratio, policy_opts : the default KV policy (a request may override it).
    trace_dir : trace store; None turns tracing (and the trace endpoints) off.
    sample_rate : share of requests traced, chosen by a hash of the request id.
    tier : tier of sampled requests (forced requests get tier 3); the rest run at tier 1.
    top_k : important tokens per layer in traces.
    api_key : bearer key for every ``/v1`` endpoint; None leaves generation open and the trace endpoints off.
    max_concurrency : sequences decoded together in one continuous batch.
    max_queue : accepted requests waiting for a place in the batch; None means ``4 * max_concurrency``. Beyond it: 429.
    kv_memory_limit : bytes of KV cache the batch may reserve (each request reserves its worst case:
        dense ``prompt + max_tokens`` slots, an evicting policy its budget); ``"512MiB"`` works too.
    prefill_chunk : prompt tokens prefilled per step, so a long prompt never stalls running decodes
        for longer than one chunk.
    threads : torch threads of the engine loop; None chooses one fewer than the machine's cores (at
        least one), leaving a core to HTTP, tokenizing and the trace writer.
    max_tokens_limit : largest ``max_tokens`` a request may ask for (also the chat default).
    max_body_bytes : largest request body; larger bodies get 413.
    redact, ids_only : privacy of stored traces (see :mod:`sparseety.store`).
    trace_queue_size : records the trace writer buffers before it drops (and counts) new ones.
    otlp_endpoint : OTLP/HTTP endpoint spans are exported to (needs the OpenTelemetry SDK).
    prune_schedule, prune_opts : token pruning of every prompt (``"8:0.3,16:0.5"``, or ``default``).
    attention_topk : decode attends only to this many highest-scoring held slots, under any policy.
    layers : layers recording important tokens in traces: ``all``, ``auto`` or ``"0,15,29"``.
    importance, importance_weights : the important-token score (``attention``, ``value`` (the default, as from
        every door), ``output`` or ``learned``, :mod:`sparseety.extract.scoring`) and, for ``learned``, the
        head-weights file (None: the weights shipped for the model), checked at start-up.

    The generation settings are checked by :class:`~sparseety.options.GenerationOptions` (the one place
    for them), the policy among them when the server starts (:meth:`generation_options`).
    sql_timeout, sql_memory_limit, sql_threads : bounds of each trace endpoint's DuckDB reads (seconds,
        bytes or ``"256MiB"``, threads; :class:`~sparseety.store.sandbox.SqlLimits`); past one: 503.
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: StrictInt = Field(8000, ge=0, le=65535)
    policy: str = default_of("policy")
    budget: StrictInt | None = Field(None, gt=0, le=1 << 20)
    ratio: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    policy_opts: dict[str, str] = Field(default_factory=dict)
    trace_dir: Path | None = None
    sample_rate: float = Field(0.05, ge=0, le=1, allow_inf_nan=False)
    tier: StrictInt = Field(default_of("tier"), ge=1, le=3)
    top_k: StrictInt = Field(default_of("top_k"), gt=0, le=1 << 20)
    api_key: str | None = None
    max_concurrency: StrictInt = Field(8, ge=1, le=256)
    max_queue: StrictInt | None = Field(None, ge=0, le=100_000)
    kv_memory_limit: StrictInt | None = Field(None, ge=1, le=1 << 50)
    prefill_chunk: StrictInt = Field(512, ge=1, le=1 << 20)
    threads: StrictInt | None = Field(None, ge=1, le=1024)
    max_tokens_limit: StrictInt = Field(256, ge=1, le=1 << 20)
    max_body_bytes: StrictInt = Field(1 << 20, ge=256, le=1 << 30)
    redact: StrictBool = False
    ids_only: StrictBool = False
    trace_queue_size: StrictInt = Field(1024, ge=1, le=1 << 20)
    otlp_endpoint: str | None = None
    prune_schedule: str | None = None
    prune_opts: dict[str, str] = Field(default_factory=dict)
    attention_topk: StrictInt | None = Field(None, gt=0, le=1 << 20)
    layers: str = default_of("layers")
    importance: ImportanceMode = default_of("importance")
    importance_weights: Path | None = None
    sql_timeout: float = Field(10.0, gt=0, le=86_400, allow_inf_nan=False)
    sql_memory_limit: StrictInt = Field(512 << 20, ge=1 << 20, le=1 << 50)
    sql_threads: StrictInt = Field(1, ge=1, le=256)

    @field_validator("kv_memory_limit", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        from sparseety.units import parse_size

        return None if value is None else parse_size(value, "kv_memory_limit")

    @field_validator("sql_memory_limit", mode="before")
    @classmethod
    def _sql_size(cls, value: Any) -> Any:
        from sparseety.units import parse_size

        return parse_size(value, "sql_memory_limit", minimum=1 << 20)  # the field's own minimum, stated once

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.budget is not None and self.ratio is not None:
            raise ValueError("give either budget or ratio, not both")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty")
        if self.prune_opts and self.prune_schedule is None:
            raise ValueError("prune_opts need a prune_schedule")
        from sparseety.engine.layers import parse_layers

        parse_layers(self.layers)
        GenerationOptions(**self._generation_fields(policy=False))  # a refusal is a ValueError: a validation error
        return self

    def _generation_fields(self, *, policy: bool = True) -> dict[str, Any]:
        fields: dict[str, Any] = dict(
            tier=self.tier, top_k=self.top_k, layers=self.layers, importance=self.importance,
            importance_weights=self.importance_weights, attention_topk=self.attention_topk,
            prune=self.prune_schedule, prune_opts=dict(self.prune_opts), max_new_tokens=self.max_tokens_limit)
        if policy:
            fields.update(policy=self.policy, budget=self.budget, ratio=self.ratio, policy_opts=dict(self.policy_opts))
        return fields

    def generation_options(self, engine: SparseEngine | None = None) -> GenerationOptions:
        """Every request's defaults (a request body sets its policy, ``max_tokens``, tier and seed over them):
        ConfigError for a bad default policy. With ``engine``, the pruning schedule is resolved against its
        depth and ``learned`` weights are read once and checked against its model."""
        options = GenerationOptions(**self._generation_fields())
        if engine is None:
            return options
        schedule = options.prune_schedule(engine.num_layers)
        if schedule is not None:
            schedule.check_layers(engine.num_layers)
        weights: Any = self.importance_weights
        if self.importance == "learned":
            weights = engine.head_weights(self.importance_weights)
        return options.replace(prune=schedule, prune_opts={}, importance_weights=weights)

    def torch_threads(self) -> int:
        """The engine loop's torch threads (see ``threads``): :func:`sparseety.threads.choose_threads`."""
        from sparseety.threads import choose_threads

        return choose_threads(self.threads)

    @property
    def sql_limits(self) -> SqlLimits:
        """The trace endpoints' SQL bounds."""
        from sparseety.store.sandbox import SqlLimits

        return SqlLimits(memory_limit=self.sql_memory_limit, threads=self.sql_threads, timeout=self.sql_timeout,
                         server=True)

    @property
    def queue_capacity(self) -> int:
        """Admitted requests waiting for a worker before new ones get 429."""
        return 4 * self.max_concurrency if self.max_queue is None else self.max_queue
