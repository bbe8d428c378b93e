"""Every vLLM internal SparSEEty patches or reads, declared (:class:`Need`, :data:`NEEDS`, :data:`HOOKS`) and
checked at load (:func:`check`, :func:`check_class`); :func:`internals_table` is ``docs/vllm-internals.md``'s table.
Imports neither vLLM nor torch at import time."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sparseety.integrations.vllm.vllm_api.guards import hook_off


@dataclass(frozen=True)
class Need:
    """One vLLM internal a hook relies on: ``owner`` (``module:Class``, or ``module`` for a module-level
    name) has ``name``; a method when ``params`` is given (its parameters after ``self``, or the first of
    them with ``prefix``; with ``concrete`` not an abstract stub), else an attribute."""

    hook: str
    owner: str
    name: str
    params: tuple[str, ...] | None = None
    prefix: bool = False
    concrete: bool = False

    @property
    def dotted(self) -> str:
        """``module.Class.name``: how a missing attribute is named in the warning."""
        return f"{self.owner.replace(':', '.')}.{self.name}"

    def label(self) -> str:
        """How ``docs/vllm-internals.md`` names it (``Class.name(params)`` or ``Class.name``)."""
        cls = self.owner.rpartition(":")[2] or self.owner
        if self.params is None:
            return f"{cls}.{self.name}"
        return f"{cls}.{self.name}({', '.join(self.params)}{', ...' if self.prefix else ''})"


# -- the declarations --------------------------------------------------------------------------------------
OP = "vllm.v1.engine.output_processor:OutputProcessor"
RS = "vllm.v1.engine.output_processor:RequestState"
DETOK = "vllm.v1.engine.detokenizer:IncrementalDetokenizer"
SPEC = "vllm.v1.metrics.stats:RequestSpecDecodeMetrics"
SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
CORE = "vllm.v1.core"
COORD = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"
SOUT = "vllm.v1.core.sched.output:SchedulerOutput"
FULL = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
STM = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
REQ = "vllm.v1.request:Request"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
MOE_ROUTER = "vllm.model_executor.layers.fused_moe.router.fused_moe_router:FusedMoERouter"
MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner"
STATS = "vllm.v1.metrics.stats"
CONFIG = "vllm.config"
INPUT = "vllm.v1.engine.input_processor:InputProcessor"
APP = "vllm.entrypoints.launchers.app"
IMPL = "attention backend impl (found at the first forward)"  #: the owner of :data:`IMPL_NEEDS`
FORWARD_PARAMS = ("layer", "query", "key", "value", "kv_cache", "attn_metadata")


def _attrs(hook: str, owner: str, *names: str) -> tuple[Need, ...]:
    return tuple(Need(hook, owner, name) for name in names)


NEEDS: tuple[Need, ...] = (
    # ranks first: the engine-core hooks route by it
    Need("ranks", REQ, "__init__", ("request_id", "prompt_token_ids", "sampling_params", "pooling_params",
                                    "client_index"), prefix=True),
    *_attrs("ranks", REQ, "client_index"),
    *_attrs("ranks", SOUT, "scheduled_new_reqs"),
    *_attrs("ranks", "vllm.v1.core.sched.output:NewRequestData", "req_id"),
    *_attrs("ranks", f"{CONFIG}:ParallelConfig", "_api_process_rank", "_api_process_count", "data_parallel_size"),
    Need("prefill-chunks", SCHED, "_update_after_schedule", ("scheduler_output",)),
    *_attrs("prefill-chunks", SCHED, "requests"),
    *_attrs("prefill-chunks", SOUT, "num_scheduled_tokens"),
    *_attrs("prefill-chunks", REQ, "num_computed_tokens", "num_prompt_tokens"),
    Need("drafts", SCHED, "update_from_output", ("scheduler_output", "model_runner_output"), concrete=True),
    *_attrs("drafts", SCHED, "requests", "num_sampled_tokens_per_step"),
    *_attrs("drafts", SOUT, "scheduled_spec_decode_tokens"),
    *_attrs("drafts", "vllm.v1.outputs:ModelRunnerOutput", "sampled_token_ids", "req_id_to_index"),
    *_attrs("drafts", REQ, "num_tokens", "num_output_tokens", "is_finished", "num_stale_output_tokens",
            "drop_stale_output"),
    Need("kv-blocks", SCHED, "_free_request_blocks", ("request",), concrete=True),
    *_attrs("kv-blocks", SCHED, "kv_cache_config", "kv_cache_manager"),
    Need("kv-blocks", "vllm.v1.core.kv_cache_manager:KVCacheManager", "get_block_ids", ("request_id",)),
    *_attrs("kv-blocks", "vllm.v1.kv_cache_interface:KVCacheConfig", "kv_cache_groups"),
    *_attrs("kv-blocks", "vllm.v1.kv_cache_interface:KVCacheGroupSpec", "kv_cache_spec", "layer_names"),
    *_attrs("kv-blocks", "vllm.v1.kv_cache_interface:KVCacheSpec", "page_size_bytes"),
    *_attrs("kv-blocks", REQ, "request_id"),
    *_attrs("kv-blocks", "vllm.v1.core.kv_cache_manager:KVCacheManager", "block_pool"),
    *_attrs("kv-blocks", "vllm.v1.core.block_pool:BlockPool", "null_block"),
    *_attrs("kv-blocks", "vllm.v1.core.kv_cache_utils:KVCacheBlock", "block_id"),
    Need("window-frees", COORD, "remove_skipped_blocks", ("request_id", "processed_computed_tokens"), prefix=True),
    *_attrs("window-frees", "vllm.v1.core.kv_cache_manager:KVCacheManager", "coordinator"),
    *_attrs("window-frees", COORD, "single_type_managers", "kv_cache_config"),
    *_attrs("window-frees", f"{CORE}.single_type_kv_cache_manager:SingleTypeKVCacheManager", "req_to_blocks",
            "_null_block"),
    *_attrs("window-frees", "vllm.v1.kv_cache_interface:KVCacheConfig", "kv_cache_groups"),
    *_attrs("window-frees", "vllm.v1.kv_cache_interface:KVCacheGroupSpec", "kv_cache_spec", "layer_names"),
    *_attrs("window-frees", "vllm.v1.kv_cache_interface:KVCacheSpec", "page_size_bytes"),
    *_attrs("window-frees", "vllm.v1.kv_cache_interface:SlidingWindowSpec", "sliding_window"),
    *_attrs("window-frees", "vllm.v1.kv_cache_interface:AttentionSpec", "num_kv_heads"),
    Need("preemptions", OP, "_update_stats_from_output",
         ("req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats")),
    *_attrs("preemptions", "vllm.v1.engine:EngineCoreEventType", "PREEMPTED"),
    *_attrs("preemptions", "vllm.v1.engine:EngineCoreOutput", "events"),
    *_attrs("preemptions", "vllm.v1.engine:EngineCoreEvent", "type"),
    *_attrs("preemptions", RS, "detokenizer"),
    *_attrs("preemptions", DETOK, "num_output_tokens"),
    Need("finished-requests", OP, "_update_stats_from_finished", ("req_state", "finish_reason", "iteration_stats")),
    *_attrs("finished-requests", RS, "external_req_id", "request_id", "prompt_token_ids", "num_cached_tokens",
            "detokenizer", "spec_decode_metrics", "parent_req"),
    Need("aborted-requests", OP, "abort_requests", ("request_ids", "internal")),
    *_attrs("aborted-requests", OP, "request_states", "external_req_ids"),
    *_attrs("aborted-requests", RS, "stats"),
    *_attrs("aborted-requests", f"{STATS}:RequestStateStats", "num_preemptions", "arrival_time", "queued_ts",
            "scheduled_ts", "first_token_ts", "last_token_ts"),
    *_attrs("finished-requests", DETOK, "output_token_ids"),
    *_attrs("finished-requests", SPEC, "per_step_drafted", "per_step_accepted", "num_draft_tokens", "histogram"),
    Need("importance-rows", RUNNER, "_model_forward",
         ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"), prefix=True),
    *_attrs("importance-rows", RUNNER, "input_batch", "query_start_loc", "requests", "cache_config", "model",
            "model_config"),
    *_attrs("importance-rows", "vllm.v1.worker.gpu_input_batch:InputBatch", "req_ids", "num_reqs"),
    *_attrs("importance-rows", "vllm.v1.utils:CpuGpuBuffer", "np"),
    *_attrs("importance-rows", "vllm.v1.worker.gpu_input_batch:CachedRequestState", "num_prompt_tokens",
            "sampling_params", "prompt_token_ids"),
    *_attrs("importance-rows", "vllm.sampling_params:SamplingParams", "extra_args"),
    *_attrs("importance-rows", f"{CONFIG}:CacheConfig", "block_size"),
    *_attrs("importance-rows", f"{CONFIG}:ModelConfig", "model"),
    Need("importance-finish", RUNNER, "_on_request_state_removed", ("req_id", "req_state")),
    *_attrs("importance-attention", "vllm.forward_context", "get_forward_context"),
    *_attrs("importance-attention", "vllm.forward_context:ForwardContext", "no_compile_layers"),
    *_attrs("importance-attention", "vllm.model_executor.layers.attention.attention:Attention", "layer_name",
            "sliding_window"),
    *_attrs("importance-attention", "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase", "impl"),
    *_attrs("importance-attention", "vllm.distributed.parallel_state", "get_pp_group",
            "get_tensor_model_parallel_world_size"),
    *_attrs("importance-attention", "vllm.distributed.parallel_state:GroupCoordinator", "world_size"),
    Need("moe-routing", MOE_ROUTER, "select_experts", ("hidden_states", "router_logits", "topk_indices_dtype"),
         prefix=True, concrete=True),
    *_attrs("moe-routing", MOE_RUNNER, "router", "layer_name"),
    Need("moe-routing", RUNNER, "_model_forward", ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
         prefix=True),
    Need("moe-routing", RUNNER, "_on_request_state_removed", ("req_id", "req_state")),
    *_attrs("moe-routing", RUNNER, "input_batch", "query_start_loc", "requests", "model"),
    *_attrs("moe-routing", "vllm.v1.worker.gpu_input_batch:InputBatch", "req_ids", "num_reqs"),
    *_attrs("moe-routing", "vllm.v1.utils:CpuGpuBuffer", "np"),
    *_attrs("moe-routing", "vllm.v1.worker.gpu_input_batch:CachedRequestState", "num_prompt_tokens",
            "sampling_params"),
    *_attrs("moe-routing", "vllm.sampling_params:SamplingParams", "extra_args"),
    Need("stat-logger", "vllm.v1.metrics.loggers:StatLoggerBase", "__init__", ("vllm_config", "engine_index"),
         prefix=True),
    Need("stat-logger", "vllm.v1.metrics.loggers:StatLoggerBase", "record", ("scheduler_stats", "iteration_stats"),
         prefix=True),
    *_attrs("stat-logger", f"{CONFIG}:VllmConfig", "model_config", "cache_config", "speculative_config",
            "parallel_config"),
    *_attrs("stat-logger", f"{CONFIG}:ModelConfig", "served_model_name", "model", "tokenizer", "max_model_len",
            "dtype"),
    *_attrs("stat-logger", f"{CONFIG}:CacheConfig", "block_size", "enable_prefix_caching"),
    *_attrs("stat-logger", f"{CONFIG}:SpeculativeConfig", "method", "num_speculative_tokens"),
    *_attrs("finished-stats", f"{STATS}:IterationStats", "finished_requests"),
    *_attrs("finished-stats", f"{STATS}:FinishedRequestStats", "request_id", "finish_reason", "num_cached_tokens",
            "num_preemptions", "e2e_latency", "queued_time", "prefill_time", "decode_time", "inference_time"),
    *_attrs("recomputed-tokens", f"{STATS}:SchedulerStats", "prefix_cache_stats"),
    *_attrs("recomputed-tokens", f"{STATS}:PrefixCacheStats", "preempted_queries", "preempted_hits"),
    *_attrs("kv-events", f"{CONFIG}:VllmConfig", "kv_events_config"),
    *_attrs("kv-events", f"{CONFIG}:KVEventsConfig", "enable_kv_cache_events", "publisher", "endpoint"),
    Need("kv-eviction", SCHED, "__init__", ("vllm_config", "kv_cache_config"), prefix=True, concrete=True),
    Need("kv-eviction", SCHED, "schedule", (), prefix=True, concrete=True),
    Need("kv-eviction", SCHED, "add_request", ("request",), concrete=True),
    Need("kv-eviction", SCHED, "_free_request_blocks", ("request",), concrete=True),
    Need("kv-eviction", SCHED, "update_from_output", ("scheduler_output", "model_runner_output"), concrete=True),
    *_attrs("kv-eviction", SCHED, "running", "kv_cache_manager", "kv_cache_config", "vllm_config"),
    Need("kv-eviction", STM, "get_num_blocks_to_allocate", ("request_id", "num_tokens"), prefix=True),
    Need("kv-eviction", STM, "allocate_new_blocks", ("request_id", "num_tokens"), prefix=True),
    Need("kv-eviction", COORD, "cache_blocks", ("request", "num_computed_tokens")),
    *_attrs("kv-eviction", "vllm.v1.core.kv_cache_manager:KVCacheManager", "coordinator"),
    *_attrs("kv-eviction", COORD, "single_type_managers"),
    *_attrs("kv-eviction", f"{CORE}.single_type_kv_cache_manager:SingleTypeKVCacheManager", "req_to_blocks",
            "block_pool", "block_size"),
    Need("kv-eviction", "vllm.v1.core.block_pool:BlockPool", "free_blocks", ("ordered_blocks",)),
    *_attrs("kv-eviction", REQ, "request_id", "num_computed_tokens", "num_prompt_tokens",
            "skip_reading_prefix_cache", "is_finished", "sampling_params"),
    *_attrs("kv-eviction", "vllm.sampling_params:SamplingParams", "extra_args"),
    *_attrs("kv-eviction", "vllm.v1.kv_cache_interface:KVCacheConfig", "kv_cache_groups"),
    *_attrs("kv-eviction", "vllm.v1.kv_cache_interface:KVCacheGroupSpec", "kv_cache_spec", "layer_names"),
    *_attrs("kv-eviction", "vllm.v1.kv_cache_interface:KVCacheSpec", "block_size"),
    *_attrs("kv-eviction", f"{CONFIG}:VllmConfig", "speculative_config", "scheduler_config", "parallel_config",
            "model_config"),
    *_attrs("kv-eviction", f"{CONFIG}:ModelConfig", "model"),
    *_attrs("kv-eviction", f"{CONFIG}:SchedulerConfig", "async_scheduling"),
    *_attrs("kv-eviction", SOUT, "num_scheduled_tokens", "finished_req_ids"),
    Need("kv-eviction-worker", RUNNER, "_update_states", ("scheduler_output",)),
    Need("kv-eviction-worker", RUNNER, "_prepare_inputs", ("scheduler_output", "num_scheduled_tokens")),
    Need("kv-eviction-worker", RUNNER, "sample_tokens", ("grammar_output",)),
    *_attrs("kv-eviction-worker", "vllm.v1.outputs:ModelRunnerOutput", "req_ids"),
    Need("kv-eviction-worker", RUNNER, "_model_forward",
         ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"), prefix=True),
    *_attrs("kv-eviction-worker", "vllm.forward_context", "get_forward_context"),
    *_attrs("kv-eviction-worker", RUNNER, "requests", "input_batch", "seq_lens", "optimistic_seq_lens_cpu",
            "positions", "query_start_loc", "kv_cache_config", "compilation_config", "model", "model_config"),
    *_attrs("kv-eviction-worker", "vllm.v1.worker.gpu_input_batch:InputBatch", "req_id_to_index", "block_table",
            "req_ids", "num_reqs"),
    *_attrs("kv-eviction-worker", "vllm.v1.worker.block_table:MultiGroupBlockTable", "block_tables"),
    *_attrs("kv-eviction-worker", "vllm.v1.worker.block_table:BlockTable", "block_table", "num_blocks_per_row",
            "slot_mapping", "block_size"),
    *_attrs("kv-eviction-worker", "vllm.v1.utils:CpuGpuBuffer", "np", "gpu"),
    *_attrs("kv-eviction-worker", "vllm.v1.worker.gpu_input_batch:CachedRequestState", "block_ids",
            "num_prompt_tokens", "sampling_params"),
    *_attrs("kv-eviction-worker", f"{CONFIG}:CompilationConfig", "static_forward_context"),
    *_attrs("kv-eviction-worker", "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase", "kv_cache",
            "impl"),
    *_attrs("kv-eviction-worker", "vllm._custom_ops", "cpu_attn_reshape_and_cache"),
    Need("request-args", INPUT, "_validate_params", ("params", "supported_tasks")),
    *_attrs("request-args", "vllm.sampling_params:SamplingParams", "extra_args"),
    *_attrs("request-args", "vllm.exceptions", "VLLMValidationError"),
    Need("request-args-json", APP, "init_entrypoints_middleware", ("args", "app", "supported_tasks")),
    *_attrs("request-args-json", "starlette.applications:Starlette", "user_middleware"),
    *_attrs("request-args-json", "starlette.middleware", "Middleware"),
)

IMPL_NEEDS: tuple[Need, ...] = (
    Need("importance-attention", IMPL, "forward", FORWARD_PARAMS, prefix=True, concrete=True),
    *_attrs("importance-attention", IMPL, "num_heads", "num_kv_heads", "head_size", "scale", "logits_soft_cap",
            "alibi_slopes", "sinks"),
)

#: hook -> (process it runs in, what is lost while it is off)
HOOKS: dict[str, tuple[str, str]] = {
    "ranks": ("engine core, API server", "every engine-core record goes to API server 0, as with one API "
              "server: with `--api-server-count > 1` the other API servers' requests lack prefill chunks, draft "
              "ids, KV bytes and important tokens"),
    "prefill-chunks": ("engine core", "no `prefill_chunk` events"),
    "drafts": ("engine core", "draft rows from vLLM's per-request counts only: `position` and `token_id` -1, no "
               "rejected-draft marks in the report"),
    "kv-blocks": ("engine core", "`kv_cache_bytes_peak` is None; the report says \"not reported\"; goes with "
                  "`window-frees`"),
    "window-frees": ("engine core", "no `window` rows, no window-freed blocks or bytes (`extra_json.vllm.window`, "
                     "`sparseety:window_freed_*`), and `kv_cache_bytes_peak` is the blocks held when the request "
                     "ended rather than its peak"),
    "preemptions": ("API server", "no `preempted_at_output_tokens` or `recomputed` events (vLLM's preemption "
                    "count still comes from the stat logger)"),
    "finished-requests": ("API server", "no per-request records or token metrics"),
    "aborted-requests": ("API server", "a request aborted by its client (or vLLM) leaves no record"),
    "importance-rows": ("worker", "no important tokens for vLLM requests (`extra_json.vllm.importance.status` "
                        "is `not_sampled`); goes with `importance-finish` and `importance-attention`"),
    "importance-finish": ("worker", "as `importance-rows`"),
    "importance-attention": ("worker", "as `importance-rows`; a backend class whose own needs are missing "
                             "records no importance for its layers"),
    "moe-routing": ("worker", "no expert routing of MoE models: no `sparseety:moe_expert_tokens_total` or "
                    "`sparseety:moe_load_imbalance`, no `extra_json.vllm.moe`, no `router.N` / `route.*` arrays"),
    "stat-logger": ("API server", "an inert stat logger: the output hooks write the records alone, without "
                    "vLLM's timings, the served model's name or KV events; no `preempted_recomputed_tokens`"),
    "finished-stats": ("API server", "the output hooks write the records alone, without vLLM's timings and "
                       "engine index"),
    "recomputed-tokens": ("API server", "no `sparseety:preempted_recomputed_tokens`"),
    "kv-events": ("API server", "no prefix-cache blocks (`SPARSEETY_KV_EVENTS=ENDPOINT` still subscribes)"),
    "kv-eviction": ("engine core", "`SPARSEETY_KV_POLICY` is not applied: every request runs dense, with one "
                    "warning; goes with `kv-eviction-worker`"),
    "kv-eviction-worker": ("worker", "as `kv-eviction`"),
    "request-args": ("API server", "a bad `sparseety_*` request arg is not refused with HTTP 400: the engine core "
                     "serves that request dense, with one warning, counted and recorded"),
    "request-args-json": ("API server", "JSON `true` in a number's place of `vllm_xargs` reads as 1 (vLLM's schema "
                          "turns it into one); other bad args are still refused by `request-args`"),
}


def needs_of(hook: str) -> tuple[Need, ...]:
    """The needs of ``hook`` checked at load, in order (the first missing one is named)."""
    return tuple(n for n in NEEDS if n.hook == hook)


# -- checking ----------------------------------------------------------------------------------------------
def resolve(owner: str) -> Any:
    """The class or module ``owner`` names (``module:Class`` or ``module``), or None when it is gone."""
    module_name, _, cls = owner.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    return getattr(module, cls, None) if cls else module


@functools.lru_cache(maxsize=256)
def _assigned(cls: type) -> frozenset[str]:
    """The names ``cls``'s own methods assign as ``self.<name>`` (from its source; empty without one)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return frozenset(names)


