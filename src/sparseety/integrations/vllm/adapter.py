"""The one module that touches vLLM's objects: what SparSEEty patches and reads, declared and checked at load.

Every method SparSEEty wraps and every attribute it reads at run time is a :class:`Need` of one hook in
:data:`NEEDS`. :func:`check` looks each one up on vLLM's real classes when the plugin loads (a method: it
exists, with the parameters the hook was written for; an attribute: the class has it as a class attribute,
property, dataclass / msgspec / pydantic field, slot or annotation, or one of its methods assigns
``self.<name>``, read from the class's source), and turns a hook whose need is missing off with one
warning naming the hook and the missing name; the other hooks stay on and vLLM serves on. The attention
backend's class is known only at the first forward; its needs (:data:`IMPL_NEEDS`) are checked then
(:func:`check_class`). ``docs/vllm-internals.md``'s table is :func:`internals_table` (a test keeps them equal).

The readers below turn vLLM's objects into SparSEEty's own types (:mod:`.messages`, plain lists for what
goes over a channel); the rest of the integration never reads a vLLM object. :func:`patch` installs a
wrapper (marked with :data:`.hooks.MARK`). This module imports neither vLLM nor torch at import time.

A new hook (a sliding-window free in the hybrid KV cache manager's ``SingleTypeKVCacheManager``, the MoE
router's ``set_capture_fn``, a KV-cache spec from the spec registry, a scheduler class) is: its name and
what is lost without it in :data:`HOOKS`, its methods and attributes as :class:`Need` s in :data:`NEEDS`
(or checked with :func:`check_class` when its class is found at run time), a reader here that returns
SparSEEty's own type, and its :func:`patch` where the plugin installs hooks. The never-down test and the
internals page then cover it without further work.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sparseety.integrations.vllm.hooks import MARK, hook_off
from sparseety.integrations.vllm.messages import (
    AttentionLayer,
    FinishedRequest,
    FinishedStats,
    ImplShape,
    KVGroup,
    ServedConfig,
)


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


# -- patching ----------------------------------------------------------------------------------------------
def installed(owner: Any, attr: str, hook: str | None = None) -> bool:
    """Whether ``owner.attr`` is already one of SparSEEty's wrappers (vLLM may load a plugin twice); with
    ``hook``, whether that hook's wrapper is among the wrappers stacked there (two hooks may wrap one method)."""
    fn = inspect.getattr_static(owner, attr, None)
    if hook is None:
        return getattr(fn, MARK, None) is not None
    while fn is not None and getattr(fn, MARK, None) is not None:
        if getattr(fn, MARK) == hook:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def patch(owner: Any, attr: str, hook: str, make: Callable[[Callable], Callable]) -> bool:
    """Put ``make(original)`` in place of ``owner.attr`` (a wrapper that passes vLLM's call through to
    ``original`` unchanged), marked as ``hook``'s; False when it is there already (another hook's wrapper
    there is wrapped in turn)."""
    if installed(owner, attr, hook):
        return False
    original = inspect.getattr_static(owner, attr)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARK, hook)
    setattr(owner, attr, wrapper)
    return True


def arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """Parameter ``name`` (the ``index``-th after ``self``) of a call vLLM made."""
    return args[index] if len(args) > index else kwargs.get(name, default)


# -- API server: the frontend's output loop ---------------------------------------------------------------
_PREEMPTED = "_sparseety_preempted"  #: the marks SparSEEty keeps on a vLLM RequestState


def is_preemption(event: Any, preempted: Any) -> bool:
    return event.type == preempted


def output_events(engine_core_output: Any) -> Any:
    """The events of one ``EngineCoreOutput`` (None for most steps)."""
    return getattr(engine_core_output, "events", None)


def preempted_type() -> Any:
    from vllm.v1.engine import EngineCoreEventType

    return EngineCoreEventType.PREEMPTED


def mark_preempted(req_state: Any) -> None:
    """Note on ``req_state`` how many output tokens it had when vLLM preempted it."""
    detok = req_state.detokenizer
    marks = getattr(req_state, _PREEMPTED, None)
    if marks is None:
        marks = []
        setattr(req_state, _PREEMPTED, marks)
    marks.append(detok.num_output_tokens() if detok is not None else 0)


