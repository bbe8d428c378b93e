"""Eviction inside vLLM's paged KV cache (``SPARSEETY_KV_POLICY``): the settings and per-request args
(:mod:`.settings`), the engine core's ledger (:mod:`.ledger`), the scheduler and worker hooks (:mod:`.hooks`), the
worker's side (:mod:`.worker`, :mod:`.slots`) and the in-place compaction (:mod:`.compaction`).

Imports :mod:`..vllm_api`-level modules and the transport (settings, values), never the observer.
"""
