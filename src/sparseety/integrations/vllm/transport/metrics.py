"""The ``sparseety:`` metric families that apply to vLLM, on vLLM's own ``/metrics``.

vLLM serves ``prometheus_client``'s default registry (without ``PROMETHEUS_MULTIPROC_DIR``), so families
registered there appear beside ``vllm:*`` with no second server. Names follow ``sparseety serve``'s.
Request, cache and draft counters carry ``engine``: vLLM's engine index (its data-parallel rank, as
vLLM's own ``engine`` label), ``unknown`` when no stat logger reported the request. With
``--api-server-count N`` vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the API servers, so
these counters live in its multiprocess files and every API server's ``/metrics`` sums all of them.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

P = "sparseety:"


class VllmMetrics:
    """Counters the observer updates (created once per process; re-creating reuses the registered ones)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", ["engine"], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens of finished requests.",
                                         ["engine"], registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       ["engine", "finish_reason"], registry=r)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "Prompt tokens whose prefill was skipped: "
                                     "their KV came from the prefix cache.", ["engine"], registry=r)
        self.kv_blocks_stored = Counter(P + "kv_blocks_stored", "KV blocks that entered the prefix cache.",
                                        ["engine"], registry=r)
        self.kv_blocks_evicted = Counter(P + "kv_blocks_evicted", "KV blocks that left the prefix cache.",
                                         ["engine"], registry=r)
        self.kv_tokens_evicted = Counter(P + "kv_tokens_evicted", "Tokens held by the KV blocks that left "
                                         "the prefix cache.", ["engine"], registry=r)
        self.preemptions = Counter(P + "preemptions", "Times a request was preempted (its KV freed).",
                                   ["engine"], registry=r)
        self.freed_tokens = Counter(P + "preempted_freed_tokens", "Tokens whose KV a preemption freed "
                                    "(prompt and output so far), summed over finished requests.", ["engine"], registry=r)
        self.recomputed_tokens = Counter(P + "preempted_recomputed_tokens", "Tokens prefilled again when a "
                                         "preempted request resumed: freed tokens the prefix cache no longer "
                                         "held (vLLM's preempted prefix-cache queries minus hits).", ["engine"], registry=r)
        self.draft_tokens = Counter(P + "draft_tokens", "Speculative draft tokens proposed.", ["engine"], registry=r)
        self.draft_accepted = Counter(P + "draft_accepted_tokens", "Speculative draft tokens accepted.",
                                      ["engine"], registry=r)
        self.draft_rejected = Counter(P + "draft_rejected_tokens", "Speculative draft tokens rejected.",
                                      ["engine"], registry=r)
        self.window_freed_blocks = Counter(P + "window_freed_blocks", "KV blocks vLLM's sliding-window groups "
                                           "freed while their requests ran (tokens that left every window).",
                                           ["engine"], registry=r)
        self.window_freed_bytes = Counter(P + "window_freed_bytes", "Bytes of the KV blocks vLLM's "
                                          "sliding-window groups freed while their requests ran.", ["engine"],
                                          registry=r)
        self.evicted_tokens = Counter(P + "evicted_tokens", "Tokens SparSEEty's eviction policies removed from "
                                      "running requests' KV inside vLLM's paged cache (per layer: a token evicted "
                                      "from every layer counts once).", ["engine", "policy"], registry=r)
        self.evicted_freed_blocks = Counter(P + "evicted_freed_blocks", "KV blocks those evictions gave back to "
                                            "vLLM's pool while their requests ran.", ["engine", "policy"], registry=r)
        self.eviction_failures = Counter(P + "eviction_failures", "Requests whose eviction inside vLLM failed once "
                                         "(they kept their newest tokens, then stopped evicting).",
                                         ["engine", "policy"], registry=r)
        self.eviction_refused = Counter(P + "eviction_refused", "Requests that asked (vllm_xargs) for an eviction "
                                        "that cannot run inside vLLM; they were served dense.", ["engine", "policy"],
                                        registry=r)
        self.trace_traced = Counter(P + "trace_records_traced", "Trace records handed to the writer.",
                                    registry=r)
        self.trace_dropped = Counter(P + "trace_records_dropped", "Trace records lost: a queue was full, "
                                     "or the record could not be built or written.", registry=r)
        self.wire_dropped = Counter(P + "wire_frames_dropped", "Frames from vLLM's engine core or worker that an "
                                    "API server dropped: an unknown kind or version, a layout that does not fit, "
                                    "or a handler that failed.", ["channel", "reason"], registry=r)
        self.kv_events_dropped = Counter(P + "kv_events_dropped", "KV-cache changes dropped because a queue "
                                         "was full, or lost on the event stream.", registry=r)


_METRICS: VllmMetrics | None = None


def metrics() -> VllmMetrics:
    """The process's metric families (registered on first use)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = VllmMetrics()
    return _METRICS
