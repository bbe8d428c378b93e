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
slots from each slot's logical position, :func:`.compaction.compact` moves them in every layer, the
request's block list and batch row are cut to the blocks it still holds), before the step's new blocks are
appended; ``_prepare_inputs`` then shifts ``seq_lens`` and the slot mapping (:func:`.adapter.shift_inputs`).
vLLM's CPU build runs each step to its end before the next is scheduled, so a block freed by the scheduler at
step t is read by the worker before any forward of step t writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.evict.ledger import EvictionLedger, refused_record
from sparseety.integrations.vllm.evict.orders import Compaction, StepOrders, StepReport
from sparseety.integrations.vllm.evict.settings import POLICY_ARG, EvictionSettings
from sparseety.integrations.vllm.vllm_api.guards import guarded
from sparseety.integrations.vllm.vllm_api.wire_messages import EvictionRecord
from sparseety.integrations.vllm.transport.values import clipped

log = logging.getLogger("sparseety.vllm")
HOOK = "kv-eviction"
HOOK_WORKER = "kv-eviction-worker"
ORDERS = "sparseety_kv"  #: the SchedulerOutput attribute that carries the orders
REPORT = "sparseety_kv_report"  #: the ModelRunnerOutput attribute that carries the worker's report
REFUSED_LIMIT = 4096  #: refused requests remembered until they finish


class EngineCoreEviction:
    """The scheduler's side: settings, the ledger, and the orders of the step being scheduled."""

    def __init__(self, settings: EvictionSettings, block_size: int, model: str | None = None) -> None:
        self.settings = settings
        self.model = model  #: the served checkpoint's directory (a policy that reads the model is bound to it)
        self.ledger = EvictionLedger(settings.interval or block_size)
        self.preempted: list[str] = []  #: since the last message: the worker starts their slot maps afresh
        #: requests whose ``vllm_xargs`` asked for an eviction that cannot run (served dense), until they finish
        self.refused: dict[str, EvictionRecord] = {}
        self.failed = 0  #: requests that stopped evicting after a failed compaction

    def admit(self, rid: str, prompt_tokens: int, extra: dict[str, Any]) -> bool:
        """Track ``rid`` when it evicts (the settings, or its ``vllm_xargs``); True when it does."""
        try:
            asked = self.settings.for_request(extra, prompt_tokens, self.model)
        except Exception as exc:  # a bad arg the API server did not refuse, or a failure of SparSEEty's own
            if len(self.refused) >= REFUSED_LIMIT:  # requests aborted before vLLM freed anything
                self.refused.pop(next(iter(self.refused)))
            why = clipped(str(exc) if isinstance(exc, ConfigError) else f"eviction could not start: {exc!r}", 400)
            asked_policy = (extra or {}).get(POLICY_ARG)
            policy = clipped(asked_policy if isinstance(asked_policy, str) and asked_policy else self.settings.policy)
            self.refused[rid] = refused_record(rid, policy, why)
            log.warning("sparseety: request %s runs dense: %s", rid, why)
            return False
        if asked is None:
            return False
        self.ledger.track(rid, asked.budget, asked.policy)
        return True

    def before_schedule(self, scheduler: Any) -> list[Compaction]:
        """Plan and free: the compactions of this step."""
        orders = []
        for rid, computed, prompt in adapter.running_requests(scheduler):
            try:  # nothing of vLLM's is changed before the blocks are freed, so a failure here changes nothing
                order = self.ledger.plan(rid, computed, prompt)
                if order is None:
                    continue
                freed = adapter.shrink_blocks(scheduler, rid, order.kept)
            except Exception as exc:
                self.stop(rid, f"planning its compaction failed: {exc!r}")
                continue
            self.ledger.apply(order, freed)
            orders.append(order)
        return orders

    def stop(self, rid: str, reason: str) -> None:
        """``rid`` stops evicting (it keeps what it holds and grows from there), with one warning."""
        led = self.ledger.requests.get(rid)
        if led is not None and led.failure is None:
            led.failure = reason
            self.failed += 1
            log.warning("sparseety: request %s stops evicting: %s", rid, reason)

    def message(self, orders: list[Compaction], scheduled: Any) -> StepOrders:
        """What the worker needs this step; orders of requests vLLM preempted while scheduling are dropped
        (their blocks are all free and they recompute from the prompt)."""
        kept = tuple(o for o in orders if self.ledger.offset(o.rid))
        offsets = {rid: self.ledger.offset(rid) for rid in scheduled if self.ledger.offset(rid)}
        reset, self.preempted = tuple(self.preempted), []
        return StepOrders(kept, offsets, reset)

    def fallback_message(self, orders: list[Compaction]) -> StepOrders:
        """The worker's message when :meth:`message` failed: every order (their blocks are already free, so the
        worker must cut them) and every tracked request's offset."""
        offsets = {rid: led.offset for rid, led in self.ledger.requests.items() if led.offset}
        return StepOrders(tuple(orders), offsets)

    def receive(self, outbox: StepReport | None) -> None:
        """The worker's report on the ``ModelRunnerOutput`` (evicted slots, failed compactions)."""
        if not isinstance(outbox, StepReport):
            return
        for rid, reason in self.ledger.receive(outbox):
            self.failed += 1
            log.warning("sparseety: request %s stops evicting (it keeps what it holds and grows from there): %s",
                        rid, reason)

    def freed(self, rid: str, finished: bool) -> EvictionRecord | None:
        """vLLM freed all of ``rid``'s blocks: finished (forgotten: its record for the observer, see
        :meth:`.RequestLedger.record`) or preempted (recomputes from zero)."""
        if finished:
            led = self.ledger.forget(rid)
            return self.refused.pop(rid, None) if led is None else led.record(rid)
        if rid in self.ledger.requests:
            self.ledger.reset(rid)
            self.preempted.append(rid)
        return None


