"""Observing vLLM: the hooks in the API server, the engine core and the worker (attention rows, MoE routing, window
frees, KV events, the scheduler's chunks, drafts and blocks), the consumers that gather what they send, and the
finisher that joins one request's parts into its record. Imports :mod:`..vllm_api` and :mod:`..transport`, never
:mod:`..evict`.
"""