def finished_request(req_state: Any, finish_reason: Any) -> FinishedRequest:
    """What the frontend's ``RequestState`` knows of a finished request."""
    from sparseety.integrations.vllm.attention_capture import external_id

    detok = req_state.detokenizer
    spec = req_state.spec_decode_metrics
    choice = None
    row_id = req_state.external_req_id
    if req_state.parent_req is not None:  # one of n > 1 choices: vLLM's child id is ``<index>_<parent id>``
        row_id = external_id(req_state.request_id)
        head = row_id.partition("_")[0]
        choice = int(head) if head.isdigit() else None
    return FinishedRequest(
        request_id=row_id,
        join_id=req_state.external_req_id,
        choice=choice,
        internal_id=req_state.request_id,
        prompt_ids=list(req_state.prompt_token_ids or ()),
        output_ids=list(detok.output_token_ids) if detok is not None else [],
        text=getattr(detok, "output_text", "") or "",  # only a detokenizing request has text
        num_cached_tokens=int(req_state.num_cached_tokens or 0),
        preempted_at=list(getattr(req_state, _PREEMPTED, ())),
        per_step_drafted=list(spec.per_step_drafted) if spec is not None and spec.per_step_drafted else None,
        per_step_accepted=list(spec.per_step_accepted) if spec is not None and spec.per_step_accepted else None,
        num_draft_tokens=int(spec.num_draft_tokens) if spec is not None else 0,
        num_accepted_tokens=sum(j * c for j, c in enumerate(spec.histogram)) if spec is not None else 0,
        finish_reason=reason(finish_reason),
    )


def aborting(output_processor: Any, request_ids: Any) -> list[Any]:
    """The ``RequestState`` s that ``abort_requests(request_ids)`` is about to drop: by internal id, or every
    request of an external id (a parent of ``n > 1`` choices aborts its children through a call of its own)."""
    states = output_processor.request_states
    found = []
    for rid in request_ids:
        if rid in states:
            found.append(states[rid])
        else:
            found += [states[i] for i in output_processor.external_req_ids.get(rid, ()) if i in states]
    return found


def reason(finish_reason: Any) -> str | None:
    """vLLM's finish reason (an enum or a string) as lower-case text."""
    if finish_reason is None:
        return None
    return finish_reason.name.lower() if hasattr(finish_reason, "name") else str(finish_reason).lower()


# -- API server: the stat logger ---------------------------------------------------------------------------
def stat_logger_base() -> type:
    """vLLM's ``StatLoggerBase`` (ImportError, after one warning, when it is gone)."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        hook_off("stat-logger", "vllm.v1.metrics.loggers.StatLoggerBase")
        raise
    return StatLoggerBase


def finished_stats(iteration_stats: Any) -> list[FinishedStats]:
    """The requests one engine step finished, as vLLM's ``FinishedRequestStats`` tell them."""
    if iteration_stats is None:
        return []
    return [FinishedStats(request_id=f.request_id, finish_reason=reason(f.finish_reason),
                          num_cached_tokens=int(f.num_cached_tokens), num_preemptions=int(f.num_preemptions),
                          timings={"e2e_s": float(f.e2e_latency), "queued_s": float(f.queued_time),
                                   "prefill_s": float(f.prefill_time), "decode_s": float(f.decode_time),
                                   "inference_s": float(f.inference_time)})
            for f in iteration_stats.finished_requests]


def recomputed_tokens(scheduler_stats: Any) -> int | None:
    """Prompt tokens resumed (preempted) requests prefilled again in this step (None: no cache stats)."""
    stats = getattr(scheduler_stats, "prefix_cache_stats", None)
    if stats is None:
        return None
    return int(stats.preempted_queries) - int(stats.preempted_hits)


