"""Eviction inside vLLM's paged KV cache (``SPARSEETY_KV_POLICY``): the engine-core and worker hooks.

Engine core (the scheduler's process):

- ``Scheduler.__init__``: refuses to start, naming the reason, when the settings are bad or this vLLM setup
  cannot evict (:func:`.adapter.eviction_refusal`);
- ``Scheduler.add_request``: the request keeps off the prefix cache (its blocks will be compacted, so they are
  never shared) and is tracked with its budget;
- ``FullAttentionManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``: a request asks for blocks
  for the tokens it holds (``logical - offset``), not for every token it computed;
- ``KVCacheCoordinator.cache_blocks``: an evicting request's blocks are never hashed into the prefix cache;
- ``Scheduler.schedule``: before vLLM schedules, :meth:`.EvictionLedger.plan` decides the compactions and
  the tail blocks go back to vLLM's pool at once (this step's admissions see them); after, the orders and
  every scheduled request's offset ride on the ``SchedulerOutput`` (``sparseety_kv``) to the worker;
- ``Scheduler._free_request_blocks``: a finished request is forgotten, a preempted one starts from zero.

Worker: ``_update_states`` first carries out the orders (:class:`WorkerEviction`: the policy picks the kept
slots from each slot's logical position, :func:`.kv_compaction.compact` moves them in every layer, the
request's block list and batch row are cut to the blocks it still holds), before the step's new blocks are
appended; ``_prepare_inputs`` then shifts ``seq_lens`` and the slot mapping (:func:`.adapter.shift_inputs`).
vLLM's CPU build runs each step to its end before the next is scheduled, so a block freed by the scheduler at
step t is read by the worker before any forward of step t writes it.
"""

from __future__ import annotations

import logging
from typing import Any

from sparseety.integrations.vllm import adapter
from sparseety.integrations.vllm.eviction_ledger import Compaction, EvictionLedger
from sparseety.integrations.vllm.eviction_settings import EvictionSettings, parse_eviction

log = logging.getLogger("sparseety.vllm")
HOOK = "kv-eviction"
HOOK_WORKER = "kv-eviction-worker"
ORDERS = "sparseety_kv"  #: the SchedulerOutput attribute that carries the orders


class EngineCoreEviction:
    """The scheduler's side: settings, the ledger, and the orders of the step being scheduled."""

    def __init__(self, settings: EvictionSettings, block_size: int) -> None:
        self.settings = settings
        self.ledger = EvictionLedger(settings.interval or block_size)

    def admit(self, rid: str, prompt_tokens: int) -> None:
        self.ledger.track(rid, self.settings.budget_for(prompt_tokens))

    def before_schedule(self, scheduler: Any) -> list[list]:
        """Plan and free: the compactions of this step, as lists for the worker."""
        orders = []
        for rid, computed, prompt in adapter.running_requests(scheduler):
            order = self.ledger.plan(rid, computed, prompt)
            if order is None:
                continue
            freed = adapter.shrink_blocks(scheduler, rid, order.kept)
            self.ledger.apply(order, freed)
            orders.append(order.as_list())
        return orders

    def message(self, orders: list[list], scheduled: Any) -> dict[str, Any]:
        """What the worker needs this step; orders of requests vLLM preempted while scheduling are dropped
        (their blocks are all free and they recompute from the prompt)."""
        orders = [o for o in orders if self.ledger.offset(o[0])]
        offsets = {rid: self.ledger.offset(rid) for rid in scheduled if self.ledger.offset(rid)}
        return {"compact": orders, "offset": offsets}


