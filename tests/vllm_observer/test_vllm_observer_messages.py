"""Recorded messages of vLLM's engine core and worker replayed into a real :class:`Observer`, over real ZMQ: each
test sets the plugin's channel (``SPARSEETY_VLLM_CHANNEL``) to an ipc path in its folder, starts an observer
(its scheduler, importance and routing inboxes bind there; a real trace store, ``SPARSEETY_KV_EVENTS=off``,
ids only), sends the messages with the plugin's own :class:`WireSender` to the channels the observer binds, then
hands it a finished request as the frontend's hook would and closes it, and reads the stored record back with
DuckDB (:func:`sparseety.store.connect`) and :func:`sparseety.store.load_trace`. No vLLM, no model weights.

The messages are the producers' own: the engine core's readers (:func:`adapter.blocks_of`, a real
:class:`WindowFrees`) on stand-ins with the attribute names of vLLM's scheduler and KV-cache coordinator, a real
:class:`EvictionLedger`, a real :class:`RequestCapture` fed small random tensors. Every expected value is worked
out here from what was sent.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
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
from sparseety.integrations.vllm.observe.observer import Observer
from sparseety.integrations.vllm.observe.window_frees import WindowFrees
from sparseety.integrations.vllm.transport.channels import (
    CHANNEL_ENV,
    client_channel,
    importance_channel,
    routing_channel,
)
from sparseety.integrations.vllm.transport.settings import parse_settings
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest, KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import (
    CaptureStart,
    Chunk,
    EvictedSlots,
    EvictionRecord,
    Groups,
    KVHeld,
    MoeShape,
    RouteResult,
)
from sparseety.store import connect, load_trace

BLOCK = 4  #: vLLM's KV block size the stat logger reports (tokens per block)


@dataclass
class Served:
    """One observer and the three senders the engine core and the worker would use."""

    obs: Observer
    trace_dir: str
    base: str
    scheduler: WireSender
    importance: WireSender
    routing: WireSender


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the observer's inbox"
        time.sleep(0.01)


@pytest.fixture
def served(tmp_path, monkeypatch):
    base = f"ipc://{tmp_path}/s.sock"
    monkeypatch.setenv(CHANNEL_ENV, base)  # before the observer: it binds the channels this names
    trace_dir = str(tmp_path / "traces")
    obs = Observer(parse_settings({"SPARSEETY_TRACE_DIR": trace_dir, "SPARSEETY_KV_EVENTS": "off",
                                   "SPARSEETY_IDS_ONLY": "1"}))
    obs.configure(model="smollm2-135m", block_size=BLOCK, kv_endpoint=None, config={"max_model_len": 64})
    # the engine core's scheduler sender (API server `client`'s channel), the worker's importance and routing ones
    senders = [WireSender(client_channel, linger_ms=1000),
               WireSender(lambda _client: importance_channel(base), linger_ms=1000),
               WireSender(lambda _client: routing_channel(base), linger_ms=1000)]
    yield Served(obs, trace_dir, base, *senders)
    obs.close()
    for sender in senders:
        sender.close()


def finish(served: Served, *requests: FinishedRequest):
    """Hand the finished requests to the observer (as its frontend hook does), close it, open the store."""
    for request in requests:
        served.obs._enqueue(request)
    served.obs.close()
    stats = served.obs.stats()
    assert stats["dropped_records"] == 0 and stats["failed_records"] == 0, stats
    return connect(served.trace_dir)


def request(request_id: str, internal_id: str, prompt: list[int], output: list[int]) -> FinishedRequest:
    return FinishedRequest(request_id, internal_id, prompt, output, 0, [], None, None, 0, 0, finish_reason="length")


def vllm_info(con, request_id: str) -> dict:
    (extra,), = con.execute("SELECT extra_json FROM requests WHERE request_id = ?", [request_id]).fetchall()
    return json.loads(extra)["vllm"]


def events(con, request_id: str, event: str) -> list[tuple]:
    return con.execute("SELECT step, layer, kv_head, position, token_id, score FROM token_events "
                       "WHERE request_id = ? AND event = ? ORDER BY seq", [request_id, event]).fetchall()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- prefill chunks ------------------------------------------------------------------------------------------
def test_prefill_chunks_become_the_records_chunks_and_prefill_chunk_events(served):
    prompt, output = list(range(200, 220)), [7, 8, 9, 10]
    served.scheduler.send([Chunk("a-int", 0, 8), Chunk("other", 0, 16)])  # one frame: a step of two requests
    served.scheduler.send([Chunk("a-int", 8, 8)])
    served.scheduler.send([Chunk("a-int", 16, 4), Chunk("other", 16, 2)])
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 3)
    con = finish(served, request("cmpl-a", "a-int", prompt, output))

    assert vllm_info(con, "cmpl-a")["prefill_chunks"] == [[0, 8], [8, 8], [16, 4]]
    # step: the chunk's index; position: its first position; token_id: the prompt token there; score: its tokens
    assert events(con, "cmpl-a", "prefill_chunk") == [(0, -1, -1, 0, 200, 8.0), (1, -1, -1, 8, 208, 8.0),
                                                      (2, -1, -1, 16, 216, 4.0)]
    kinds = con.execute("SELECT DISTINCT event FROM token_events WHERE request_id = 'cmpl-a'").fetchall()
    assert kinds == [("prefill_chunk",)]
    arrays = load_trace(served.trace_dir, "cmpl-a").arrays
    assert arrays["prefill_chunk.position"].tolist() == [0, 8, 16] and arrays["prefill_chunk.score"].dtype == np.float32
    assert served.obs.requests.chunks["other"] == [(0, 16), (16, 2)]  # another request's chunks are not this one's
    assert served.scheduler.sent == 5 and served.scheduler.dropped == 0


# -- KV held, groups, window peak ------------------------------------------------------------------------------
NULL = object()


def _engine_core(windows: tuple[int | None, ...]) -> SimpleNamespace:
    """A scheduler stand-in: vLLM's names for the KV-cache config, the coordinator's managers and block tables
    (``NULL``: vLLM's null block) and the manager's block ids (0: the null block's id)."""
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(sliding_window=w, page_size_bytes=10, num_kv_heads=1),
                              layer_names=[f"model.layers.{2 * g + i}.self_attn.attn" for i in range(2)])
              for g, w in enumerate(windows)]
    managers = tuple(SimpleNamespace(req_to_blocks={}, _null_block=NULL) for _ in windows)
    config = SimpleNamespace(kv_cache_groups=groups)
    coordinator = SimpleNamespace(kv_cache_config=config, single_type_managers=managers)

    def block_ids(rid: str) -> tuple[list[int], ...]:
        return tuple([0 if b is NULL else 1 + i for i, b in enumerate(m.req_to_blocks.get(rid, []))] for m in managers)

    manager = SimpleNamespace(coordinator=coordinator, get_block_ids=block_ids,
                              block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)))
    return SimpleNamespace(kv_cache_config=config, kv_cache_manager=manager)