_CORE: EngineCoreEviction | None = None
_WORKER: Any = None  #: the worker's :class:`.worker.WorkerEviction` (torch is imported there)


_SEND: Callable[[list[Any], Any], None] | None = None  #: the scheduler channel to the observer


def install(loud: bool, settings: EvictionSettings | None,
            send: Callable[[list[Any], Any], None] | None = None) -> bool:
    """Install the eviction hooks when ``settings`` (``SPARSEETY_KV_POLICY``, checked by the plugin before vLLM
    loads a model) ask for eviction; True when they are on. ``send(messages, requests)`` carries each
    finished request's :class:`.wire_messages.EvictionRecord` to the observer."""
    global _WORKER, _SEND
    _SEND = send
    if settings is None:
        return False
    on = adapter.check((HOOK, HOOK_WORKER), loud=loud)
    if not (on[HOOK] and on[HOOK_WORKER]):
        return False
    from sparseety.integrations.vllm.evict.worker import WorkerEviction

    _WORKER = WorkerEviction(settings)
    _patch_scheduler(settings)
    _patch_managers()
    _patch_runner()
    return True


def _patch_scheduler(settings: EvictionSettings) -> None:
    scheduler = adapter.resolve(adapter.SCHED)

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            global _CORE
            refusal = adapter.eviction_refusal(self.vllm_config, self.kv_cache_config)
            if refusal is not None:
                raise ConfigError(f"sparseety: SPARSEETY_KV_POLICY cannot run: {refusal}")
            block = min(g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups)
            model = adapter.served_path(self.vllm_config)
            if settings.policy != "dense":  # a surrogate missing for this model refuses here, not per request
                settings.for_request({}, 1_000_000, model)
            _CORE = EngineCoreEviction(settings, block, model)
            log.info("sparseety: evicting inside vLLM's KV cache: %s, budget %s, ratio %s, every %s tokens",
                     settings.policy, settings.budget, settings.ratio, _CORE.ledger.interval)
        return __init__

    def make_add(original):
        def add_request(self, request, *args, **kwargs):
            if _CORE is not None:
                guarded(HOOK, _admit, _CORE, request)
            return original(self, request, *args, **kwargs)
        return add_request

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            orders = (guarded(HOOK, _CORE.before_schedule, self) or []) if _CORE is not None else []
            output = original(self, *args, **kwargs)
            if _CORE is not None:
                setattr(output, ORDERS, guarded(HOOK, _CORE.message, orders, output.num_scheduled_tokens)
                        or _CORE.fallback_message(orders))
            return output
        return schedule

    def make_free(original):
        def _free_request_blocks(self, request, *args, **kwargs):
            result = original(self, request, *args, **kwargs)
            if _CORE is not None:
                guarded(HOOK, _freed, _CORE, request)
            return result
        return _free_request_blocks

    def make_update(original):
        def update_from_output(self, *args, **kwargs):
            if _CORE is not None:
                output = adapter.arg(args, kwargs, 1, "model_runner_output")
                guarded(HOOK, _CORE.receive, getattr(output, REPORT, None))
            return original(self, *args, **kwargs)
        return update_from_output

    adapter.patch(scheduler, "__init__", HOOK, make_init)
    adapter.patch(scheduler, "update_from_output", HOOK, make_update)
    adapter.patch(scheduler, "add_request", HOOK, make_add)
    adapter.patch(scheduler, "schedule", HOOK, make_schedule)
    adapter.patch(scheduler, "_free_request_blocks", HOOK, make_free)