def kv_endpoint(vllm_config: Any) -> str | None:
    """The ZMQ endpoint vLLM publishes KV events on (None when it publishes none, or its config changed)."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None:
        return None
    missing = [f for f in ("enable_kv_cache_events", "publisher", "endpoint") if not hasattr(kv_events, f)]
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


def served_config(vllm_config: Any, *, kv_events: bool = True) -> ServedConfig:
    """What the stat logger records about the served model (``kv_events``: read the KV-event endpoint)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    spec = getattr(vllm_config, "speculative_config", None)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    return ServedConfig(
        model=served_name(model_config),
        tokenizer=str(getattr(model_config, "tokenizer", None) or model_config.model),
        model_path=str(model_config.model),
        block_size=cache_config.block_size if cache_config.enable_prefix_caching else None,
        kv_endpoint=kv_endpoint(vllm_config) if kv_events else None,
        data_parallel_size=dp,
        api_server=api_server_index(parallel),
        config={
            "block_size": cache_config.block_size,
            "enable_prefix_caching": bool(cache_config.enable_prefix_caching),
            "speculative_method": getattr(spec, "method", None) if spec is not None else None,
            "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
            "max_model_len": model_config.max_model_len,
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "data_parallel_size": dp,
            "api_server_count": int(getattr(parallel, "_api_process_count", 1) or 1),
        },
    )


# -- engine core: the scheduler ----------------------------------------------------------------------------
def prefill_chunks(scheduler: Any, scheduler_output: Any) -> list[list]:
    """``[request id, first position, tokens]`` per prompt chunk this step schedules (read before vLLM
    advances ``num_computed_tokens``)."""
    chunks = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:
            chunks.append([req_id, start, min(n, request.num_prompt_tokens - start)])
    return chunks


def owners_of(scheduler: Any, scheduler_output: Any, route: bool) -> list[list]:
    """``[request id, client index]`` for the newly scheduled requests that an API server other than 0
    owns (none with one API server: one attribute read per new request)."""
    owners = []
    for new in scheduler_output.scheduled_new_reqs:
        client = client_of(scheduler.requests.get(new.req_id), route)
        if client > 0:
            owners.append([new.req_id, client])
    return owners


def client_of(request: Any, route: bool = True) -> int:
    """The API server (client index) that owns ``request``: where vLLM sends its outputs (0 when
    ``route`` is off: the ``ranks`` hook)."""
    return int(getattr(request, "client_index", 0) or 0) if route else 0


def scheduler_requests(scheduler: Any) -> Any:
    """The scheduler's ``request id -> Request``."""
    return scheduler.requests


def request_id(request: Any) -> str:
    return request.request_id


def has_drafts(scheduler_output: Any) -> bool:
    """Whether this step verifies speculative drafts (one dict check)."""
    return bool(scheduler_output.scheduled_spec_decode_tokens)


def drafts_of(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> list[list]:
    """``[request id, step, first position, draft ids, accepted]`` for each request that verified drafts in
    this step, read before vLLM's ``update_from_output`` appends the step's tokens.

    The drafts follow the request's last token: the first one stands at position ``request.num_tokens``
    (prompt plus output so far), ``step`` is the number of output tokens before this step (a decode
    step's index, as in SparSEEty's own engine). The target model accepted the first ``accepted`` drafts
    (its sampled ids minus the one token it samples itself), the rule vLLM's bookkeeping uses; requests
    vLLM skips there (finished, aborted, stale after a preemption, no sampled ids) are skipped here too.
    """
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return []
    sampled = model_runner_output.sampled_token_ids
    if not sampled:
        return []
    index = model_runner_output.req_id_to_index
    per_step = getattr(scheduler, "num_sampled_tokens_per_step", 1)
    records = []
    for req_id, draft_ids in spec.items():
        request = scheduler.requests.get(req_id)
        if not draft_ids or request is None or request.is_finished():
            continue
        if getattr(request, "num_stale_output_tokens", 0) > 0 and getattr(request, "drop_stale_output", False):
            continue
        row = index.get(req_id)
        if row is None or row >= len(sampled) or not len(sampled[row]):
            continue
        accepted = max(len(sampled[row]) - per_step, 0)
        records.append([req_id, int(request.num_output_tokens), int(request.num_tokens),
                        [int(t) for t in draft_ids], int(accepted)])
    return records


def blocks_of(scheduler: Any, request: Any) -> list[list]:
    """``[[request id, bytes, blocks]]``: the KV-cache blocks ``request`` holds now and their bytes (per KV
    cache group: its blocks times its page size times its layers), from vLLM's own block tables. vLLM's
    null block (a sliding-window group's freed entries) is not held."""
    config = scheduler.kv_cache_config
    manager = scheduler.kv_cache_manager
    per_group = manager.get_block_ids(request.request_id)
    null = manager.block_pool.null_block.block_id
    nbytes = blocks = 0
    for group, ids in zip(config.kv_cache_groups, per_group, strict=False):
        held = sum(1 for i in ids if i != null)
        blocks += held
        nbytes += held * int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    return [[request.request_id, nbytes, blocks]] if blocks else []


def coordinator_of(scheduler: Any) -> Any:
    """The scheduler's KV-cache coordinator (the object whose ``remove_skipped_blocks`` ``window-frees`` wraps)."""
    return scheduler.kv_cache_manager.coordinator


def kv_groups(coordinator: Any) -> list[KVGroup]:
    """The coordinator's KV-cache groups, in the order of its managers (group ``g`` is manager ``g``)."""
    from sparseety.integrations.vllm.attention_capture import layer_number

    groups = []
    for g, spec_group in enumerate(coordinator.kv_cache_config.kv_cache_groups):
        spec = spec_group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        layers = tuple(n for n in (layer_number(name) for name in spec_group.layer_names) if n is not None)
        groups.append(KVGroup(group=g, window=int(window) if window else None,
                              block_bytes=int(spec.page_size_bytes) * len(spec_group.layer_names),
                              kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0), layers=layers))
    return groups


