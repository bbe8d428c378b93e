"""The worker's side of eviction inside vLLM's paged KV cache: which requests evict, their scores, the compactions.

Per forward (``_model_forward``), :meth:`WorkerEviction.plan` finds the rows of each evicting request; inside the
attention backend's ``forward`` of every layer, :meth:`WorkerEviction.layer` hands them to the request's
:class:`~.slots.EvictingRequest`, which scores the slots it holds with the own engine's policy, reading
keys (and values) out of vLLM's cache through the group's layout; a policy that reads the hidden states entering
attention (``kvzap``) gets its rows from a forward pre-hook on the layer's attention block
(:meth:`WorkerEviction.take_hidden`). Before a step's inputs are prepared
(``_update_states``), :meth:`WorkerEviction.before_update` carries out the scheduler's orders: the kept slots of
every layer and KV head move into the first slots (:func:`.compaction.compact`) and the request's block list
and batch row are cut to the blocks it still holds.

Which requests evict is decided here from the same settings and ``vllm_xargs`` the scheduler reads
(:meth:`.EvictionSettings.for_request`), so both sides agree without a message. A scoring failure makes the
compaction fall back to keeping the newest tokens (counted, warned once per request); the engine is never stopped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.evict.compaction import BlockLayout, compact, read_slots, slot_index
from sparseety.integrations.vllm.evict.kv_layouts import group_layout
from sparseety.integrations.vllm.evict.orders import Compaction, StepOrders, StepReport
from sparseety.integrations.vllm.vllm_api.wire_messages import EvictedSlots
from sparseety.integrations.vllm.evict.settings import EvictionSettings, checkpoint_model
from sparseety.integrations.vllm.evict.slots import EvictingRequest

log = logging.getLogger("sparseety.vllm")


def _tracing() -> bool:
    """Whether evicted slots are recorded: a trace store at tier 1 or more (the observer's settings)."""
    from sparseety.integrations.vllm.transport.settings import parse_settings

    settings = parse_settings()
    return bool(settings.trace_dir) and not settings.problems and settings.tier >= 1


def _tensors(block_lists: list[list[int]]) -> list[torch.Tensor]:
    return [torch.tensor(b, dtype=torch.int64) for b in block_lists]


class WorkerEviction:
    """The worker process's evicting requests, the layers' caches and their layouts."""

    def __init__(self, settings: EvictionSettings) -> None:
        self.settings = settings
        self.requests: dict[str, EvictingRequest | None] = {}  #: decided requests (None: dense)
        self.policies: dict[tuple, Any] = {}
        self.unbound: dict[tuple, str] = {}  #: policies that could not be bound to the model here, and why
        self.offsets: dict[str, int] = {}  #: this step's logical minus physical tokens per request
        self.groups: list[tuple[list[torch.Tensor], int, Any]] | None = None  #: per group: caches, block size, layer
        self.layouts: list[BlockLayout] = []
        self.layer_index: dict[str, int] = {}  #: layer name -> its index over all groups
        self.layer_slots: list[tuple[int, int]] = []  #: per layer index: (group, index in the group)
        self.kv_heads = 0
        self.step: list[tuple[EvictingRequest, int, int, int, int, Any]] = []  #: request, rows, end, held, reader
        self.trace = _tracing()
        self.failed: dict[str, str] = {}  #: requests whose compaction fell back, for the scheduler (once each)
        self.wants_hidden = False  #: this forward has a request whose policy reads the hidden states
        self.hidden: dict[int, torch.Tensor] = {}  #: layer index -> this forward's ``[tokens, D]`` attention input

    # -- the model's layers --------------------------------------------------------------------------------
    def ensure_layers(self, runner: Any) -> None:
        """Read the layers' caches and find each group's layout (once; :func:`.kv_layouts.group_layout`)."""
        if self.groups is not None:
            return
        groups = adapter.group_caches(runner)
        names = adapter.group_layer_names(runner)
        for g, (caches, block_size, layer) in enumerate(groups):
            backend, heads, head_dim = adapter.layer_kv_shape(layer)
            write = None if layer is None else adapter.cache_writer(layer)
            layout, reason = group_layout(caches, block_size, backend, heads, head_dim, write)
            if layout is None:
                raise RuntimeError(f"the KV-cache layout of {backend} cannot be evicted in: {reason}")
            self.layouts.append(layout)
            for i, name in enumerate(names[g]):
                self.layer_index[name] = len(self.layer_slots)
                self.layer_slots.append((g, i))
            self.kv_heads = layout.kv_heads(caches[0])
        self.groups = groups

    def decide(self, runner: Any, rid: str) -> EvictingRequest | None:
        """Whether ``rid`` evicts (once), as the scheduler decided it."""
        if rid in self.requests:
            return self.requests[rid]
        known = adapter.new_request(runner, rid)
        request = None
        if known is not None:
            try:
                asked = self.settings.for_request(known[1], known[0])
            except Exception:
                asked = None  # the scheduler refused it the same way: it runs dense
            if asked is not None:
                from sparseety.policies.registry import build_policy

                key = asked.key()
                if key not in self.policies:
                    policy = self.policies[key] = build_policy(asked.policy, asked.budget, asked.options)
                    try:  # as the scheduler bound it; if that fails here, its compactions keep the newest tokens
                        policy.bind(checkpoint_model(adapter.model_path(runner)))
                    except Exception as exc:
                        self.unbound[key] = f"binding {asked.policy} to the model failed: {exc!r}"
                request = EvictingRequest(rid, self.policies[key], known[0], len(self.layer_slots), self.kv_heads,
                                          trace=self.trace, failure=self.unbound.get(key))
        self.requests[rid] = request
        return request

    def reader(self, blocks: list[torch.Tensor]) -> Any:
        """``read(layer, n, values)``: the first ``n`` keys (or values) ``[kv_heads, n, D]`` in ``layer`` of the
        request whose block ids per group are ``blocks``."""
        groups = self.groups
        assert groups is not None
        indices: dict[tuple[int, int, bool], torch.Tensor] = {}  #: one slot index per group, read size and half

        def read(layer: int, n: int, values: bool) -> torch.Tensor:
            g, i = self.layer_slots[layer]
            kv = groups[g][0][i]
            index = indices.get((g, n, values))
            if index is None:
                slots = torch.arange(n, device=kv.device)
                index = indices[g, n, values] = slot_index(blocks[g], slots, self.layouts[g],
                                                            self.layouts[g].kv_heads(kv), values)
            return read_slots(kv, blocks[g], n, self.layouts[g], values, index)
        return read

    # -- one forward -----------------------------------------------------------------------------------------
    def plan(self, runner: Any, positions: Any) -> None:
        """This forward's rows ``[s, e)`` of each evicting request, the position after its last row and the slots
        it will hold."""
        self.step = []
        rids = adapter.batch_requests(runner)
        if not rids:
            return
        self.ensure_layers(runner)
        starts = adapter.query_starts(runner)
        flat = positions if positions.dim() == 1 else positions[0]
        for index, rid in enumerate(rids):
            request = self.decide(runner, rid)
            s, e = int(starts[index]), int(starts[index + 1])
            if request is None or e <= s:
                continue
            end = int(flat[e - 1]) + 1
            read = self.reader(_tensors(adapter.request_blocks(runner, rid) or []))
            self.step.append((request, s, e, end, end - self.offsets.get(rid, 0), read))
        self.wants_hidden = any(r.policy.needs_hidden for r, *_ in self.step)

    def take_hidden(self, name: str, hidden: Any) -> None:
        """The hidden states ``[tokens, D]`` entering attention layer ``name`` in this forward (read-only)."""
        layer = self.layer_index.get(name)
        if layer is not None and isinstance(hidden, torch.Tensor):
            self.hidden[layer] = hidden

    def layer(self, attn_layer: Any, query: Any, shape: Any) -> None:
        """Inside one layer's ``forward``: score each evicting request's slots from its new query rows (and the
        hidden states entering the layer, for a policy that reads them)."""
        layer = self.layer_index.get(adapter.layer_name(attn_layer))
        if layer is None:
            return
        hidden = self.hidden.pop(layer, None)
        for request, s, e, end, n, read in self.step:
            rows = query[s:e].view(e - s, shape.num_heads, -1)
            try:
                request.observe(layer, rows, end, n, shape.scale, read, None if hidden is None else hidden[s:e])
            except Exception as exc:  # its compaction falls back to the newest tokens
                request.failure = request.failure or f"scoring failed: {exc!r}"

    def after_forward(self) -> None:
        for request, _s, _e, end, _n, _read in self.step:
            request.finish_forward(end)
        self.step, self.hidden, self.wants_hidden = [], {}, False

    def outbox(self) -> StepReport | None:
        """What the scheduler learns after this step (on the ``ModelRunnerOutput``): each request's evicted slots
        since the last step and the requests whose compaction fell back; None when there is nothing."""
        evicted = {rid: EvictedSlots.of_rows(rows) for rid, r in self.requests.items()
                   if r is not None and (rows := r.take_evicted())}
        if not evicted and not self.failed:
            return None
        failed, self.failed = self.failed, {}
        return StepReport(evicted, failed)

    # -- compactions, before a step ------------------------------------------------------------------------------
    def before_update(self, runner: Any, message: StepOrders | None, finished: Any) -> bool:
        """Carry out the scheduler's ``message`` (orders, offsets, resets) before vLLM updates the batch; True."""
        for rid in finished:
            self.requests.pop(rid, None)
        message = message or StepOrders()
        self.offsets = dict(message.offset)
        for rid in message.reset:
            request = self.requests.get(rid)
            if request is not None:
                request.reset()
        for order in message.compact:
            self.carry_out(runner, order)
        return True

    def cut_only(self, runner: Any, message: StepOrders) -> None:
        """When :meth:`before_update` failed: each ordered request's blocks past those it keeps leave its block
        table (the scheduler already gave them to others), its offset holds, and it stops evicting."""
        self.offsets = dict(message.offset)
        for order in message.compact:
            self._cut(runner, order.rid, order.kept)
            request = self.requests.get(order.rid)
            if request is not None:
                self.failed.setdefault(order.rid, "its compaction failed; it keeps its oldest slots")

    def _cut(self, runner: Any, rid: str, kept: int) -> None:
        block_lists = adapter.request_blocks(runner, rid)
        for g, block_size in enumerate(adapter.group_block_sizes(runner)):
            kept_blocks = -(-kept // block_size)
            if block_lists is not None:
                del block_lists[g][kept_blocks:]
            adapter.truncate_row(runner, rid, g, kept_blocks)

    def carry_out(self, runner: Any, order: Compaction) -> None:
        """Keep ``order.kept`` of the request's slots in every layer, in place, and cut its blocks."""
        request = self.requests.get(order.rid)
        block_lists = adapter.request_blocks(runner, order.rid)
        if block_lists is None:  # not in this worker's batch: no block table to cut
            return
        if request is None:  # never decided (its plan failed): keep the oldest slots, but the freed blocks go
            self._cut(runner, order.rid, order.kept)
            self.failed.setdefault(order.rid, "the worker never followed its policy; it keeps its oldest slots")
            return
        self.ensure_layers(runner)
        assert self.groups is not None
        blocks = _tensors(block_lists)
        try:
            src, dst = request.moves(order.logical, order.physical, order.kept, self.reader(blocks))
            if request.failure is not None and not request.warned:
                request.warned = True
                self.failed[order.rid] = request.failure
                log.warning("sparseety: request %s keeps its newest tokens instead of %s's choice: %s", order.rid,
                            request.policy.name, request.failure)
            start = 0
            for g, (caches, _block_size, _layer) in enumerate(self.groups):
                stop = start + len(caches)
                compact(caches, blocks[g], (src[start:stop], dst[start:stop]), self.layouts[g])
                start = stop
        finally:  # whatever happened, the blocks the scheduler freed leave the block table
            self._cut(runner, order.rid, order.kept)
