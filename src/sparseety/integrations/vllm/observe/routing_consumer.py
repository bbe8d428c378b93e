"""In the API server: the worker's MoE routing, counted in the ``sparseety:`` metrics and put into each record.

:mod:`.routing_capture` (in vLLM's worker) sends a :class:`.wire_messages.MoeShape` at its first routed
forward and a :class:`.wire_messages.RouteResult` for every request when vLLM removes it, to API server 0's routing channel
(:func:`.channels.routing_channel`). Each API server's :class:`RoutingConsumer` binds the PULL end of
its own routing channel (a :class:`..transport.wire.WireInbox`); API server 0's forwards the results of requests another
API server owns (the scheduler names the owner, ``--api-server-count > 1``) to that server's routing
channel, marked as counted, after the model's shape. Every request is counted once, where it arrives first:

- counts each request's routed tokens as they come, ``sparseety:moe_expert_tokens_total{layer, expert}``
  (tokens times top-k per layer over all experts), and sets ``sparseety:moe_load_imbalance{layer}`` (the
  busiest expert's tokens over the mean of all experts, over every request so far);
- keeps the results (bounded) until the finisher takes them (:meth:`attach`), which waits at most
  :func:`.importance.wait_s` for a finished request's result once the worker has said the model is MoE
  (:meth:`pending`).

What a record gets (:meth:`attach`): ``extra_json.vllm.moe`` for every request (``layers``, ``experts``,
``top_k``, ``expert_tokens`` ``[layers][experts]``, ``tokens`` routed per layer, ``load_imbalance`` per
layer); for a sampled request also the arrays ``router.{layer}`` ``[positions, experts]`` float16 (router
probabilities, as SparSEEty's own engine writes them), ``route.ids`` ``[moe layers, positions, top_k]``
int64 and ``route.weights`` float32 (the experts vLLM ran and the weights it gave them, best first; -1 and
NaN at positions the request did not compute, e.g. prompt positions read from the prefix cache), and the
``experts`` of its per-layer important tokens (the top-k ``[expert_id, prob]`` of that layer's
``router.{layer}`` row, as SparSEEty's route extraction lists them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from sparseety.integrations.vllm.transport.channels import forward_endpoint, routing_channel
from sparseety.integrations.vllm.transport.metrics import P
from sparseety.integrations.vllm.transport.record import VllmRun
from sparseety.integrations.vllm.transport.wire import WireInbox, WireSender
from sparseety.integrations.vllm.vllm_api.wire_messages import Message, MoeShape, RouteResult

log = logging.getLogger("sparseety.vllm")


class RoutingMetrics:
    """``sparseety:moe_expert_tokens_total{layer, expert}`` and ``sparseety:moe_load_imbalance{layer}``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.expert_tokens = Counter(P + "moe_expert_tokens", "Tokens an MoE layer routed to an expert "
                                     "(each token counts once for each of its top-k experts).",
                                     ["layer", "expert"], registry=registry)
        self.imbalance = Gauge(P + "moe_load_imbalance", "Tokens routed to an MoE layer's busiest expert over "
                               "the mean of its experts, over every request so far (1: even).", ["layer"],
                               registry=registry, multiprocess_mode="max")


_METRICS: RoutingMetrics | None = None