def block_tables(coordinator: Any, request_id: str) -> list[tuple[list[Any], Any]] | None:
    """Per KV-cache group, ``(the request's block table, vLLM's null block)``; None when no group holds the
    request (a table is vLLM's own list, read, never changed)."""
    tables = []
    found = False
    for manager in coordinator.single_type_managers:
        table = manager.req_to_blocks.get(request_id)
        found = found or table is not None
        tables.append((table if table is not None else [], manager._null_block))
    return tables if found else None


# -- worker: the model runner and the attention backend ----------------------------------------------------
def batch_requests(runner: Any) -> list[str]:
    """The request ids of this forward's batch, in row order."""
    batch = runner.input_batch
    n = batch.num_reqs
    return list(batch.req_ids[:n]) if n else []


def query_starts(runner: Any) -> Any:
    """``query_start_loc`` as numpy ``[requests + 1]``: request ``i``'s rows are ``[starts[i], starts[i+1])``."""
    return runner.query_start_loc.np


def new_request(runner: Any, req_id: str) -> tuple[int, dict[str, Any]] | None:
    """``(prompt length, extra args)`` of a request the runner holds (None when it holds none)."""
    state = runner.requests.get(req_id)
    if state is None:
        return None
    params = getattr(state, "sampling_params", None)
    return int(state.num_prompt_tokens), dict(getattr(params, "extra_args", None) or {})


def prompt_token_ids(runner: Any, req_id: str) -> list[int] | None:
    state = runner.requests.get(req_id)
    return None if state is None else list(state.prompt_token_ids)


def block_size(runner: Any) -> int:
    return int(runner.cache_config.block_size)


def named_modules(runner: Any) -> dict[str, Any]:
    return dict(runner.model.named_modules())


def module_weight(modules: dict[str, Any], name: str) -> Any:
    """The ``weight`` parameter of the model's module ``name`` (None when it has none)."""
    return getattr(modules.get(name), "weight", None)


def model_path(runner: Any) -> str:
    """The served model's directory (vLLM's model argument)."""
    return str(getattr(getattr(runner, "model_config", None), "model", "") or "")


def served_path(vllm_config: Any) -> str:
    """The served model's directory, from the engine's config."""
    return str(vllm_config.model_config.model)


def attention_blocks(runner: Any) -> list[tuple[str, Any]]:
    """``(attention layer name, module)`` of each module of the runner's model whose ``attn`` child is an
    attention layer (``*.self_attn``): what it is called with is the hidden states entering attention."""
    return [(str(m.attn.layer_name), m) for m in runner.model.modules()
            if isinstance(getattr(getattr(m, "attn", None), "layer_name", None), str)]


def impl_shape(impl: Any) -> ImplShape:
    return ImplShape(num_heads=int(impl.num_heads), num_kv_heads=int(impl.num_kv_heads),
                     head_size=int(getattr(impl, "head_size", 0) or 0), scale=float(impl.scale))


def _variant(impl: Any) -> str | None:
    """What makes a layer's attention other than a causal softmax, windowed or not (None: nothing)."""
    if getattr(impl, "logits_soft_cap", None):
        return "a logit soft cap"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "sinks"
    return None


