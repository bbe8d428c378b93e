"""Inside vLLM's worker: the MoE routing of every request, and each token's routing for sampled requests.

The ``moe-routing`` hook wraps ``FusedMoERouter.select_experts(hidden_states, router_logits, ...)`` (the call
that turns one MoE layer's router logits into the top-k expert ids and weights vLLM then runs; ``CPURouter``
on CPU, the GPU routers alike), the model runner's ``_model_forward`` (which rows of the batch belong to
which request) and ``_on_request_state_removed`` (the request is done: send what it routed).

- Every request: each MoE layer's top-k ids of the forward are kept (a reference; a copy on an accelerator,
  where a router might reuse its buffer); after the forward one ``torch.bincount`` on the device that holds
  them, over ``(layer * (requests + 1) + request of the row) * experts + expert id``, gives a
  ``[layers, requests + 1, experts]`` count, and one copy of it adds to each request's ``[layers, experts]``.
- Sampled requests (the store's request-id hash at ``SPARSEETY_SAMPLE_RATE``, tier >= 2, or
  ``vllm_xargs`` ``{"sparseety_tier": 3}``; as the importance capture decides): their rows of the router
  logits and of the top-k weights and ids vLLM chose, copied on the device, per layer and forward; moved
  to the CPU once, when the request is removed (softmax as SparSEEty's own probe takes it).

One :class:`.wire_messages.RouteResult` per request goes to the API server when vLLM removes it, over its own
channel beside the scheduler channel (:func:`.channels.routing_channel`; PUSH, non-blocking, bounded), and
one :class:`.wire_messages.MoeShape` at the first forward that routed. ``SPARSEETY_ROUTING=off`` turns all of it off. A
model that is compiled (``torch.compile``, i.e. vLLM without ``--enforce-eager`` on CPU) traces through the
router; the wrapper then records nothing (``torch.compiler.is_compiling()``). This module imports neither
vLLM nor torch at import time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.observe.attention_capture import TIER_ARG
from sparseety.integrations.vllm.vllm_api.ids import external_id, layer_number
from sparseety.integrations.vllm.transport.channels import routing_channel
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api.guards import guarded
from sparseety.integrations.vllm.vllm_api.wire_messages import Message, MoeShape, RouteResult

log = logging.getLogger("sparseety.vllm")
HOOK = "moe-routing"
SEND_HWM = 256  #: results queued before the worker's sends drop (counted)
ROUTING_ENV = "SPARSEETY_ROUTING"


def routing_on(env: dict[str, str] | None = None) -> bool:
    """``SPARSEETY_ROUTING``: ``off`` (or ``0``, ``false``, ``no``) turns the routing capture off; default on."""
    raw = (os.environ if env is None else env).get(ROUTING_ENV, "on").strip().lower()
    return raw not in ("off", "0", "false", "no")


class RequestRouting:
    """One sampled request's routing rows, held on the device until vLLM removes the request.

    ``rows[slot]`` lists ``(first position, logits [n, experts], weights [n, k], ids [n, k])`` per forward.
    """

    def __init__(self, req_id: str, layers: int, tier: int) -> None:
        self.req_id = req_id
        self.tier = tier
        self.rows: list[list[tuple[int, Any, Any, Any]]] = [[] for _ in range(layers)]

    def add(self, slot: int, p0: int, logits: Any, weights: Any, ids: Any) -> None:
        import torch

        self.rows[slot].append((p0, logits.to(torch.float32, copy=True), weights.to(torch.float32, copy=True),
                                ids.to(torch.int64, copy=True)))

    def arrays(self) -> dict[str, Any] | None:
        """``probs`` ``[layers, width, experts]`` float32 (softmax of the router logits), ``ids`` and
        ``weights`` ``[layers, width, k]`` (best first), ``written`` ``[width]``; a position computed twice
        (a preempted request) keeps its last row. None when no row was captured."""
        import torch

        width = max((p0 + lg.shape[0] for rows in self.rows for p0, lg, _, _ in rows), default=0)
        if not width:
            return None
        experts = next(lg.shape[1] for rows in self.rows for _, lg, _, _ in rows)
        k = next(ids.shape[1] for rows in self.rows for _, _, _, ids in rows)
        layers = len(self.rows)
        probs = np.full((layers, width, experts), np.nan, dtype=np.float32)
        ids = np.full((layers, width, k), -1, dtype=np.int32)
        weights = np.full((layers, width, k), np.nan, dtype=np.float32)
        written = np.zeros(width, dtype=np.uint8)
        for slot, rows in enumerate(self.rows):
            for p0, lg, w, i in rows:
                n = lg.shape[0]
                order = torch.sort(w, dim=-1, descending=True, stable=True).indices
                probs[slot, p0 : p0 + n] = torch.softmax(lg, dim=-1).cpu().numpy()
                weights[slot, p0 : p0 + n] = torch.gather(w, 1, order).cpu().numpy()
                ids[slot, p0 : p0 + n] = torch.gather(i, 1, order).cpu().numpy()
                written[p0 : p0 + n] = 1
        return {"width": width, "probs": probs, "ids": ids, "weights": weights, "written": written}


class RoutingCapture:
    """The worker's routing state: MoE layers, sampling decisions, the step plan, per-request counts."""

    def __init__(self) -> None:
        from sparseety.integrations.vllm.transport.settings import parse_settings

        settings = parse_settings()
        self.trace = bool(settings.trace_dir) and not settings.problems and settings.tier >= 2
        self.rate = settings.sample_rate
        self.tier = settings.tier
        self.found = False  #: the model's MoE layers were looked for (at the first forward)
        self.slots: dict[int, int] = {}  #: id(router) -> its layer's slot (slots ordered by layer number)
        self.layers: list[int] = []  #: layer number of each slot
        self.experts = 0
        self.top_k = 0
        self.announced = False
        self.decisions: dict[str, RequestRouting | None] = {}
        self.totals: dict[str, np.ndarray] = {}  #: request id -> ``[layers, experts]`` tokens routed
        self.reqs: list[str] | None = None  #: this forward's requests, in row order (None: nothing to count)
        self.starts: np.ndarray | None = None
        self.sampled: list[tuple[RequestRouting, int, int, int]] = []  #: (capture, first row, end row, p0)
        self.acc: list[tuple[int, Any]] | None = None  #: this forward's ``(slot, ids [rows, k])`` per MoE layer
        self.channel = os.environ.get("SPARSEETY_VLLM_CHANNEL")
        self._sender: WireSender | None = None

    # -- sending -------------------------------------------------------------------------------------------
    def send(self, message: Message) -> None:
        """Send ``message`` to API server 0's routing channel (non-blocking; nothing without a channel)."""
        if not self.channel:
            return
        if self._sender is None:
            self._sender = WireSender(lambda _client: routing_channel(self.channel), hwm=SEND_HWM, linger_ms=2000)
        self._sender.send([message])

    # -- per forward ---------------------------------------------------------------------------------------
    def discover(self, runner: Any) -> None:
        """Number the model's MoE layers (once, at the first forward)."""
        self.found = True
        found = []
        for name, router in adapter.moe_routers(runner):
            number = layer_number(name)
            if number is not None:
                found.append((number, router))
        found.sort(key=lambda item: item[0])
        self.layers = [number for number, _ in found]
        self.slots = {id(router): slot for slot, (_, router) in enumerate(found)}
        if found:
            log.info("sparseety: expert routing of vLLM requests over %d MoE layers", len(found))

    def decide(self, runner: Any, req_id: str) -> RequestRouting | None:
        """Sample ``req_id`` (once), as the importance capture does."""
        from sparseety.store.sampling import should_sample

        capture = None
        known = adapter.new_request(runner, req_id)
        if self.trace and known is not None:
            forced = str(known[1].get(TIER_ARG, "")).strip() == "3"
            if forced or should_sample(external_id(req_id), self.rate):
                capture = RequestRouting(req_id, len(self.layers), 3 if forced else self.tier)
        self.decisions[req_id] = capture
        return capture

    def plan(self, runner: Any, positions: Any) -> None:
        """This forward's requests and rows; the sampled requests' rows and first positions."""
        if not self.found:
            self.discover(runner)
        self.reqs, self.sampled, self.acc = None, [], None
        if not self.layers:
            return
        reqs = adapter.batch_requests(runner)
        if not reqs:
            return
        self.reqs = reqs
        self.starts = np.asarray(adapter.query_starts(runner)[: len(reqs) + 1], dtype=np.int64).copy()
        flat = None
        for index, req_id in enumerate(reqs):
            capture = self.decisions[req_id] if req_id in self.decisions else self.decide(runner, req_id)
            s, e = int(self.starts[index]), int(self.starts[index + 1])
            if capture is not None and e > s:
                flat = flat if flat is not None else (positions if positions.dim() == 1 else positions[0])
                self.sampled.append((capture, s, e, int(flat[s])))

    def route(self, router: Any, logits: Any, weights: Any, ids: Any) -> None:
        """One MoE layer's routing of this forward (inside ``select_experts``)."""
        slot = self.slots.get(id(router))
        if slot is None or self.reqs is None:
            return
        if self.acc is None:
            self.acc = []
            self.experts = int(logits.shape[-1])
        self.acc.append((slot, ids if ids.device.type == "cpu" else ids.clone()))
        for capture, s, e, p0 in self.sampled:
            capture.add(slot, p0, logits[s:e], weights[s:e], ids[s:e])

    def after_forward(self) -> None:
        """Add this forward's counts to each request's (one bincount, one copy of ``[layers, requests,
        experts]``)."""
        if not self.acc or self.reqs is None:
            return
        import torch

        n, layers, experts = len(self.reqs), len(self.layers), self.experts
        slots = [slot for slot, _ in self.acc]
        ids = torch.stack([i for _, i in self.acc]).to(torch.int64)  # [layers seen, rows, k]
        rows = int(ids.shape[1])
        self.top_k = int(ids.shape[2])
        owner = np.full(rows, n, dtype=np.int64)  # rows past the batch's (padding) count for no request
        for i in range(n):
            owner[min(self.starts[i], rows): min(self.starts[i + 1], rows)] = i
        offset = (np.asarray(slots, dtype=np.int64)[:, None] * (n + 1) + owner[None, :]) * experts
        flat = (torch.from_numpy(offset).to(ids.device)[:, :, None] + ids).flatten()
        counts = torch.bincount(flat, minlength=layers * (n + 1) * experts).view(layers, n + 1, experts)
        counts = counts[:, :n].cpu().numpy()
        for i, req_id in enumerate(self.reqs):
            held = self.totals.get(req_id)
            if held is None:
                self.totals[req_id] = counts[:, i].copy()
            else:
                held += counts[:, i]
        if not self.announced:
            self.announced = True
            self.send(MoeShape(tuple(self.layers), self.experts, self.top_k))

    def finish(self, req_id: str) -> None:
        """vLLM removed ``req_id``: send its counts (and a sampled request's rows)."""
        capture = self.decisions.pop(req_id, None)
        counts = self.totals.pop(req_id, None)
        if counts is None and capture is None:
            return
        counts = counts if counts is not None else np.zeros((len(self.layers), self.experts), dtype=np.int64)
        rows = capture.arrays() if capture is not None else None
        sampled = {} if rows is None else {
            "tier": capture.tier, "width": int(rows["width"]), "probs": rows["probs"].tobytes(),
            "ids": rows["ids"].tobytes(), "weights": rows["weights"].tobytes(), "written": rows["written"].tobytes()}
        self.send(RouteResult(req_id, tuple(self.layers), self.experts, self.top_k,
                              counts.astype(np.int64).tobytes(), **sampled))


