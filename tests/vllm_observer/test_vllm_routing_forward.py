"""With several API servers, API server 0's routing consumer forwards the MoE routing of requests another
API server owns to that server, counted once: real ZMQ sockets on ipc paths, in the vLLM side venv (which
has ZMQ and msgspec); no vLLM server."""

from __future__ import annotations

import textwrap

from test_vllm_never_down import _run

SCRIPT = textwrap.dedent('''
    import os, sys, tempfile, time
    from collections import OrderedDict

    import msgspec, numpy as np, zmq
    from prometheus_client import CollectorRegistry

    from sparseety.integrations.vllm.transport.channels import CHANNEL_ENV, client_channel, routing_channel
    from sparseety.integrations.vllm.observe.routing_consumer import RoutingConsumer, RoutingMetrics

    base = f"ipc://{tempfile.mkdtemp()}/sparseety-test.sock"
    os.environ[CHANNEL_ENV] = base

    def wait(predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)

    registries = [CollectorRegistry(), CollectorRegistry()]
    owners = OrderedDict({"theirs": 1})
    first = RoutingConsumer(base, metrics=RoutingMetrics(registries[0]), owners=owners)
    second = RoutingConsumer(client_channel(1, base), metrics=RoutingMetrics(registries[1]))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(routing_channel(base))
    counts = np.array([[3, 1, 0, 0], [2, 2, 0, 0]], dtype=np.int64)
    for req_id in ("ours", "theirs"):
        push.send(msgspec.msgpack.encode(["route", {"req_id": req_id, "layers": [0, 1], "experts": 4,
                                                    "top_k": 2, "counts": counts.tobytes()}]))
    wait(lambda: "theirs" in second.results and "ours" in first.results)
    assert "theirs" not in first.results and "ours" not in second.results and not owners
    assert second.moe == {"layers": [0, 1], "experts": 4, "top_k": 2} and first.forwarded == 1
    counted = [r.get_sample_value("sparseety:moe_expert_tokens_total", {"layer": "0", "expert": "0"})
               for r in registries]
    assert counted == [6.0, None], counted  # both requests counted once, where they arrived first
    push.close(0)
    first.close()
    second.close()
    print("ok")
''')


def test_another_api_servers_request_is_forwarded_to_it_and_counted_once():
    _run(SCRIPT)