def attention_layers() -> list[AttentionLayer]:
    """The model's attention layers with their backend objects (inside vLLM's forward context)."""
    from vllm.forward_context import get_forward_context

    layers = []
    for name, module in get_forward_context().no_compile_layers.items():
        impl = getattr(module, "impl", None)
        if impl is None or not all(hasattr(impl, a) for a in ("num_heads", "num_kv_heads", "scale")):
            continue  # not an attention layer (MoE, Mamba, ...)
        window = getattr(module, "sliding_window", None)
        layers.append(AttentionLayer(name=name, impl=impl, variant=_variant(impl),
                                     window=int(window) if window else None))
    return layers


def layer_name(attn_layer: Any) -> str:
    return getattr(attn_layer, "layer_name", "")


def moe_routers(runner: Any) -> list[tuple[str, Any]]:
    """``(layer name, router)`` of each MoE layer of the runner's model (``MoERunner.layer_name`` and the
    ``FusedMoERouter`` whose ``select_experts`` the ``moe-routing`` hook wraps); empty for a dense model."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [(str(m.layer_name), m.router) for m in runner.model.modules()
            if isinstance(m, MoERunner) and getattr(m, "router", None) is not None]


def model_split() -> str | None:
    """What splits the model over workers (tensor or pipeline parallelism), or None."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_world_size

        tp, pp = get_tensor_model_parallel_world_size(), get_pp_group().world_size
    except Exception:
        return None  # no parallel state (one process): not split
    parts = [f"{tp} tensor-parallel ranks" if tp > 1 else "", f"{pp} pipeline stages" if pp > 1 else ""]
    return " and ".join(p for p in parts if p) or None