def test_kv_held_groups_and_window_peak_become_peak_dense_bytes_and_window(served):
    """A full-attention group and an 8-token sliding-window group (layers 0-1 and 2-3, 10 bytes a page, so 20
    bytes a block), blocks of 4 tokens, a prompt of 12 then 9 outputs (positions 0..19 fed)."""
    windows = (None, 8)
    scheduler = _engine_core(windows)
    coordinator = adapter.coordinator_of(scheduler)
    frees = WindowFrees()
    managers = coordinator.single_type_managers
    for computed in range(20):  # what vLLM's allocate_slots does each step, around the window-frees hook
        nulls = frees.before(coordinator, "w-int")
        table = managers[1].req_to_blocks.get("w-int")
        if table is not None:  # SlidingWindowManager.remove_skipped_blocks: blocks out of every window
            for i in range(min(max(0, computed - 8 + 1) // BLOCK, len(table))):
                table[i] = NULL
        if nulls is not None:
            frees.after(coordinator, "w-int", computed, nulls)
        for manager in managers:
            table = manager.req_to_blocks.setdefault("w-int", [])
            while len(table) < -(-(computed + 1) // BLOCK):
                table.append(object())
    # vLLM frees the request's blocks: the kv-blocks hook reads what it holds, then its peak and window frees
    held = adapter.blocks_of(scheduler, SimpleNamespace(request_id="w-int"))
    peak = frees.finish(coordinator, "w-int")
    served.scheduler.send(held)
    served.scheduler.send([frees.groups_message()])
    served.scheduler.send([peak])
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 3)
    freed_before = (sample("sparseety:window_freed_blocks_total", engine="unknown"),
                    sample("sparseety:window_freed_bytes_total", engine="unknown"))
    prompt, output = list(range(100, 112)), list(range(500, 509))
    con = finish(served, request("cmpl-w", "w-int", prompt, output))

    # at the end: 5 full-attention blocks and 2 window blocks (3 freed, at computed 11, 15 and 19);
    # the peak: 5 + 3 blocks, just before the last free
    assert held == [KVHeld("w-int", 7 * 20, 7)]
    (peak_bytes, dense_bytes, skipped), = con.execute(
        "SELECT kv_cache_bytes_peak, kv_cache_bytes_dense, skipped_events FROM requests").fetchall()
    assert peak_bytes == 8 * 20
    assert dense_bytes == 7 * 20 + 3 * 20  # held at the end plus what the window freed
    info = vllm_info(con, "cmpl-w")
    assert info["kv_blocks_held"] == 8 and info["block_size"] == BLOCK
    # step: 0 while the prompt (12) is prefilled, else computed - 12 + 1
    assert info["window"] == {"layers": {"2": 8, "3": 8}, "freed_blocks": 3, "freed_bytes": 60,
                              "frees": [[0, 1, 1, 20], [4, 1, 1, 20], [8, 1, 1, 20]]}
    # the window rows: per step s (newest query at 11 + s) and windowed layer, the edge 11 + s - 8 + 1
    sequence = prompt + output
    rows = con.execute("SELECT step, layer, position, token_id FROM token_events WHERE event = 'skipped' "
                       "AND reason = 'window' ORDER BY seq").fetchall()
    assert rows == [(s, layer, 4 + s, sequence[4 + s]) for s in range(9) for layer in (2, 3)]
    assert skipped == sum(2 * (4 + s) for s in range(9))  # hidden positions x 1 KV head x 2 layers
    assert (sample("sparseety:window_freed_blocks_total", engine="unknown") - freed_before[0],
            sample("sparseety:window_freed_bytes_total", engine="unknown") - freed_before[1]) == (3, 60)


# -- eviction --------------------------------------------------------------------------------------------------
#: the worker's evicted slots ``(step, layer, kv head, position)`` per compaction: 4 of 12 held at the first
#: (after the 12-token prompt), 4 of the 12 held again 4 tokens later
STEP0 = {(0, 0): (1, 2, 3, 4), (0, 1): (2, 3, 4, 5), (1, 0): (1, 3, 5, 7), (1, 1): (4, 5, 6, 7)}
STEP4 = {(0, 0): (5, 6, 7, 8), (0, 1): (6, 7, 8, 9), (1, 0): (2, 4, 6, 8), (1, 1): (1, 2, 3, 8)}


def _slot_rows(step: int, table: dict) -> list[list[float]]:
    return [[step, layer, head, p, 0.5 + 0.01 * p + 0.1 * layer] for (layer, head), ps in table.items() for p in ps]


def test_an_eviction_record_from_the_ledger_becomes_policy_events_and_kept_positions(served):
    ledger = EvictionLedger(interval=4)
    ledger.track("e-int", 8, "tova")
    first = ledger.plan("e-int", 12, 12)
    ledger.apply(first, freed_blocks=1)
    ledger.receive(StepReport({"e-int": EvictedSlots.of_rows(_slot_rows(0, STEP0))}))
    assert ledger.plan("e-int", 15, 12) is None  # 11 held: under budget + interval
    second = ledger.plan("e-int", 16, 12)
    ledger.apply(second, freed_blocks=1)
    ledger.receive(StepReport({"e-int": EvictedSlots.of_rows(_slot_rows(4, STEP4))}))
    record = ledger.forget("e-int").record("e-int")
    served.scheduler.send([Groups((KVGroup(0, None, 256, 2, (0, 1)),))])  # 2 layers, 2 KV heads
    served.scheduler.send([KVHeld("e-int", 3 * 256, 3), record])  # 11 tokens held at the end: 3 blocks
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 3)
    before = (sample("sparseety:evicted_tokens_total", engine="unknown", policy="tova"),
              sample("sparseety:evicted_freed_blocks_total", engine="unknown", policy="tova"))
    prompt, output = list(range(300, 312)), list(range(20, 28))
    con = finish(served, request("cmpl-e", "e-int", prompt, output))

    (policy, budget, evicted_positions, eviction_events, peak, dense), = con.execute(
        "SELECT policy, budget, evicted_positions, eviction_events, kv_cache_bytes_peak, kv_cache_bytes_dense "
        "FROM requests WHERE request_id = 'cmpl-e'").fetchall()
    assert (policy, budget) == ("tova", 8)
    assert vllm_info(con, "cmpl-e")["eviction"] == {"policy": "tova", "budget": 8, "evicted_tokens_per_layer": 8,
                                                    "freed_blocks": 2, "compactions": 2, "peak_tokens": 12,
                                                    "failure": None}
    sequence = prompt + output
    want = [(step, layer, head, p, sequence[p], pytest.approx(0.5 + 0.01 * p + 0.1 * layer, rel=1e-6))
            for step, table in ((0, STEP0), (4, STEP4)) for (layer, head), ps in table.items() for p in ps]
    assert events(con, "cmpl-e", "evicted") == want
    positions = {p for table in (STEP0, STEP4) for ps in table.values() for p in ps}
    assert evicted_positions == len(positions) == 9 and eviction_events == 32
    # vLLM freed the compacted blocks at the end: the peak is the 12 tokens held before a compaction (3 blocks of
    # 256 bytes), dense the 5 blocks the 19 fed tokens (prompt and every output but the last) would have held
    assert (peak, dense) == (3 * 256, 5 * 256)
    kept = load_trace(served.trace_dir, "cmpl-e").document["sparsity"]["kept_positions_final"]
    fed = len(sequence) - 1
    assert kept == {str(layer): {str(head): sorted(set(range(fed)) - set(STEP0[layer, head]) - set(STEP4[layer, head]))
                                 for head in (0, 1)} for layer in (0, 1)}
    assert (sample("sparseety:evicted_tokens_total", engine="unknown", policy="tova") - before[0],
            sample("sparseety:evicted_freed_blocks_total", engine="unknown", policy="tova") - before[1]) == (8, 2)


def test_a_refused_eviction_is_recorded_dense_with_why_and_counted(served):
    why = "sparseety_policy='kvzip' cannot run inside vLLM: it needs a reconstruction pass of its own"
    served.scheduler.send([refused_record("r-int", "kvzip", why)])
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 1)
    before = sample("sparseety:eviction_refused_total", engine="unknown", policy="kvzip")
    con = finish(served, request("cmpl-r", "r-int", [1, 2, 3, 4, 5], [6, 7]))

    assert vllm_info(con, "cmpl-r")["eviction"] == {"policy": "kvzip", "refused": why}
    (policy, budget, evicted_positions), = con.execute(
        "SELECT policy, budget, evicted_positions FROM requests WHERE request_id = 'cmpl-r'").fetchall()
    assert (policy, budget, evicted_positions) == ("vllm", None, None)  # served dense
    assert events(con, "cmpl-r", "evicted") == []
    assert sample("sparseety:eviction_refused_total", engine="unknown", policy="kvzip") - before == 1


