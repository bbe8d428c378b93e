"""vLLM's ``vllm.stat_logger_plugins`` entry point: :class:`SparseetyStatLogger` (vLLM 0.32).

vLLM builds one per engine in the API-server process when it serves asynchronously (``vllm serve``) and
calls :meth:`record` after every engine step with the step's ``SchedulerStats`` and ``IterationStats``.
The finished requests' ``FinishedRequestStats`` (finish reason, ``num_cached_tokens``, preemptions,
queue/prefill/decode times) are joined to what the output hooks captured; the ``sparseety:`` metric
families live in the process's default Prometheus registry, which vLLM's own ``/metrics`` serves.

This module imports vLLM (the base class); the rest of the package does not.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from sparseety.integrations.vllm.observer import observer


class SparseetyStatLogger(StatLoggerBase):
    """Feeds vLLM's per-step stats to the SparSEEty observer."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.observer = observer()
        self.observer.has_stat_logger = True
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        spec = vllm_config.speculative_config
        kv_events = vllm_config.kv_events_config
        endpoint = None
        if kv_events is not None and kv_events.enable_kv_cache_events and kv_events.publisher == "zmq":
            endpoint = kv_events.endpoint
        self.observer.configure(
            model=str(model_config.served_model_name or model_config.model),
            block_size=cache_config.block_size if cache_config.enable_prefix_caching else None,
            kv_endpoint=endpoint,
            config={
                "block_size": cache_config.block_size,
                "enable_prefix_caching": bool(cache_config.enable_prefix_caching),
                "speculative_method": getattr(spec, "method", None) if spec is not None else None,
                "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
                "max_model_len": model_config.max_model_len,
                "dtype": str(model_config.dtype).removeprefix("torch."),
            },
        )

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None and scheduler_stats.prefix_cache_stats is not None:
            self.observer.on_prefix_cache_stats(scheduler_stats.prefix_cache_stats)
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            self.observer.on_finished_stats(finished)

    def log_engine_initialized(self) -> None:
        pass
