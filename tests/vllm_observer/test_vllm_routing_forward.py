"""With several API servers, API server 0's routing consumer forwards the MoE routing of requests another
API server owns to that server, counted once: real ZMQ sockets on ipc paths and the plugin's wire, no vLLM."""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
from prometheus_client import CollectorRegistry

from sparseety.integrations.vllm.observe.routing_consumer import RoutingConsumer, RoutingMetrics
from sparseety.integrations.vllm.transport.channels import CHANNEL_ENV, client_channel, routing_channel
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api.wire_messages import MoeShape, RouteResult


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_another_api_servers_request_is_forwarded_to_it_and_counted_once(tmp_path, monkeypatch):
    base = f"ipc://{tmp_path}/sparseety-test.sock"
    monkeypatch.setenv(CHANNEL_ENV, base)
    registries = [CollectorRegistry(), CollectorRegistry()]
    owners = OrderedDict({"theirs": 1})
    first = RoutingConsumer(base, metrics=RoutingMetrics(registries[0]), owners=owners)
    second = RoutingConsumer(client_channel(1, base), metrics=RoutingMetrics(registries[1]))
    worker = WireSender(lambda _client: routing_channel(base), linger_ms=1000)
    counts = np.array([[3, 1, 0, 0], [2, 2, 0, 0]], dtype=np.int64)
    try:
        worker.send([RouteResult(req_id, (0, 1), 4, 2, counts.tobytes()) for req_id in ("ours", "theirs")])
        _wait(lambda: "theirs" in second.results and "ours" in first.results)
        assert "theirs" not in first.results and "ours" not in second.results and not owners
        assert second.moe == MoeShape((0, 1), 4, 2) and first.forwarded == 1
        assert second.results["theirs"].counted and not first.results["ours"].counted
        counted = [r.get_sample_value("sparseety:moe_expert_tokens_total", {"layer": "0", "expert": "0"})
                   for r in registries]
        assert counted == [6.0, None], counted  # both requests counted once, where they arrived first
    finally:
        first.close()
        second.close()