# -- engine core and worker: eviction inside the paged KV cache (:mod:`.evict.hooks`) ---------------------
def eviction_refusal(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this vLLM setup cannot evict inside its KV cache (None when it can): every KV-cache group must be
    full attention, with no speculative decoding, async scheduling or pipeline parallelism."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if vllm_config.speculative_config is not None:
        return "speculative decoding is on (drafts would be written past the kept tokens)"
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return "async scheduling is on (a block freed at a step may be written before the worker reads it)"
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        return "pipeline parallelism is on"
    for group in kv_cache_config.kv_cache_groups:
        if type(group.kv_cache_spec) is not FullAttentionSpec:
            return (f"KV-cache group of {group.layer_names[0]} is {type(group.kv_cache_spec).__name__}, not full "
                    "attention (windowed and hybrid models are not supported yet)")
    return None


def running_requests(scheduler: Any) -> list[tuple[str, int, int]]:
    """``(request id, computed tokens, prompt tokens)`` of each running request."""
    return [(r.request_id, r.num_computed_tokens, r.num_prompt_tokens) for r in scheduler.running]


def skip_prefix_cache(request: Any) -> None:
    """Keep ``request`` off the prefix cache (its blocks will be compacted)."""
    request.skip_reading_prefix_cache = True


def prompt_tokens(request: Any) -> int:
    return int(request.num_prompt_tokens)


def request_finished(request: Any) -> tuple[str, bool]:
    return request.request_id, bool(request.is_finished())


def shrink_blocks(scheduler: Any, request_id: str, tokens: int) -> int:
    """Give back to vLLM's pool the blocks of ``request_id`` past its first ``tokens`` tokens, in every
    KV-cache group; the number of blocks freed."""
    freed = 0
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(request_id)
        if not blocks:
            continue
        keep = -(-tokens // manager.block_size)
        tail = blocks[keep:]
        del blocks[keep:]
        manager.block_pool.free_blocks(reversed(tail))
        freed += len(tail)
    return freed


def request_blocks(runner: Any, req_id: str) -> list[list[int]] | None:
    """The worker's block ids of ``req_id`` per KV-cache group (the lists themselves, to truncate)."""
    state = runner.requests.get(req_id)
    return None if state is None else list(state.block_ids)


def truncate_row(runner: Any, req_id: str, group: int, blocks: int) -> None:
    """Make the input batch's block-table row of ``req_id`` in ``group`` hold its first ``blocks`` blocks."""
    row = runner.input_batch.req_id_to_index.get(req_id)
    if row is not None:
        table = runner.input_batch.block_table.block_tables[group]
        table.num_blocks_per_row[row] = blocks
        # the entries past them point at blocks now another request's: the null block (0) instead, so a write
        # that missed its shifted slot mapping lands where nobody reads
        table.block_table.np[row, blocks:] = 0
        table.block_table.gpu[row, blocks:] = 0


def group_block_sizes(runner: Any) -> list[int]:
    """The block size of each KV-cache group, in order."""
    return [group.kv_cache_spec.block_size for group in runner.kv_cache_config.kv_cache_groups]


def group_caches(runner: Any) -> list[tuple[list[Any], int, Any]]:
    """Per KV-cache group: the layers' cache tensors, the block size and the first layer (for its kernel)."""
    context = runner.compilation_config.static_forward_context
    groups = []
    for group in runner.kv_cache_config.kv_cache_groups:
        layers = [context[name] for name in group.layer_names if name in context]
        groups.append(([layer.kv_cache for layer in layers], group.kv_cache_spec.block_size,
                       layers[0] if layers else None))
    return groups


def group_layer_names(runner: Any) -> list[list[str]]:
    """Per KV-cache group, the names of its layers in :func:`group_caches`' order."""
    context = runner.compilation_config.static_forward_context
    return [[name for name in group.layer_names if name in context] for group in runner.kv_cache_config.kv_cache_groups]


def request_extra_args(request: Any) -> dict[str, Any]:
    """The ``vllm_xargs`` of an engine-core ``Request`` (empty when it has none)."""
    params = getattr(request, "sampling_params", None)
    return dict(getattr(params, "extra_args", None) or {})


def cache_writer(layer: Any) -> Any:
    """The CPU kernel's cache writer for ``layer`` (``key, value, key_cache, value_cache, slots``), or None
    on another attention backend."""
    from vllm import _custom_ops

    if type(layer.impl).__name__ != "CPUAttentionBackendImpl" or not hasattr(layer, "isa"):
        return None
    isa = layer.isa

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        _custom_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    return write


def shift_inputs(runner: Any, offsets: dict[str, int]) -> bool:
    """After ``_prepare_inputs``: rows of requests holding ``offset`` fewer tokens than they computed attend
    over their kept tokens (``seq_lens``) and write new ones after them (slot mapping); positions (RoPE)
    stay logical. True."""
    import torch

    batch = runner.input_batch
    starts = runner.query_start_loc.np
    tables = batch.block_table.block_tables
    for req_id, offset in offsets.items():
        row = batch.req_id_to_index.get(req_id)
        if row is None or offset == 0:
            continue
        runner.seq_lens[row] -= offset
        runner.optimistic_seq_lens_cpu[row] -= offset
        a, b = int(starts[row]), int(starts[row + 1])
        slots = runner.positions[a:b] - offset
        for table in tables:
            size = table.block_size
            ids = table.block_table.gpu[row].to(torch.int64)
            table.slot_mapping.gpu[a:b] = ids[slots // size] * size + slots % size
    return True


def drop_writes(runner: Any, offsets: dict[str, int]) -> None:
    """When :func:`shift_inputs` failed: the rows of requests that hold fewer tokens than they computed write no
    K/V this step (slot -1, which vLLM's kernels skip), so no write lands in a block another request holds."""
    batch = runner.input_batch
    starts = runner.query_start_loc.np
    for req_id, offset in offsets.items():
        row = batch.req_id_to_index.get(req_id)
        if row is not None and offset:
            a, b = int(starts[row]), int(starts[row + 1])
            for table in batch.block_table.block_tables:
                table.slot_mapping.gpu[a:b] = -1


# -- API server: the request-arg checks ----------------------------------------------------------------------
def validation_error() -> Any:
    """vLLM's ``VLLMValidationError`` (``(message, parameter=...)``; vLLM answers it with HTTP 400)."""
    return resolve("vllm.exceptions:VLLMValidationError")


def sampling_extra_args(params: Any) -> Any:
    """A request's ``SamplingParams.extra_args`` (``vllm_xargs``), or None (pooling params have none)."""
    return getattr(params, "extra_args", None)


def add_inner_middleware(app: Any, cls: type, *args: Any) -> None:
    """Add ASGI middleware ``cls(app, *args)`` innermost in vLLM's FastAPI ``app``: after its CORS and
    authentication middleware, so a client that is not let in learns nothing from it."""
    middleware = resolve("starlette.middleware:Middleware")
    app.user_middleware.append(middleware(cls, *args))
