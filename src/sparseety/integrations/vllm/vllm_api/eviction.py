"""What eviction reads and changes in vLLM's engine core and worker: the refusal of a setup it cannot run in,
the blocks it gives back, the block table rows it cuts and the inputs it shifts."""

from __future__ import annotations

from typing import Any



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


def layer_kv_shape(layer: Any) -> tuple[str, int | None, int | None]:
    """The attention backend impl class name of ``layer``, its KV heads and head size (None where the impl does
    not say), for :func:`.evict.kv_layouts.pick_layout`."""
    impl = getattr(layer, "impl", None)
    heads, head_size = getattr(impl, "num_kv_heads", None), getattr(impl, "head_size", None)
    return (type(impl).__name__, None if heads is None else int(heads),
            None if head_size is None else int(head_size))


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
