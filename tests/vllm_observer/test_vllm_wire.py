"""The one wire between vLLM's processes and the observer (:mod:`sparseety.integrations.vllm.transport.wire`),
without vLLM: every message kind of :mod:`~sparseety.integrations.vllm.vllm_api.wire_messages` framed and read
back, frames that cannot be read counted and dropped (in the inbox's counts and in
``sparseety:wire_frames_dropped_total`` on the process's real prometheus registry), and real ZMQ PUSH/PULL sockets
on ipc paths in the test's folder.

The messages are the producers' own where there is one: an :class:`ImportanceResult` from a real
:class:`RequestCapture` fed small random tensors, an :class:`EvictionRecord` from a real :class:`EvictionLedger`
(and its refused record), a :class:`WindowPeak` and :class:`Groups` from a real :class:`WindowFrees` on stand-ins
with the attribute names of vLLM's KV-cache coordinator.
"""

from __future__ import annotations

import logging
import math
import os
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import zmq
from prometheus_client import REGISTRY

from sparseety.integrations.vllm.evict.ledger import EvictionLedger, refused_record
from sparseety.integrations.vllm.evict.orders import StepReport
from sparseety.integrations.vllm.observe.attention_capture import RequestCapture
from sparseety.integrations.vllm.observe.window_frees import WindowFrees
from sparseety.integrations.vllm.transport.channels import client_channel
from sparseety.integrations.vllm.transport.wire import WireError, WireInbox, WireSender, decode, encode
from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import (
    KINDS,
    CaptureStart,
    Chunk,
    Draft,
    EvictedSlots,
    EvictionRecord,
    Groups,
    ImportanceResult,
    KVHeld,
    MoeShape,
    Owner,
    PendingRow,
    RouteResult,
    StepRow,
    WindowFree,
    WindowPeak,
)

DROPPED = "sparseety:wire_frames_dropped_total"


# -- the producers' own messages ----------------------------------------------------------------------------
def captured(mode: str, tier: int) -> ImportanceResult:
    """A sampled request's result as the worker's capture builds it: a prompt of 8 prefilled in two chunks,
    then three decode steps (rows 7..10; 7..9 folded, 10 still pending)."""
    layers, heads, kv_heads, d = 2, 4, 2, 4
    g = torch.Generator().manual_seed(3)
    n = 11
    q = torch.randn(layers, n, heads, d, generator=g)
    k = torch.randn(layers, n, kv_heads, d, generator=g)
    v = torch.randn(layers, n, kv_heads, d, generator=g)
    cap = RequestCapture("cmpl-9-0a1b2c3d", tier=tier, mode=mode, prompt_len=8, layers=layers)
    for p0, count in ((0, 5), (5, 3), (8, 1), (9, 1), (10, 1)):
        rows = cap.begin(p0, count)
        for layer in range(layers):
            cap.write(layer, p0, k[layer, p0 : p0 + count], v[layer, p0 : p0 + count])
            if rows:
                cap.score(layer, p0, q[layer, p0 : p0 + count], rows, 1 / math.sqrt(d))
    return cap.result()


def ledger_record() -> EvictionRecord:
    """A request that kept 8 tokens per layer with ``tova``: compacted after its 12-token prompt and again 4
    tokens later, the worker reporting the slots it evicted each time."""
    ledger = EvictionLedger(interval=4)
    ledger.track("ev-1", 8, "tova")
    first = ledger.plan("ev-1", 12, 12)
    ledger.apply(first, freed_blocks=1)
    ledger.receive(StepReport({"ev-1": EvictedSlots.of_rows([[0, 0, 0, 3, 0.25], [0, 1, 1, 5, 0.125]])}))
    second = ledger.plan("ev-1", 16, 12)
    ledger.apply(second, freed_blocks=0)
    ledger.receive(StepReport({"ev-1": EvictedSlots.of_rows([[4, 1, 0, 9, 0.5]])}, {"ev-1": "scoring failed: boom"}))
    return ledger.forget("ev-1").record("ev-1")


NULL = object()