class WorkerEviction:
    """The worker's side: each evicting request's slot-to-position map, and the probed cache layout."""

    def __init__(self, sinks: int) -> None:
        self.sinks = sinks
        self.positions: dict[str, Any] = {}  #: rid -> [held] logical position of each physical slot
        self.layouts: dict[int, Any] = {}
        self.offsets: dict[str, int] = {}
        self.groups: list[tuple[list[Any], int, Any]] | None = None  #: the layers' caches, read once

    def keep(self, positions: Any, kept: int) -> Any:
        """``streaming``: the sinks and the newest positions, scored and selected as the own engine's
        :class:`~sparseety.policies.streaming.StreamingPolicy` does -> slots [kept], ascending."""
        import torch

        from sparseety.policies.base import protect, select_keep

        scores = protect(positions.to(torch.float32), positions < self.sinks)
        return select_keep(scores[None, None], kept, positions[None, None])[0, 0]

    def layout(self, group: int, caches: list[Any], block_size: int, layer: Any) -> Any:
        from sparseety.integrations.vllm.kv_compaction import probe_layout

        if group not in self.layouts:
            write = adapter.cache_writer(layer)
            kv = caches[0]
            self.layouts[group] = None if write is None else probe_layout(
                write, kv.shape[1], block_size, kv.shape[3] // 2, kv.dtype)
            if self.layouts[group] is None:
                raise RuntimeError(f"the KV-cache layout of {type(layer.impl).__name__} could not be probed")
        return self.layouts[group]

    def carry_out(self, runner: Any, order: Compaction) -> None:
        import torch

        from sparseety.integrations.vllm.kv_compaction import compact, fill_holes, kept_positions

        held = self.positions.get(order.rid)
        if held is None or order.logical == order.physical:
            held = torch.arange(order.physical)
        else:
            fresh = order.physical - held.numel()
            held = torch.cat([held, torch.arange(order.logical - fresh, order.logical)])
        moves = fill_holes(self.keep(held, order.kept), order.kept)
        block_lists = adapter.request_blocks(runner, order.rid)
        if block_lists is None:
            return
        if self.groups is None:
            self.groups = adapter.group_caches(runner)
        for group, (caches, block_size, layer) in enumerate(self.groups):
            blocks = block_lists[group]
            layout = self.layout(group, caches, block_size, layer)
            compact(caches, torch.tensor(blocks, dtype=torch.int64), moves, layout)
            kept_blocks = -(-order.kept // block_size)
            del blocks[kept_blocks:]
            adapter.truncate_row(runner, order.rid, group, kept_blocks)
        self.positions[order.rid] = kept_positions(held, moves, order.kept)

    def before_update(self, runner: Any, message: dict[str, Any] | None, finished: Any) -> None:
        for rid in finished:
            self.positions.pop(rid, None)
        self.offsets = dict(message["offset"]) if message else {}
        for item in message["compact"] if message else ():
            self.carry_out(runner, Compaction(*item))


_CORE: EngineCoreEviction | None = None
_WORKER: WorkerEviction | None = None


def install(loud: bool) -> None:
    """Install the eviction hooks when ``SPARSEETY_KV_POLICY`` asks for eviction (nothing otherwise). A bad
    setting is raised when vLLM builds its scheduler, so vLLM refuses to start naming it."""
    global _WORKER
    try:
        settings = parse_eviction()
        problem = None
    except Exception as exc:  # reported at the scheduler's start, where it stops vLLM with the reason
        settings, problem = None, str(exc)
    if settings is None and problem is None:
        return
    on = adapter.check((HOOK, HOOK_WORKER), loud=loud)
    if not (on[HOOK] and on[HOOK_WORKER]):
        return
    if settings is not None:
        _WORKER = WorkerEviction(settings.sinks)
    _patch_scheduler(settings, problem)
    _patch_managers()
    _patch_runner()


def _patch_scheduler(settings: EvictionSettings | None, problem: str | None) -> None:
    scheduler = adapter.resolve(adapter.SCHED)

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            global _CORE
            refusal = problem or adapter.eviction_refusal(self.vllm_config, self.kv_cache_config)
            if refusal is not None:
                from sparseety.errors import ConfigError

                raise ConfigError(f"sparseety: SPARSEETY_KV_POLICY cannot run: {refusal}")
            assert settings is not None
            block = min(g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups)
            _CORE = EngineCoreEviction(settings, block)
            log.info("sparseety: evicting inside vLLM's KV cache: %s, budget %s, ratio %s, every %s tokens",
                     settings.policy, settings.budget, settings.ratio, _CORE.ledger.interval)
        return __init__

    def make_add(original):
        def add_request(self, request, *args, **kwargs):
            if _CORE is not None:
                rid, prompt = adapter.skip_prefix_cache(request)
                _CORE.admit(rid, prompt)
            return original(self, request, *args, **kwargs)
        return add_request

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            orders = _CORE.before_schedule(self) if _CORE is not None else []
            output = original(self, *args, **kwargs)
            if _CORE is not None:
                setattr(output, ORDERS, _CORE.message(orders, output.num_scheduled_tokens))
            return output
        return schedule

    def make_free(original):
        def _free_request_blocks(self, request, *args, **kwargs):
            result = original(self, request, *args, **kwargs)
            if _CORE is not None:
                rid, finished = adapter.request_finished(request)
                if finished:
                    _CORE.ledger.forget(rid)
                else:
                    _CORE.ledger.reset(rid)
            return result
        return _free_request_blocks

    adapter.patch(scheduler, "__init__", HOOK, make_init)
    adapter.patch(scheduler, "add_request", HOOK, make_add)
    adapter.patch(scheduler, "schedule", HOOK, make_schedule)
    adapter.patch(scheduler, "_free_request_blocks", HOOK, make_free)


def _offset_of(request_id: str) -> int:
    return _CORE.ledger.offset(request_id) if _CORE is not None else 0


def _patch_managers() -> None:
    full = adapter.resolve(adapter.FULL)
    coordinator = adapter.resolve(adapter.COORD)

    def make_tokens(original):
        def counted(self, request_id, num_tokens, *args, **kwargs):
            return original(self, request_id, num_tokens - _offset_of(request_id), *args, **kwargs)
        return counted

    def make_cache(original):
        def cache_blocks(self, request, *args, **kwargs):
            if _CORE is not None and adapter.request_id(request) in _CORE.ledger.requests:
                return None
            return original(self, request, *args, **kwargs)
        return cache_blocks

    adapter.patch(full, "get_num_blocks_to_allocate", HOOK, make_tokens)
    adapter.patch(full, "allocate_new_blocks", HOOK, make_tokens)
    adapter.patch(coordinator, "cache_blocks", HOOK, make_cache)


def _patch_runner() -> None:
    runner = adapter.resolve(adapter.RUNNER)

    def make_update(original):
        def _update_states(self, scheduler_output, *args, **kwargs):
            if _WORKER is not None:
                message = getattr(scheduler_output, ORDERS, None)
                _WORKER.before_update(self, message, scheduler_output.finished_req_ids)
            return original(self, scheduler_output, *args, **kwargs)
        return _update_states

    def make_prepare(original):
        def _prepare_inputs(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _WORKER is not None and _WORKER.offsets:
                adapter.shift_inputs(self, _WORKER.offsets)
            return result
        return _prepare_inputs

    adapter.patch(runner, "_update_states", HOOK_WORKER, make_update)
    adapter.patch(runner, "_prepare_inputs", HOOK_WORKER, make_prepare)

