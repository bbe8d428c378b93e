"""The worker's readers: the model runner's batch, the model's modules and the attention layers."""

from __future__ import annotations

from typing import Any

from sparseety.integrations.vllm.vllm_api.messages import AttentionLayer, ImplShape


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