def _admit(core: EngineCoreEviction, request: Any) -> None:
    rid = adapter.request_id(request)
    if core.admit(rid, adapter.prompt_tokens(request), adapter.request_extra_args(request)):
        try:
            adapter.skip_prefix_cache(request)
        except Exception:
            core.ledger.forget(rid)  # it runs dense: its blocks may be shared
            raise


def _freed(core: EngineCoreEviction, request: Any) -> None:
    rid, finished = adapter.request_finished(request)
    record = core.freed(rid, finished)
    if record is not None and _SEND is not None:
        guarded(HOOK, _SEND, [record], {rid: request})


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
                done = guarded(HOOK_WORKER, _WORKER.before_update, self, message, scheduler_output.finished_req_ids)
                if done is None and message:  # the scheduler freed the blocks: they must leave the block table
                    guarded(HOOK_WORKER, _WORKER.cut_only, self, message)
            return original(self, scheduler_output, *args, **kwargs)
        return _update_states

    def make_prepare(original):
        def _prepare_inputs(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _WORKER is not None and _WORKER.offsets:
                if guarded(HOOK_WORKER, adapter.shift_inputs, self, _WORKER.offsets) is None:
                    guarded(HOOK_WORKER, adapter.drop_writes, self, _WORKER.offsets)  # never a neighbour's block
            return result
        return _prepare_inputs

    def make_forward(forward):
        def _model_forward(self, *args, **kwargs):
            if _WORKER is None:
                return forward(self, *args, **kwargs)
            _wrap_backends(self)
            guarded(HOOK_WORKER, _WORKER.plan, self, adapter.arg(args, kwargs, 1, "positions"))
            try:
                return forward(self, *args, **kwargs)
            finally:
                guarded(HOOK_WORKER, _WORKER.after_forward)
        return _model_forward

    adapter.patch(runner, "_update_states", HOOK_WORKER, make_update)
    adapter.patch(runner, "_prepare_inputs", HOOK_WORKER, make_prepare)
    def make_sample(original):
        def sample_tokens(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            if _WORKER is not None and getattr(output, "req_ids", None):
                report = guarded(HOOK_WORKER, _WORKER.outbox)
                if report:
                    setattr(output, REPORT, report)
            return output
        return sample_tokens

    adapter.patch(runner, "_model_forward", HOOK_WORKER, make_forward)
    adapter.patch(runner, "sample_tokens", HOOK_WORKER, make_sample)


_SHAPES: dict[str, Any] = {}  #: attention layer name -> its heads and scale (:class:`.adapter.ImplShape`)


def _wrap_backends(runner: Any) -> None:
    """Wrap ``forward`` of each attention-implementation class the model's layers use (at the first forward,
    inside vLLM's forward context): the evicting requests' new query rows score the slots they hold. A
    read-only forward pre-hook on each attention block hands its input hidden states to a policy that reads
    them (``kvzap``)."""
    if _SHAPES:
        return
    for name, module in guarded(HOOK_WORKER, adapter.attention_blocks, runner) or ():
        module.register_forward_pre_hook(_hidden_hook(name), with_kwargs=True)
    for layer in adapter.attention_layers():
        _SHAPES[layer.name] = adapter.impl_shape(layer.impl)
        cls = type(layer.impl)
        if adapter.installed(cls, "forward", HOOK_WORKER) or not adapter.check_class(cls):
            continue

        def make(original):
            def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
                result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
                if _WORKER is not None and _WORKER.step and attn_metadata is not None:
                    shape = _SHAPES.get(adapter.layer_name(layer))
                    if shape is not None:
                        guarded(HOOK_WORKER, _WORKER.layer, layer, query, shape)
                return result
            return forward

        adapter.patch(cls, "forward", HOOK_WORKER, make)


def _hidden_hook(name: str) -> Callable[..., None]:
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        if _WORKER is not None and _WORKER.wants_hidden:
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            guarded(HOOK_WORKER, _WORKER.take_hidden, name, hidden)
    return hook