def has_attribute(cls: Any, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, property, method, field, slot or
    annotation anywhere in its MRO, or a ``self.<name> = ...`` in one of its classes' methods."""
    if not isinstance(cls, type):
        return hasattr(cls, name)  # a module (or another object): what it holds now
    mro = [k for k in cls.__mro__ if k is not object]
    for klass in mro:
        space = vars(klass)
        if name in space:
            return True
        for key in ("__annotations__", "__struct_fields__", "__dataclass_fields__", "__slots__"):
            held = space.get(key)  # the class's own (a base's may be a descriptor, e.g. msgspec.Struct's)
            held = (held,) if isinstance(held, str) else held
            if isinstance(held, (dict, tuple, list, frozenset, set)) and name in held:
                return True
    return any(name in _assigned(klass) for klass in mro)


def _method_problem(owner: Any, need: Need) -> str | None:
    """Why ``owner.<need.name>`` is not the method ``need`` describes (None when it is)."""
    fn = inspect.getattr_static(owner, need.name, None)
    want = f"{owner.__name__}.{need.name}({', '.join(need.params or ())}{', ...' if need.prefix else ''})"
    if not inspect.isfunction(fn) or (need.concrete and getattr(fn, "__isabstractmethod__", False)):
        return want
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return f"{want} (it has no signature)"
    names = tuple(signature.parameters)[0 if inspect.ismodule(owner) else 1:]  # a method's ``self`` left out
    params = need.params or ()
    found = names[: len(params)] if need.prefix else names
    return None if found == params else f"{want} (it has {need.name}{signature})"


def problem(need: Need, owner: Any = None, *, lookup: Callable[[str], Any] = resolve) -> str | None:
    """What is missing for ``need`` (None when nothing is): the owner, the method or the attribute.
    ``owner``: the class to look at (else ``lookup(need.owner)``)."""
    owner = owner if owner is not None else lookup(need.owner)
    if owner is None:
        return need.owner.replace(":", ".")
    if need.params is not None:
        return _method_problem(owner, need)
    if has_attribute(owner, need.name):
        return None
    return need.dotted if need.owner != IMPL else f"{getattr(owner, '__name__', type(owner).__name__)}.{need.name}"


def check(hooks: Iterable[str] | None = None, *, loud: bool = True,
          lookup: Callable[[str], Any] = resolve) -> dict[str, bool]:
    """``hook -> on`` for ``hooks`` (default: all): a hook with a missing need is off, with one warning
    naming it and the first missing need (at debug level when not ``loud``)."""
    result = {}
    for hook in hooks if hooks is not None else HOOKS:
        missing = next((p for p in (problem(n, lookup=lookup) for n in needs_of(hook)) if p), None)
        if missing is not None:
            hook_off(hook, missing, loud=loud)
        result[hook] = missing is None
    return result


def check_class(cls: type, needs: Iterable[Need] = IMPL_NEEDS, *, loud: bool = True) -> bool:
    """Whether ``cls`` (found at run time, e.g. the attention backend) has ``needs``; one warning if not."""
    for need in needs:
        missing = problem(need, cls)
        if missing is not None:
            hook_off(need.hook, missing, loud=loud)
            return False
    return True


def internals_table() -> str:
    """The table of ``docs/vllm-internals.md``: per hook, where it runs, what it patches and reads, and
    what is lost while it is off (generated from :data:`NEEDS` and :data:`IMPL_NEEDS`)."""
    lines = ["| Hook | Runs in | Methods (patched or called; name and parameters checked) | Attributes read at run "
             "time (checked) | Off means |", "|---|---|---|---|---|"]
    for hook, (where, off) in HOOKS.items():
        needs = [n for n in (*NEEDS, *IMPL_NEEDS) if n.hook == hook]
        patched = [f"`{n.label()}`" for n in needs if n.params is not None]
        read: dict[str, list[str]] = {}
        for n in needs:
            if n.params is None:
                read.setdefault(n.owner.rpartition(":")[2] or n.owner, []).append(f"`{n.name}`")
        reads = "; ".join(f"{owner}: {', '.join(names)}" for owner, names in read.items())
        lines.append(f"| `{hook}` | {where} | {', '.join(patched) or '-'} | {reads or '-'} | {off} |")
    owners = sorted({n.owner for n in NEEDS}, key=lambda o: (o.rpartition(":")[2] or o).lower())
    lines += ["", f"{len(NEEDS) + len(IMPL_NEEDS)} needs ({sum(n.params is not None for n in (*NEEDS, *IMPL_NEEDS))} "
              "methods), by class or module:", ""]
    lines += [f"- `{o.rpartition(':')[2]}`: `{o.replace(':', '.')}`" if ":" in o else f"- `{o}` (module)"
              for o in owners]
    lines.append(f"- `{IMPL}`: the class of each attention layer's `impl` (`CPUAttentionBackendImpl` on CPU)")
    return "\n".join(lines)