def routing_metrics() -> RoutingMetrics:
    """The process's routing metric families (registered on first use)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = RoutingMetrics()
    return _METRICS


def imbalance(counts: np.ndarray) -> list[float]:
    """Per layer of ``counts`` ``[layers, experts]``: max over mean (0 when the layer routed nothing)."""
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean(axis=-1)
    return [round(float(m / a), 4) if a > 0 else 0.0 for m, a in zip(counts.max(axis=-1), mean, strict=True)]


def routing_expected(model_path: str | None) -> bool:
    """Whether the served checkpoint is a mixture of experts (its ``config.json`` names a number of
    experts), so that a request's routing is waited for even before the worker has said the model is MoE
    (an API server other than 0 hears it only with its first forwarded request)."""
    import json

    from sparseety.integrations.vllm.observe.routing_capture import routing_on

    if not model_path or not routing_on():
        return False
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    return any(int(config.get(key) or 0) > 1 for key in ("num_local_experts", "num_experts", "n_routed_experts"))


class RoutingConsumer:
    """The worker's routing results for this API server (only API server 0 receives them)."""

    def __init__(self, channel: str | None, limit: int = 4096, metrics: RoutingMetrics | None = None,
                 owners: OrderedDict[str, int] | None = None) -> None:
        self.endpoint = routing_channel(channel) if channel else None
        self.limit = limit
        self.metrics = metrics
        self.owners = owners  #: API server 0: request id -> the API server that owns it (the scheduler's)
        self.expected = False  #: the served checkpoint is MoE (:func:`routing_expected`): wait for results
        self._forward = WireSender(forward_endpoint(routing_channel))
        self._shape_sent: set[int] = set()  #: API servers told the model's shape
        self.forwarded = 0
        self.moe: MoeShape | None = None  #: the worker's model shape (None: not MoE, or not heard yet)
        self.results: OrderedDict[str, RouteResult] = OrderedDict()
        self.totals: np.ndarray | None = None  #: ``[layers, experts]`` over every request so far
        self.dropped = 0
        self._lock = threading.Lock()
        self.inbox = WireInbox(self.endpoint, {MoeShape: self.on_moe, RouteResult: self.on_route},
                               name="routing", hwm=1000) if self.endpoint else None

    # -- receiving -------------------------------------------------------------------------------------------
    def on_moe(self, messages: list[MoeShape]) -> None:
        self.moe = messages[-1]

    def on_route(self, messages: list[RouteResult]) -> None:
        """Requests' routing from the worker (or, forwarded and counted, from API server 0)."""
        for body in messages:
            if not body.counted:
                self.count(body)
            client = self.owners.pop(body.req_id, 0) if self.owners else 0
            if client > 0:
                self._send(client, body)
                continue
            with self._lock:
                self.results[body.req_id] = body
                while len(self.results) > self.limit:
                    self.results.popitem(last=False)
                    self.dropped += 1

    def count(self, body: RouteResult) -> None:
        """Count one request's routed tokens in the metrics (and the running totals the gauge reads)."""
        layers = list(body.layers)
        counts = np.frombuffer(body.counts, dtype=np.int64).reshape(len(layers), body.experts)
        if self.moe is None:
            self.moe = MoeShape(body.layers, body.experts, body.top_k)
        self.totals = counts.copy() if self.totals is None or self.totals.shape != counts.shape else self.totals + counts
        m = self.metrics or routing_metrics()
        for row, layer in enumerate(layers):
            for expert in np.flatnonzero(counts[row]):
                m.expert_tokens.labels(layer=str(layer), expert=str(int(expert))).inc(int(counts[row, expert]))
        for layer, value in zip(layers, imbalance(self.totals), strict=True):
            m.imbalance.labels(layer=str(layer)).set(value)

    def _send(self, client: int, body: RouteResult) -> None:
        """Forward one counted result to API server ``client`` (after the model's shape, once)."""
        messages: list[Message] = [replace(body, counted=True)]
        if client not in self._shape_sent and self.moe is not None:
            self._shape_sent.add(client)
            messages.insert(0, self.moe)
        before = self._forward.dropped
        self._forward.send(messages, client)
        if self._forward.dropped > before:
            self.dropped += 1
        else:
            self.forwarded += 1

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()

    # -- the finisher's side ---------------------------------------------------------------------------------
    def pending(self, internal_id: str, finished_at: float, now: float | None = None) -> bool:
        """True while the model is MoE and ``internal_id``'s result may still come (at most :func:`.importance.wait_s`)."""
        from sparseety.integrations.vllm.observe.importance import wait_s

        now = time.monotonic() if now is None else now
        if (self.moe is None and not self.expected) or now - finished_at >= wait_s():
            return False
        with self._lock:
            return internal_id not in self.results

    def take(self, internal_id: str) -> RouteResult | None:
        with self._lock:
            return self.results.pop(internal_id, None)

    def attach(self, run: VllmRun, internal_id: str) -> dict[str, Any] | None:
        """Put the request's routing into ``run`` (arrays for a sampled request, the experts of its
        per-layer important tokens); returns ``extra_json.vllm.moe`` (None: not an MoE model)."""
        if self.moe is None and not self.expected:
            return None
        result = self.take(internal_id)
        if result is None:
            shape = {"layers": list(self.moe.layers), "experts": self.moe.experts, "top_k": self.moe.top_k} \
                if self.moe is not None else {}
            return {"status": "lost", **shape}
        layers = list(result.layers)
        experts, k = result.experts, result.top_k
        counts = np.frombuffer(result.counts, dtype=np.int64).reshape(len(layers), experts)
        info: dict[str, Any] = {
            "status": "counted", "layers": layers, "experts": experts, "top_k": k,
            "expert_tokens": counts.tolist(), "tokens": [int(c) // max(k, 1) for c in counts.sum(axis=1)],
            "load_imbalance": imbalance(counts),
        }
        if result.tier is not None:
            info.update(routed_arrays(run, result, layers, experts, k))
        return info


def routed_arrays(run: VllmRun, result: RouteResult, layers: list[int], experts: int, k: int) -> dict[str, Any]:
    """A sampled request's ``router.{layer}``, ``route.ids`` and ``route.weights`` arrays and its important
    tokens' ``experts``, over the positions it fed (prompt, then each output but the last); the ``moe``
    info it adds."""
    width = result.width
    n_layers = len(layers)
    probs = np.frombuffer(result.probs, dtype=np.float32).reshape(n_layers, width, experts)
    ids = np.frombuffer(result.ids, dtype=np.int32).reshape(n_layers, width, k)
    weights = np.frombuffer(result.weights, dtype=np.float32).reshape(n_layers, width, k)
    written = np.frombuffer(result.written, dtype=np.uint8).astype(bool)
    seen = len(run.prompt_ids) + max(len(run.output_ids), 1) - 1

    def fit(a: np.ndarray, fill: float) -> np.ndarray:
        out = np.full((a.shape[0], seen, a.shape[2]), fill, dtype=a.dtype)
        n = min(seen, a.shape[1])
        out[:, :n] = a[:, :n]
        return out

    probs, ids, weights = fit(probs, np.nan), fit(ids, -1), fit(weights, np.nan)
    for slot, layer in enumerate(layers):
        run.arrays[f"router.{layer}"] = probs[slot].astype(np.float16)
    run.arrays["route.ids"] = ids.astype(np.int64)
    run.arrays["route.weights"] = weights
    slot_of = {layer: slot for slot, layer in enumerate(layers)}
    for record in run.important_tokens:
        slot = slot_of.get(record.layer) if record.layer is not None else None
        if slot is None or not 0 <= record.position < seen:
            continue
        row = run.arrays[f"router.{layers[slot]}"][record.position].astype(np.float32)
        if np.isnan(row).any():
            continue
        order = np.argsort(-row, kind="stable")[:k]
        record.experts = [[int(e), float(row[e])] for e in order]
    computed = int(written[:seen].sum())
    run.tier = max(int(run.tier), result.tier if result.tier is not None else 2)
    return {"status": "recorded", "positions": computed, "uncomputed_positions": seen - computed}