# -- important tokens ------------------------------------------------------------------------------------------
LAYERS, HEADS, KV_HEADS, D = 2, 4, 2, 8


def test_a_captured_requests_importance_is_recorded_as_the_capture_scored_it(served):
    """The worker's capture of a prompt of 11 prefilled in three chunks and five decode steps: rows at query
    positions 10..15 (the prompt's last row and each decode step's), for 6 outputs."""
    g = torch.Generator().manual_seed(11)
    n, prompt_len, outputs = 16, 11, 6
    q = torch.randn(LAYERS, n, HEADS, D, generator=g)
    k = torch.randn(LAYERS, n, KV_HEADS, D, generator=g)
    v = torch.randn(LAYERS, n, KV_HEADS, D, generator=g)
    scale = 1 / math.sqrt(D)
    cap = RequestCapture("i-int", tier=2, mode="attention", prompt_len=prompt_len, layers=LAYERS)
    for p0, count in [(0, 4), (4, 4), (8, 3)] + [(p, 1) for p in range(11, 16)]:
        rows = cap.begin(p0, count)
        for layer in range(LAYERS):
            cap.write(layer, p0, k[layer, p0 : p0 + count], v[layer, p0 : p0 + count])
            if rows:
                cap.score(layer, p0, q[layer, p0 : p0 + count], rows, scale)
    served.importance.send([CaptureStart("i-int"), CaptureStart("lost-int")])  # "lost": its result never comes
    served.importance.send([cap.result()])
    _wait(lambda: served.obs.importance.inbox.has_result("i-int"))
    prompt, output = list(range(40, 51)), list(range(60, 66))
    con = finish(served, request("cmpl-i", "i-int", prompt, output), request("cmpl-lost", "lost-int", [1, 2], [3]))

    # the reference: per layer, the sum over rows 10..15 of the mean over heads of softmax(q . K[:q+1] * scale)
    seen = prompt_len + outputs - 1
    want = np.zeros((LAYERS, seen))
    qn, kn = q.double().numpy(), k.double().numpy()
    for layer in range(LAYERS):
        for row in range(prompt_len - 1, seen):
            for head in range(HEADS):
                logits = kn[layer, : row + 1, head // (HEADS // KV_HEADS)] @ qn[layer, row, head] * scale
                p = np.exp(logits - logits.max())
                want[layer, : row + 1] += p / p.sum() / HEADS
    trace = load_trace(served.trace_dir, "cmpl-i")
    info = trace.document["vllm"]["importance"]
    assert info == {"status": "recorded", "mode": "attention", "rows": outputs, "expected_rows": outputs,
                    "layers": LAYERS, "sinks": [], "unscored_positions": 0, "shared_positions": 0, "tier": 2}
    importance = trace.arrays["importance"]
    assert importance.shape == (LAYERS, seen) and importance.dtype == np.float16
    np.testing.assert_allclose(importance.astype(np.float64), want, rtol=2e-3, atol=1e-3)
    ranked = [r for r in trace.document["important_tokens"] if r["layer"] is None]
    assert ranked and ranked[0]["position"] == int(np.argmax(want.sum(axis=0)))
    assert ranked[0]["token_id"] == (prompt + output)[ranked[0]["position"]]
    assert {r["layer"] for r in trace.document["important_tokens"]} == {None, 0, 1}
    assert vllm_info(con, "cmpl-lost")["importance"] == {"status": "lost"}  # started, never came
    assert served.obs.importance.inbox.inbox.counts == {"received": 2, "unknown": 0, "bad": 0, "failed": 0}


# -- MoE routing -----------------------------------------------------------------------------------------------
def test_routed_counts_become_the_records_expert_tokens(served):
    """MoE layers 1 and 3, 4 experts, top-2; a prompt of 2 and 2 outputs: 3 tokens fed, 6 routings a layer."""
    counts = np.array([[3, 1, 0, 2], [0, 4, 2, 0]], dtype=np.int64)
    before = {(layer, e): sample("sparseety:moe_expert_tokens_total", layer=layer, expert=e)
              for layer in ("1", "3") for e in "0123"}
    served.routing.send([MoeShape((1, 3), 4, 2)])
    served.routing.send([RouteResult("m-int", (1, 3), 4, 2, counts.tobytes())])
    _wait(lambda: "m-int" in served.obs.routing.results)
    con = finish(served, request("cmpl-m", "m-int", [5, 6], [7, 8]), request("cmpl-n", "n-int", [5], [9]))

    assert vllm_info(con, "cmpl-m")["moe"] == {
        "status": "counted", "layers": [1, 3], "experts": 4, "top_k": 2, "expert_tokens": [[3, 1, 0, 2], [0, 4, 2, 0]],
        "tokens": [3, 3], "load_imbalance": [round(3 / 1.5, 4), round(4 / 1.5, 4)]}  # busiest over the mean
    assert vllm_info(con, "cmpl-n")["moe"] == {"status": "lost", "layers": [1, 3], "experts": 4, "top_k": 2}
    counted = {key: sample("sparseety:moe_expert_tokens_total", layer=key[0], expert=key[1]) - was
               for key, was in before.items()}
    assert counted == {(str(layer), str(e)): counts[row, e] for row, layer in enumerate((1, 3)) for e in range(4)}
    assert served.obs.routing.totals.tolist() == counts.tolist()
    assert served.obs.routing.inbox.counts == {"received": 2, "unknown": 0, "bad": 0, "failed": 0}


# -- a bad frame -------------------------------------------------------------------------------------------------
def test_one_requests_frame_of_an_unknown_version_costs_nothing_else(served):
    before = sample("sparseety:wire_frames_dropped_total", channel="scheduler", reason="unknown")
    inbox = served.obs.scheduler.inbox
    served.scheduler.send([Chunk("a-int", 0, 8)])
    _wait(lambda: inbox.counts["received"] == 1)
    raw = zmq.Context.instance().socket(zmq.PUSH)  # a sender of a newer layout, on the same channel
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(served.base)
    try:
        raw.send(msgspec.msgpack.encode(("chunk", Chunk.VERSION + 1, [{"req_id": "b-int", "start": 0, "tokens": 8,
                                                                        "layout": "v2"}])))
        _wait(lambda: inbox.counts["unknown"] == 1)
    finally:
        raw.close()
    served.scheduler.send([Chunk("a-int", 8, 4), KVHeld("a-int", 3 * 256, 3), KVHeld("b-int", 2 * 256, 2)])
    _wait(lambda: inbox.counts["received"] == 3)
    con = finish(served, request("cmpl-a", "a-int", list(range(12)), [50, 51]),
                 request("cmpl-b", "b-int", list(range(8)), [60]))

    a, b = vllm_info(con, "cmpl-a"), vllm_info(con, "cmpl-b")
    assert a["prefill_chunks"] == [[0, 8], [8, 4]] and a["kv_blocks_held"] == 3
    assert b["prefill_chunks"] == [] and b["kv_blocks_held"] == 2  # only its dropped chunk is missing
    assert events(con, "cmpl-a", "prefill_chunk") == [(0, -1, -1, 0, 0, 8.0), (1, -1, -1, 8, 8, 4.0)]
    assert events(con, "cmpl-b", "prefill_chunk") == []
    peaks = dict(con.execute("SELECT request_id, kv_cache_bytes_peak FROM requests").fetchall())
    assert peaks == {"cmpl-a": 3 * 256, "cmpl-b": 2 * 256}
    assert inbox.counts == {"received": 3, "unknown": 1, "bad": 0, "failed": 0}
    assert sample("sparseety:wire_frames_dropped_total", channel="scheduler", reason="unknown") - before == 1


def _evicted_once(rid: str, budget: int, prompt: int) -> EvictionRecord:
    ledger = EvictionLedger(interval=4)
    ledger.track(rid, budget, "streaming")
    ledger.apply(ledger.plan(rid, prompt, prompt), freed_blocks=1)
    return ledger.forget(rid).record(rid)


def test_an_evicting_requests_dense_bytes_count_the_tokens_it_fed(served):
    """P + n - 1 tokens (the last output is never fed), in whole blocks: 12 + 9 - 1 = 20 fill 5 blocks of 4
    exactly, where P + n would start a sixth."""
    served.scheduler.send([KVHeld("d-int", 2 * 256, 2), _evicted_once("d-int", 8, 12)])
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 2)
    con = finish(served, request("cmpl-d", "d-int", list(range(300, 312)), list(range(20, 29))))
    (dense,), = con.execute("SELECT kv_cache_bytes_dense FROM requests WHERE request_id = 'cmpl-d'").fetchall()
    assert dense == 5 * 256


def test_a_part_that_fails_costs_that_part_not_the_record(served, monkeypatch):
    """The routing of one request cannot be attached (a fault injected there): its record is stored with
    ``moe.status`` failed and the error, its evicted slots and everything else intact."""
    def broken(run, internal_id):
        raise RuntimeError("injected")

    served.scheduler.send([KVHeld("f-int", 2 * 256, 2), _evicted_once("f-int", 8, 12)])
    _wait(lambda: served.obs.scheduler.inbox.counts["received"] == 2)
    monkeypatch.setattr(served.obs.routing, "attach", broken)
    con = finish(served, request("cmpl-f", "f-int", list(range(300, 312)), list(range(20, 24))))
    info = vllm_info(con, "cmpl-f")
    assert info["moe"] == {"status": "failed", "error": "RuntimeError: injected"}
    assert info["eviction"]["policy"] == "streaming" and info["eviction"]["evicted_tokens_per_layer"] == 4
