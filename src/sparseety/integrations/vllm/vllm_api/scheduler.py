"""The engine core's readers: the scheduler's requests, chunks, drafts, blocks and KV-cache groups."""

from __future__ import annotations

from typing import Any

from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import Chunk, Draft, KVHeld, Owner


# -- engine core: the scheduler ----------------------------------------------------------------------------
def prefill_chunks(scheduler: Any, scheduler_output: Any) -> list[Chunk]:
    """A :class:`.wire_messages.Chunk` per prompt chunk this step schedules (read before vLLM
    advances ``num_computed_tokens``)."""
    chunks = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:
            chunks.append(Chunk(req_id, int(start), int(min(n, request.num_prompt_tokens - start))))
    return chunks


def owners_of(scheduler: Any, scheduler_output: Any, route: bool) -> list[Owner]:
    """An :class:`.wire_messages.Owner` for the newly scheduled requests that an API server other than 0
    owns (none with one API server: one attribute read per new request)."""
    owners = []
    for new in scheduler_output.scheduled_new_reqs:
        client = client_of(scheduler.requests.get(new.req_id), route)
        if client > 0:
            owners.append(Owner(new.req_id, client))
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


def drafts_of(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> list[Draft]:
    """A :class:`.wire_messages.Draft` (request id, step, first position, draft ids, accepted) for each request that verified drafts in
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
        records.append(Draft(req_id, int(request.num_output_tokens), int(request.num_tokens),
                             tuple(int(t) for t in draft_ids), int(accepted)))
    return records


def blocks_of(scheduler: Any, request: Any) -> list[KVHeld]:
    """``[KVHeld(request id, bytes, blocks)]``: the KV-cache blocks ``request`` holds now and their bytes (per KV
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
    return [KVHeld(request.request_id, int(nbytes), int(blocks))] if blocks else []


def coordinator_of(scheduler: Any) -> Any:
    """The scheduler's KV-cache coordinator (the object whose ``remove_skipped_blocks`` ``window-frees`` wraps)."""
    return scheduler.kv_cache_manager.coordinator


def kv_groups(coordinator: Any) -> list[KVGroup]:
    """The coordinator's KV-cache groups, in the order of its managers (group ``g`` is manager ``g``)."""
    from sparseety.integrations.vllm.vllm_api.ids import layer_number

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
