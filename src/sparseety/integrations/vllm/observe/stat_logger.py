"""vLLM's ``vllm.stat_logger_plugins`` entry point: :class:`SparseetyStatLogger` (vLLM 0.32).

vLLM builds one per engine in the API-server process when it serves asynchronously (``vllm serve``) and
calls :meth:`record` after every engine step with the step's ``SchedulerStats`` and ``IterationStats``.
With ``--data-parallel-size N`` that is one per engine (``engine_index``: the DP rank), in every API
server (``--api-server-count``); each reports the requests of its engine that its API server owns, and
the observer records them with that engine index.
The finished requests' ``FinishedRequestStats`` (finish reason, ``num_cached_tokens``, preemptions,
queue/prefill/decode times) are joined to what the output hooks captured; the ``sparseety:`` metric
families live in the process's default Prometheus registry, which vLLM's own ``/metrics`` serves.

Its hooks are checked at import, through :func:`.adapter.check`: ``stat-logger`` (vLLM's ``StatLoggerBase``
and the config it hands on; when one is missing or changed the class stays a valid, inert stat logger and
the output hooks write the traces alone), ``finished-stats`` (``FinishedRequestStats``: without it records
are not joined to vLLM's times), ``recomputed-tokens`` (the prefix-cache stats) and ``kv-events`` (the
KV-event config); each off with one warning. vLLM's objects are read by :mod:`.adapter`
(:func:`.adapter.served_config`, :func:`.adapter.finished_stats`). Nothing here raises into vLLM: the
constructor and :meth:`record` are guarded. This module imports vLLM (the base class, through the
adapter); the rest of the package does not.
"""

from __future__ import annotations

import logging
from typing import Any

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.guards import guarded, vllm_version

log = logging.getLogger("sparseety.vllm")
StatLoggerBase = adapter.stat_logger_base()  # vLLM skips a stat-logger plugin that fails to load, and serves on
_ON = adapter.check(("stat-logger", "finished-stats", "recomputed-tokens", "kv-events"))
INTERFACE_OK = _ON["stat-logger"]  #: StatLoggerBase and the config it hands on, as expected
FINISHED_OK = _ON["finished-stats"]  #: vLLM's FinishedRequestStats, as expected (else no join: records go alone)
RECOMPUTED_OK = _ON["recomputed-tokens"]  #: vLLM's prefix-cache stats, as expected
KV_EVENTS_OK = _ON["kv-events"]  #: vLLM's KV-event config, as expected


class SparseetyStatLogger(StatLoggerBase):
    """Feeds vLLM's per-step stats to the SparSEEty observer."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *args: Any, **kwargs: Any) -> None:
        self.engine_index = engine_index
        self.observer: Any = None
        if INTERFACE_OK:
            guarded("stat-logger", self._configure, vllm_config)

    def _configure(self, vllm_config: Any) -> None:
        from sparseety.integrations.vllm.observe.observer import observer

        served = adapter.served_config(vllm_config, kv_events=KV_EVENTS_OK)
        obs = observer(client=served.api_server)
        obs.configure(model=served.model, tokenizer=served.tokenizer, model_path=served.model_path,
                      block_size=served.block_size, kv_endpoint=served.kv_endpoint,
                      data_parallel_size=served.data_parallel_size, config=served.config)
        obs.has_stat_logger = FINISHED_OK  # only once configured: else the output hooks write records alone
        self.observer = obs

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            guarded("stat-logger", self._record, scheduler_stats, iteration_stats)

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if RECOMPUTED_OK:
            recomputed = adapter.recomputed_tokens(scheduler_stats)
            if recomputed is not None:
                self.observer.on_recomputed(recomputed, self.engine_index)
        if FINISHED_OK:
            for finished in adapter.finished_stats(iteration_stats):
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