_CAPTURE: RoutingCapture | None = None


def capture() -> RoutingCapture:
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = RoutingCapture()
    return _CAPTURE


def _compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def install(loud: bool) -> None:
    """Install the ``moe-routing`` hook (nothing when ``SPARSEETY_ROUTING=off`` or a need is missing)."""
    if not routing_on():
        return
    if not adapter.check((HOOK,), loud=loud)[HOOK]:
        return
    runner = adapter.resolve(adapter.RUNNER)
    router = adapter.resolve(adapter.MOE_ROUTER)

    def make_forward(forward):
        def _model_forward(self, *args, **kwargs):
            state = capture()
            guarded(HOOK, state.plan, self, adapter.arg(args, kwargs, 1, "positions"))
            try:
                return forward(self, *args, **kwargs)
            finally:
                if state.acc:
                    guarded(HOOK, state.after_forward)
                state.reqs, state.acc = None, None
        return _model_forward

    def make_removed(removed):
        def _on_request_state_removed(self, *args, **kwargs):
            result = removed(self, *args, **kwargs)
            state = _CAPTURE
            if state is not None and state.layers:
                guarded(HOOK, state.finish, adapter.arg(args, kwargs, 0, "req_id"))
            return result
        return _on_request_state_removed

    def make_select(select):
        def select_experts(self, *args, **kwargs):
            result = select(self, *args, **kwargs)
            state = _CAPTURE
            if state is not None and state.reqs is not None and not _compiling():
                guarded(HOOK, state.route, self, adapter.arg(args, kwargs, 1, "router_logits"), result[0], result[1])
            return result
        return select_experts

    adapter.patch(runner, "_model_forward", HOOK, make_forward)
    adapter.patch(runner, "_on_request_state_removed", HOOK, make_removed)
    adapter.patch(router, "select_experts", HOOK, make_select)
