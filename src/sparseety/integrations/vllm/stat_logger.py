"""vLLM's ``vllm.stat_logger_plugins`` entry point: :class:`SparseetyStatLogger` (vLLM 0.32).

vLLM builds one per engine in the API-server process when it serves asynchronously (``vllm serve``) and
calls :meth:`record` after every engine step with the step's ``SchedulerStats`` and ``IterationStats``.
With ``--data-parallel-size N`` that is one per engine (``engine_index``: the DP rank), in every API
server (``--api-server-count``); each reports the requests of its engine that its API server owns, and
the observer records them with that engine index.
The finished requests' ``FinishedRequestStats`` (finish reason, ``num_cached_tokens``, preemptions,
queue/prefill/decode times) are joined to what the output hooks captured; the ``sparseety:`` metric
families live in the process's default Prometheus registry, which vLLM's own ``/metrics`` serves.

The ``stat-logger`` hook checks vLLM's ``StatLoggerBase`` at import: when its ``__init__`` or ``record``
no longer take the parameters used here, the class stays a valid, inert stat logger (one warning; the
output hooks then write the traces without vLLM's timings). Nothing here raises into vLLM: the
constructor and :meth:`record` are guarded. This module imports vLLM (the base class); the rest of the
package does not.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sparseety.integrations.vllm.hooks import expect, guarded, hook_off, vllm_version

log = logging.getLogger("sparseety.vllm")

try:
    from vllm.v1.metrics.loggers import StatLoggerBase
except ImportError:  # vLLM skips a stat-logger plugin that fails to load, and serves on
    hook_off("stat-logger", "vllm.v1.metrics.loggers.StatLoggerBase")
    raise



def _interface_ok() -> bool:
    """Whether ``StatLoggerBase`` still takes what this class passes on (one warning for the first miss)."""
    for attr, params in (("__init__", ("vllm_config", "engine_index")),
                         ("record", ("scheduler_stats", "iteration_stats"))):
        if expect(StatLoggerBase, attr, params, "stat-logger", prefix=True) is None:
            return False
    return True


INTERFACE_OK = _interface_ok()


def kv_endpoint(vllm_config: Any) -> str | None:
    """The ZMQ endpoint vLLM publishes KV events on (None when it publishes none, or its config changed)."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None:
        return None
    fields = ("enable_kv_cache_events", "publisher", "endpoint")
    missing = [f for f in fields if not hasattr(kv_events, f)]
    if missing:
        hook_off("kv-events", f"{type(kv_events).__name__}.{missing[0]}")
        return None
    if kv_events.enable_kv_cache_events and kv_events.publisher == "zmq":
        return str(kv_events.endpoint)
    return None


def api_server_index(parallel_config: Any) -> int:
    """This API server's index among ``--api-server-count`` of them (vLLM's client index, which it
    routes each request's outputs by; ``ParallelConfig._api_process_rank``, 0 with one API server)."""
    index = getattr(parallel_config, "_api_process_rank", 0)
    return int(index) if isinstance(index, int) and index > 0 else 0


def served_name(model_config: Any) -> str:
    """The name clients use for the model: ``--served-model-name`` (vLLM's first one). Without it vLLM
    serves the model argument itself; when that is a local directory, the trace names the model by the
    directory's name (a Hugging Face cache snapshot by its repository id), not the whole path."""
    name = str(model_config.served_model_name or model_config.model)
    path = str(model_config.model)
    if name != path or not os.path.isdir(path):
        return name
    parts = os.path.normpath(path).split(os.sep)
    for part in parts:
        if part.startswith("models--"):  # .../hub/models--ORG--NAME/snapshots/REVISION
            return part.removeprefix("models--").replace("--", "/")
    return parts[-1] or name


class SparseetyStatLogger(StatLoggerBase):
    """Feeds vLLM's per-step stats to the SparSEEty observer."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *args: Any, **kwargs: Any) -> None:
        self.engine_index = engine_index
        self.observer: Any = None
        if INTERFACE_OK:
            guarded("stat-logger", self._configure, vllm_config)

    def _configure(self, vllm_config: Any) -> None:
        from sparseety.integrations.vllm.observer import observer

        parallel = getattr(vllm_config, "parallel_config", None)
        obs = observer(client=api_server_index(parallel))
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        spec = getattr(vllm_config, "speculative_config", None)
        obs.configure(
            model=served_name(model_config),
            tokenizer=str(getattr(model_config, "tokenizer", None) or model_config.model),
            model_path=str(model_config.model),
            block_size=cache_config.block_size if cache_config.enable_prefix_caching else None,
            kv_endpoint=kv_endpoint(vllm_config),
            data_parallel_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
            config={
                "block_size": cache_config.block_size,
                "enable_prefix_caching": bool(cache_config.enable_prefix_caching),
                "speculative_method": getattr(spec, "method", None) if spec is not None else None,
                "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
                "max_model_len": model_config.max_model_len,
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "data_parallel_size": int(getattr(parallel, "data_parallel_size", 1) or 1),
                "api_server_count": int(getattr(parallel, "_api_process_count", 1) or 1),
            },
        )
        obs.has_stat_logger = True  # only once configured: else the output hooks write records alone
        self.observer = obs

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            guarded("stat-logger", self._record, scheduler_stats, iteration_stats)

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        prefix_cache_stats = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix_cache_stats is not None:
            self.observer.on_prefix_cache_stats(prefix_cache_stats, self.engine_index)
        if iteration_stats is None:
            return
        for finished in iteration_stats.finished_requests:
            self.observer.on_finished_stats(finished, self.engine_index)

    def log_engine_initialized(self, *args: Any, **kwargs: Any) -> None:
        pass


def _fill_abstract(cls: type) -> None:
    """Make ``cls`` instantiable if vLLM added abstract methods to ``StatLoggerBase``: they do nothing."""
    names = sorted(getattr(cls, "__abstractmethods__", ()))
    if not names:
        return
    for name in names:
        setattr(cls, name, lambda self, *args, **kwargs: None)
    cls.__abstractmethods__ = frozenset()
    log.info("sparseety: vLLM %s's StatLoggerBase asks for %s; SparSEEty's stat logger does nothing there",
             vllm_version(), ", ".join(names))


_fill_abstract(SparseetyStatLogger)