def window_messages() -> tuple[Groups, WindowPeak]:
    """A full-attention group and an 8-token sliding-window group (blocks of 4 tokens) over 20 steps."""
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(sliding_window=w, page_size_bytes=10, num_kv_heads=1),
                              layer_names=[f"model.layers.{2 * g + i}.self_attn.attn" for i in range(2)])
              for g, w in enumerate((None, 8))]
    managers = tuple(SimpleNamespace(req_to_blocks={}, _null_block=NULL) for _ in groups)
    coordinator = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
                                  single_type_managers=managers)
    frees = WindowFrees()
    for computed in range(20):
        nulls = frees.before(coordinator, "w-1")
        table = managers[1].req_to_blocks.get("w-1")
        if table is not None:  # vLLM's SlidingWindowManager.remove_skipped_blocks
            for i in range(min(max(0, computed - 8 + 1) // 4, len(table))):
                table[i] = NULL
        if nulls is not None:
            frees.after(coordinator, "w-1", computed, nulls)
        for manager in managers:
            table = manager.req_to_blocks.setdefault("w-1", [])
            while len(table) < -(-(computed + 1) // 4):
                table.append(object())
    peak = frees.finish(coordinator, "w-1")
    return frees.groups_message(), peak


def route_result(sampled: bool) -> RouteResult:
    counts = np.array([[3, 1, 0, 2], [0, 4, 2, 0]], dtype=np.int64)
    if not sampled:
        return RouteResult("moe-1", (1, 3), 4, 2, counts.tobytes())
    width = 3
    rng = np.random.default_rng(5)
    return RouteResult("moe-2", (1, 3), 4, 2, counts.tobytes(), tier=2, width=width,
                       probs=rng.random((2, width, 4), dtype=np.float32).tobytes(),
                       ids=np.array([[[0, 3], [1, 0], [3, 0]], [[1, 2], [2, 1], [1, 2]]], dtype=np.int32).tobytes(),
                       weights=rng.random((2, width, 2), dtype=np.float32).tobytes(),
                       written=np.array([1, 1, 0], dtype=np.uint8).tobytes(), counted=True)


GROUPS, PEAK = window_messages()
MESSAGES = {
    "chunk": Chunk("req-1", 512, 256),
    "owner": Owner("req-1", 2),
    "draft": Draft("req-1", 3, 14, (9, 10, 55), 2),
    "kv": KVHeld("req-1", 9000, 3),
    "window": PEAK,
    "window-no-frees": WindowPeak("req-2", 40, 2),
    "groups": GROUPS,
    "evict": ledger_record(),
    "evict-refused": refused_record("req-3", "kvzip", "kvzip needs a reconstruction pass of its own"),
    "start": CaptureStart("cmpl-9-0a1b2c3d"),
    "done-value-tier3": captured("value", 3),
    "done-attention": captured("attention", 2),
    "moe": MoeShape((1, 3), 4, 2),
    "route-counts": route_result(sampled=False),
    "route-sampled": route_result(sampled=True),
}


def test_the_producers_messages_are_what_the_tests_below_rely_on():
    """The real producers gave the nested and optional parts the round trip has to carry."""
    value, attention = MESSAGES["done-value-tier3"], MESSAGES["done-attention"]
    assert value.folded == (7, 8, 9) and [p.q for p in value.pending] == [10]
    assert [s.q for s in value.steps] == [7, 8, 9]
    assert value.attention is not None and value.pending[0].plain is not None
    assert attention.attention is None and attention.pending[0].plain is None and attention.steps == ()
    assert len(value.sums) == 4 * 2 * value.width and len(value.steps[0].row) == 2 * 2 * (7 + 1)  # f32, f16
    record = MESSAGES["evict"]
    assert (record.policy, record.budget, record.evicted_tokens_per_layer, record.compactions, record.peak_tokens,
            record.failure) == ("tova", 8, 8, 2, 12, "scoring failed: boom")
    assert record.slots == EvictedSlots((0, 0, 4), (0, 1, 1), (0, 1, 0), (3, 5, 9), (0.25, 0.125, 0.5))
    assert MESSAGES["evict-refused"].slots == EvictedSlots() and MESSAGES["evict-refused"].refused
    assert PEAK.frees == (WindowFree(11, 1, 1), WindowFree(15, 1, 1), WindowFree(19, 1, 1))
    assert GROUPS.groups == (KVGroup(0, None, 20, 1, (0, 1)), KVGroup(1, 8, 20, 1, (2, 3)))


def test_every_kind_is_covered_here():
    assert {type(m) for m in MESSAGES.values()} == set(KINDS.values())
    assert all(cls.KIND == kind and isinstance(cls.VERSION, int) for kind, cls in KINDS.items())


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_message_round_trips_equal_to_itself(name):
    message = MESSAGES[name]
    frames = encode([message])
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    kind, version, body = msgspec.msgpack.decode(frames[0])
    assert (kind, version, len(body)) == (type(message).KIND, type(message).VERSION, 1)
    back = decode(frames[0])
    assert back == [message] and type(back[0]) is type(message)


def test_nested_and_bytes_fields_come_back_as_their_types():
    result = decode(encode([MESSAGES["done-value-tier3"]])[0])[0]
    assert isinstance(result.pending[0], PendingRow) and isinstance(result.steps[0], StepRow)
    assert isinstance(result.sums, bytes) and isinstance(result.folded, tuple)
    np.testing.assert_array_equal(np.frombuffer(result.sums, np.float32),
                                  np.frombuffer(MESSAGES["done-value-tier3"].sums, np.float32))
    groups = decode(encode([GROUPS])[0])[0]
    assert all(isinstance(g, KVGroup) and isinstance(g.layers, tuple) for g in groups.groups)
    assert groups.groups[0].window is None and groups.groups[1].window == 8
    slots = decode(encode([MESSAGES["evict"]])[0])[0].slots
    assert isinstance(slots, EvictedSlots) and len(slots) == 3 and slots.score == (0.25, 0.125, 0.5)
    refused = decode(encode([MESSAGES["evict-refused"]])[0])[0]
    assert refused.failure is None and refused.budget == 0 and len(refused.slots) == 0


def test_one_frame_per_kind_in_first_seen_order_and_message_order_kept_inside():
    messages = [Chunk("a", 0, 8), KVHeld("a", 100, 1), Chunk("b", 0, 4), Draft("a", 1, 9, (5,), 1),
                Chunk("a", 8, 8), KVHeld("b", 200, 2)]
    frames = encode(messages)
    assert [decode(f) for f in frames] == [[Chunk("a", 0, 8), Chunk("b", 0, 4), Chunk("a", 8, 8)],
                                           [KVHeld("a", 100, 1), KVHeld("b", 200, 2)],
                                           [Draft("a", 1, 9, (5,), 1)]]
    assert encode([]) == []


def test_a_reader_ignores_fields_it_does_not_know_and_defaults_fields_an_older_sender_lacked():
    newer = msgspec.msgpack.encode(("chunk", 1, [{"req_id": "a", "start": 0, "tokens": 3, "added_later": [1, 2]}]))
    assert decode(newer) == [Chunk("a", 0, 3)]
    older = msgspec.msgpack.encode(("window", 1, [{"req_id": "a", "peak_bytes": 40, "peak_blocks": 2}]))
    assert decode(older) == [WindowPeak("a", 40, 2, ())]


def _frame(kind, version, body) -> bytes:
    return msgspec.msgpack.encode((kind, version, body))


CHUNK = {"req_id": "a", "start": 0, "tokens": 3}
BAD_FRAMES = {
    "unknown kind": ("unknown", _frame("chunks-v0", 1, [CHUNK])),
    "known kind, another version": ("unknown", _frame("chunk", Chunk.VERSION + 1, [CHUNK])),
    "an older version": ("unknown", _frame("done", ImportanceResult.VERSION - 1, [])),
    "a missing field": ("bad", _frame("chunk", 1, [{"req_id": "a", "start": 0}])),
    "an ill-typed field": ("bad", _frame("chunk", 1, [{"req_id": "a", "start": "zero", "tokens": 3}])),
    "a bool for an int": ("bad", _frame("kv", 1, [{"req_id": "a", "bytes": True, "blocks": 1}])),
    "an ill-typed nested field": ("bad", _frame("window", 1, [{"req_id": "a", "peak_bytes": 1, "peak_blocks": 1,
                                                              "frees": [{"computed": 1, "group": "g", "blocks": 1}]}])),
    "str for bytes": ("bad", _frame("route", 1, [{"req_id": "a", "layers": [1], "experts": 2, "top_k": 1,
                                                 "counts": "not bytes"}])),
    "messages not a list": ("bad", _frame("chunk", 1, CHUNK)),
    "a message not a map": ("bad", _frame("start", 1, ["a"])),
    "a frame of two items": ("bad", msgspec.msgpack.encode(("chunk", 1))),
    "a float version": ("bad", _frame("chunk", 1.0, [CHUNK])),
    "a map, not a frame": ("bad", msgspec.msgpack.encode({"kind": "chunk"})),
    "bytes that are not msgpack": ("bad", b"\xc1\xc1\xc1"),
    "a truncated frame": ("bad", encode([Chunk("a", 0, 3)])[0][:-2]),
    "empty bytes": ("bad", b""),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_decode_names_why_a_frame_cannot_be_read(case):
    reason, frame = BAD_FRAMES[case]
    with pytest.raises(WireError) as info:
        decode(frame)
    assert info.value.reason == reason


def _dropped(channel: str, reason: str) -> float:
    return REGISTRY.get_sample_value(DROPPED, {"channel": channel, "reason": reason}) or 0.0


def test_the_inbox_counts_and_drops_frames_it_cannot_read_and_goes_on(caplog):
    channel = "test-wire-drops"
    got: list = []
    inbox = WireInbox("ipc:///nonexistent/never-bound.sock", {Chunk: got.extend, CaptureStart: got.extend},
                      name=channel, start=False)
    before = {reason: _dropped(channel, reason) for reason in ("unknown", "bad", "failed")}
    want = {"unknown": 0, "bad": 0}
    with caplog.at_level(logging.WARNING, logger="sparseety.vllm"):
        assert inbox.receive(encode([Chunk("a", 0, 8)])[0]) is True
        for i, case in enumerate(sorted(BAD_FRAMES)):
            reason, frame = BAD_FRAMES[case]
            assert inbox.receive(frame) is False, case
            want[reason] += 1
            assert inbox.receive(encode([Chunk("a", 8 * (i + 1), 8)])[0]) is True, case  # the next one is handled
    assert got == [Chunk("a", 8 * i, 8) for i in range(len(BAD_FRAMES) + 1)]
    assert inbox.counts == {"received": len(BAD_FRAMES) + 1, "unknown": want["unknown"], "bad": want["bad"],
                            "failed": 0}
    assert {r: _dropped(channel, r) - before[r] for r in before} == {**want, "failed": 0}
    warned = [r.getMessage() for r in caplog.records if f"the {channel} channel dropped a frame" in r.getMessage()]
    assert len(warned) == 2  # one line per channel and reason, then only counted
    assert not inbox.thread.is_alive()  # start=False: no socket, no thread


def test_a_kind_without_a_handler_on_this_channel_is_unknown_here():
    channel = "test-wire-nohandler"
    got: list = []
    inbox = WireInbox("ipc:///nonexistent/x.sock", {CaptureStart: got.extend}, name=channel, start=False)
    before = _dropped(channel, "unknown")
    assert inbox.receive(encode([Chunk("a", 0, 8)])[0]) is False
    assert inbox.receive(encode([CaptureStart("a")])[0]) is True
    assert got == [CaptureStart("a")] and inbox.counts["unknown"] == 1 and inbox.counts["received"] == 1
    assert _dropped(channel, "unknown") - before == 1


def test_a_handler_that_raises_costs_its_frame_counted_and_the_next_frame_is_handled():
    channel = "test-wire-failed"
    got: list = []

    def handler(messages):
        if any(m.tokens < 0 for m in messages):
            raise ValueError("negative")
        got.extend(messages)

    inbox = WireInbox("ipc:///nonexistent/y.sock", {Chunk: handler}, name=channel, start=False)
    before = _dropped(channel, "failed")
    assert inbox.receive(encode([Chunk("a", 0, -1)])[0]) is False
    assert inbox.receive(encode([Chunk("b", 0, 4)])[0]) is True
    assert got == [Chunk("b", 0, 4)]
    assert inbox.counts == {"received": 1, "unknown": 0, "bad": 0, "failed": 1}
    assert _dropped(channel, "failed") - before == 1


# -- real sockets ---------------------------------------------------------------------------------------------
def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _close(sender: WireSender) -> None:
    sender.close()
    assert not sender._sockets


def test_a_sender_delivers_every_message_to_the_inbox_bound_on_an_ipc_path(tmp_path):
    endpoint = f"ipc://{tmp_path}/wire.sock"
    chunks: list = []
    results: list = []
    inbox = WireInbox(endpoint, {Chunk: chunks.extend, ImportanceResult: results.extend}, name="test-live")
    sender = WireSender(lambda _client: endpoint, linger_ms=1000)
    try:
        sender.send([Chunk("a", 0, 8), MESSAGES["done-value-tier3"], Chunk("a", 8, 4)])
        sender.send([Chunk("b", 0, 2)])
        _wait(lambda: len(chunks) == 3 and len(results) == 1)
        assert chunks == [Chunk("a", 0, 8), Chunk("a", 8, 4), Chunk("b", 0, 2)]
        assert results == [MESSAGES["done-value-tier3"]]
        assert (sender.sent, sender.dropped) == (4, 0)
        assert inbox.counts == {"received": 3, "unknown": 0, "bad": 0, "failed": 0} and inbox.error is None
        assert os.path.exists(f"{tmp_path}/wire.sock")
    finally:
        inbox.close()
        _close(sender)
    assert not inbox.thread.is_alive() and not os.path.exists(f"{tmp_path}/wire.sock")  # the socket file goes


def test_a_sender_sends_each_clients_messages_to_that_clients_channel(tmp_path):
    base = f"ipc://{tmp_path}/sched.sock"
    got: dict[int, list] = {0: [], 1: []}
    inboxes = [WireInbox(client_channel(c, base), {KVHeld: got[c].extend}, name="test-clients") for c in (0, 1)]
    asked: list[int] = []
    sender = WireSender(lambda client: asked.append(client) or client_channel(client, base), linger_ms=1000)
    try:
        sender.send([KVHeld("ours", 100, 1)], 0)
        sender.send([KVHeld("theirs", 200, 2)], 1)
        sender.send([KVHeld("theirs-2", 300, 3)], 1)
        _wait(lambda: len(got[0]) == 1 and len(got[1]) == 2)
        assert got == {0: [KVHeld("ours", 100, 1)], 1: [KVHeld("theirs", 200, 2), KVHeld("theirs-2", 300, 3)]}
        assert asked == [0, 1]  # one socket per client, opened on first use
    finally:
        for inbox in inboxes:
            inbox.close()
        _close(sender)


def test_a_sender_without_an_endpoint_counts_every_message_dropped_and_never_raises():
    asked: list[int] = []
    sender = WireSender(lambda client: asked.append(client))  # None: the plugin set no channel
    sender.send([Chunk("a", 0, 8), Chunk("a", 8, 8), KVHeld("a", 1, 1)])
    sender.send([Chunk("b", 0, 1)], client=3)
    sender.send([Chunk("c", 0, 1)])
    assert (sender.sent, sender.dropped) == (0, 5)
    assert asked == [0, 3]  # tried once per client, then every frame to it drops


def test_a_sender_whose_endpoint_cannot_open_counts_drops(caplog):
    sender = WireSender(lambda _client: "nosuchtransport://nowhere")
    with caplog.at_level(logging.WARNING, logger="sparseety.vllm"):
        sender.send([Chunk("a", 0, 8), Owner("a", 1)])
        sender.send([Chunk("a", 8, 8)])
    assert (sender.sent, sender.dropped) == (0, 3)
    assert sum("cannot open a channel to nosuchtransport://nowhere" in r.getMessage() for r in caplog.records) == 1


def test_a_sender_to_an_endpoint_nobody_binds_queues_at_most_its_hwm_and_drops_the_rest(tmp_path):
    """ZMQ connects a PUSH socket to an ipc path nobody binds at once, with a pipe of ``hwm`` frames: the first
    frame is queued there (counted as sent: handed to ZMQ), every later one finds the pipe full (``zmq.Again`` on a
    non-blocking send) and is counted dropped, never raised."""
    sender = WireSender(lambda _client: f"ipc://{tmp_path}/nobody.sock", hwm=1)
    try:
        for i in range(6):
            sender.send([Chunk("a", i, 1), KVHeld("a", i, 1)])  # two frames of one message each
        assert sender.sent + sender.dropped == 12
        assert sender.sent <= 1 and sender.dropped >= 11
        sock = sender._sockets[0]
        with pytest.raises(zmq.Again):  # what the sender caught: the pipe to the absent peer is full
            sock.send(b"x", zmq.NOBLOCK)
    finally:
        _close(sender)


def test_an_inbox_that_cannot_bind_says_why_and_its_thread_ends(tmp_path):
    inbox = WireInbox(f"ipc://{tmp_path}/no-such-dir/x.sock", {Chunk: list}, name="test-nobind")
    _wait(lambda: not inbox.thread.is_alive())
    assert inbox.error is not None and inbox.error.startswith("ZMQError")
    assert inbox.receive(encode([Chunk("a", 0, 1)])[0]) is True  # receive still works without a socket
    inbox.close()
