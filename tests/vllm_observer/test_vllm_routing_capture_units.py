"""The worker's MoE routing capture (:class:`RoutingCapture`) driven forward by forward without vLLM: the real
capture (discovery, sampling decisions, per-forward plan, ``select_experts`` rows, the one bincount after the
forward, the request's result when vLLM removes it) and, in the first test, the real wire: its
:class:`WireSender` to a real :class:`WireInbox` bound on an ipc path in ``tmp_path`` (``SPARSEETY_VLLM_CHANNEL``);
elsewhere the instance's ``send`` is a list's ``append``.

vLLM's objects are ``SimpleNamespace`` stand-ins with exactly the attributes ``vllm_api/worker.py``'s readers
read (the model runner's input batch, ``query_start_loc``, request states and model modules); vLLM's
``MoERunner`` class is a stand-in in ``sys.modules`` for the test (the adapter finds MoE layers by it). Router
logits are random, the top-k ids and weights are the top-k of their softmax (as a router returns them, or
shuffled); every count is recomputed here from the ids fed to each request's rows (``query_start_loc``), with
padding rows past the batch counted for nobody. What the live server checks end to end is in
test_vllm_routing.py.
"""

from __future__ import annotations

import importlib.machinery
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparseety.integrations.vllm.observe.routing_capture import RoutingCapture, routing_on
from sparseety.integrations.vllm.transport.channels import CHANNEL_ENV, routing_channel
from sparseety.integrations.vllm.transport.wire import WireInbox
from sparseety.integrations.vllm.vllm_api.ids import external_id
from sparseety.integrations.vllm.vllm_api.wire_messages import MoeShape, RouteResult
from sparseety.store.sampling import should_sample

EXPERTS, TOP_K = 6, 2
LAYER_NAMES = ("model.layers.5.mlp.experts", "model.layers.2.mlp.experts")  #: in model order; slots by number
LAYERS = (2, 5)


class MoERunner:
    """vLLM's ``MoERunner``: one MoE layer's name and its router (whose ``select_experts`` the hook wraps)."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self.router = SimpleNamespace(name=layer_name)


@pytest.fixture(autouse=True)
def vllm_moe_runner(monkeypatch):
    """``vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner`` for this test only; the observer's
    settings from this test's environment alone."""
    parts = "vllm.model_executor.layers.fused_moe.runner.moe_runner".split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=i < len(parts))
        if i < len(parts):
            module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules[".".join(parts)].MoERunner = MoERunner
    for name in ("SPARSEETY_TRACE_DIR", "SPARSEETY_TIER", "SPARSEETY_SAMPLE_RATE", CHANNEL_ENV,
                 "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"):
        monkeypatch.delenv(name, raising=False)


class Worker:
    """A model runner stand-in with two MoE layers (numbered 5 and 2, in that model order) and a dense module,
    and what was fed to each request: every row's ids per layer and its logits, weights and ids by position."""

    def __init__(self, modules=None, seed: int = 0) -> None:
        self.moe = [MoERunner(name) for name in LAYER_NAMES]
        modules = [SimpleNamespace(name="model.embed_tokens"), *self.moe, MoERunner("lm_head")] \
            if modules is None else modules
        self.runner = SimpleNamespace(
            requests={}, model=SimpleNamespace(modules=lambda: iter(modules)),
            input_batch=SimpleNamespace(num_reqs=0, req_ids=[]),
            query_start_loc=SimpleNamespace(np=np.zeros(9, dtype=np.int32)))
        self.gen = torch.Generator().manual_seed(seed)
        self.counts: dict[str, np.ndarray] = {}  #: request -> [layers (by number), experts], counted here
        self.rows: dict[str, dict[int, tuple]] = {}  #: request -> position -> (logits, weights, ids) [layers, ...]

    def add(self, rid: str, prompt: int, extra: dict | None = None) -> None:
        self.runner.requests[rid] = SimpleNamespace(num_prompt_tokens=prompt,
                                                    sampling_params=SimpleNamespace(extra_args=dict(extra or {})))

    def forward(self, capture: RoutingCapture, batch: list[tuple[str, int, int]], pad: int = 0,
                shuffled: bool = False) -> None:
        """One ``_model_forward`` over ``batch`` (request, first position, rows) and ``pad`` padding rows: the
        capture's plan, each MoE layer's ``select_experts`` in model order, the capture's count."""
        rids = [rid for rid, _, _ in batch]
        starts = np.cumsum([0] + [n for _, _, n in batch])
        self.runner.input_batch.num_reqs, self.runner.input_batch.req_ids = len(batch), rids + ["stale"]
        self.runner.query_start_loc.np[: len(starts)] = starts
        self.runner.query_start_loc.np[len(starts):] = starts[-1]
        positions = torch.cat([torch.arange(p0, p0 + n) for _, p0, n in batch] + [torch.zeros(pad, dtype=torch.long)])
        rows = int(starts[-1]) + pad
        capture.plan(self.runner, positions)
        fed = []
        for moe in self.moe:
            logits = torch.randn(rows, EXPERTS, generator=self.gen)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K)
            if shuffled and moe.layer_name == LAYER_NAMES[0]:  # a router that returns its top-k in another order
                weights, ids = weights.flip(-1), ids.flip(-1)
            capture.route(moe.router, logits, weights, ids.to(torch.int32))
            fed.append((logits, weights, ids))
        capture.after_forward()
        for i, (rid, p0, n) in enumerate(batch):
            s, e = int(starts[i]), int(starts[i + 1])
            counts = self.counts.setdefault(rid, np.zeros((len(LAYERS), EXPERTS), dtype=np.int64))
            for layer_name, (logits, weights, ids) in zip(LAYER_NAMES, fed, strict=True):
                slot = LAYERS.index(int(layer_name.split(".")[2]))
                counts[slot] += np.bincount(ids[s:e].reshape(-1).numpy(), minlength=EXPERTS)
            by_layer = [fed[LAYER_NAMES.index(f"model.layers.{n}.mlp.experts")] for n in LAYERS]
            for row, position in zip(range(s, e), range(p0, p0 + n), strict=True):
                self.rows.setdefault(rid, {})[position] = tuple(torch.stack([part[row] for part in layer])
                                                                for layer in zip(*by_layer, strict=True))


def counts_of(result: RouteResult) -> np.ndarray:
    return np.frombuffer(result.counts, dtype=np.int64).reshape(len(result.layers), result.experts)


def check_rows(result: RouteResult, fed: dict[int, tuple]) -> None:
    """A sampled result's rows are the rows fed at each position: softmax of the logits, the top-k ids and
    weights best first, every position written."""
    width = max(fed) + 1
    assert result.width == width and set(fed) == set(range(width))
    probs = np.frombuffer(result.probs, dtype=np.float32).reshape(len(LAYERS), width, EXPERTS)
    ids = np.frombuffer(result.ids, dtype=np.int32).reshape(len(LAYERS), width, TOP_K)
    weights = np.frombuffer(result.weights, dtype=np.float32).reshape(len(LAYERS), width, TOP_K)
    assert np.frombuffer(result.written, dtype=np.uint8).tolist() == [1] * width
    for position, (logits, fed_weights, fed_ids) in fed.items():
        np.testing.assert_allclose(probs[:, position], torch.softmax(logits, dim=-1).numpy(), rtol=1e-6)
        order = torch.argsort(fed_weights, dim=-1, descending=True, stable=True)
        assert ids[:, position].tolist() == fed_ids.gather(-1, order).tolist()
        assert weights[:, position].tolist() == fed_weights.gather(-1, order).tolist()
        assert (np.diff(weights[:, position], axis=-1) <= 0).all()


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_each_request_counts_the_ids_routed_in_its_rows_over_the_real_wire(tmp_path, monkeypatch):
    """Three requests over two forwards (prefills, decodes, one request joining), with padding rows: each
    RouteResult's counts are the ids routed in that request's rows, layer by layer in layer-number order,
    padding counted for none; one MoeShape first; a request never routed sends nothing."""
    base = f"ipc://{tmp_path}/ch.sock"
    monkeypatch.setenv(CHANNEL_ENV, base)
    got: list = []
    inbox = WireInbox(routing_channel(base), {MoeShape: got.extend, RouteResult: got.extend}, name="routing")
    capture = RoutingCapture()
    worker = Worker()
    try:
        for rid, prompt in (("a-0123abcd", 5), ("b-0123abcd", 3), ("c-0123abcd", 4)):
            worker.add(rid, prompt)
        worker.forward(capture, [("a-0123abcd", 0, 5), ("b-0123abcd", 0, 3)], pad=3)
        worker.forward(capture, [("a-0123abcd", 5, 1), ("b-0123abcd", 3, 1), ("c-0123abcd", 0, 4)], pad=2)
        worker.forward(capture, [("c-0123abcd", 4, 1)], pad=7)
        for rid in ("b-0123abcd", "never-routed", "a-0123abcd", "c-0123abcd"):
            capture.finish(rid)
        _wait(lambda: len(got) == 4)
        shape, *results = got
        assert shape == MoeShape(LAYERS, EXPERTS, TOP_K)
        assert [r.req_id for r in results] == ["b-0123abcd", "a-0123abcd", "c-0123abcd"]
        tokens = {"a-0123abcd": 6, "b-0123abcd": 4, "c-0123abcd": 5}
        for result in results:
            assert (result.layers, result.experts, result.top_k, result.tier) == (LAYERS, EXPERTS, TOP_K, None)
            np.testing.assert_array_equal(counts_of(result), worker.counts[result.req_id])
            assert counts_of(result).sum(axis=1).tolist() == [tokens[result.req_id] * TOP_K] * len(LAYERS)
            assert result.probs == result.ids == result.weights == result.written == b""
        assert inbox.counts["received"] == 4 and capture._sender.dropped == 0
        assert capture.totals == {} and capture.decisions == {}
    finally:
        if capture._sender is not None:
            capture._sender.close()
        inbox.close()


def test_a_request_forced_to_tier_3_sends_the_rows_it_was_fed_and_the_others_counts_only(tmp_path, monkeypatch):
    """No request is sampled at rate 0 but one whose ``vllm_xargs`` ask ``sparseety_tier`` 3: its result holds
    every position's router probabilities and top-k ids and weights, best first even where a router returned
    them in another order; its neighbour's holds counts only."""
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("SPARSEETY_SAMPLE_RATE", "0")
    capture, worker, sent = RoutingCapture(), Worker(seed=1), []
    capture.send = sent.append
    worker.add("forced", 4, {"sparseety_tier": "3"})
    worker.add("plain", 2)
    worker.forward(capture, [("plain", 0, 2), ("forced", 0, 4)], pad=1, shuffled=True)
    worker.forward(capture, [("plain", 2, 1), ("forced", 4, 1)], shuffled=True)
    worker.forward(capture, [("forced", 5, 1)], pad=3)
    capture.finish("forced")
    capture.finish("plain")
    shape, forced, plain = sent
    assert shape == MoeShape(LAYERS, EXPERTS, TOP_K)
    assert (forced.req_id, forced.tier, plain.req_id, plain.tier, plain.width) == ("forced", 3, "plain", None, 0)
    check_rows(forced, worker.rows["forced"])
    for result in (forced, plain):
        np.testing.assert_array_equal(counts_of(result), worker.counts[result.req_id])


def test_at_rate_one_every_request_is_sampled_at_the_servers_tier(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("SPARSEETY_TIER", "2")
    capture, worker, sent = RoutingCapture(), Worker(seed=2), []
    capture.send = sent.append
    for rid in ("x", "y"):
        worker.add(rid, 3)
    worker.forward(capture, [("x", 0, 3), ("y", 0, 3)], pad=2)
    worker.forward(capture, [("y", 3, 1), ("x", 3, 1)])
    capture.finish("x")
    capture.finish("y")
    _, *results = sent
    for result in results:
        assert result.tier == 2
        check_rows(result, worker.rows[result.req_id])
        np.testing.assert_array_equal(counts_of(result), worker.counts[result.req_id])


def test_sampling_is_decided_once_on_the_id_the_client_knows(tmp_path, monkeypatch):
    """vLLM's internal ids end in ``-`` and 8 random characters: two internal ids of one client id are sampled
    alike, at the store's rate on the client id; without a trace store no request is sampled, forced or not."""
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("SPARSEETY_SAMPLE_RATE", "0.5")
    capture, worker = RoutingCapture(), Worker()
    decided = {}
    for i in range(16):
        for tail in ("0123abcd", "fedc9876"):
            rid = f"chatcmpl-{i}-{tail}"
            worker.add(rid, 3)
            decided[rid] = capture.decide(worker.runner, rid) is not None
            assert decided[rid] == should_sample(f"chatcmpl-{i}", 0.5) and external_id(rid) == f"chatcmpl-{i}"
        assert decided[f"chatcmpl-{i}-0123abcd"] == decided[f"chatcmpl-{i}-fedc9876"]
    assert 0 < sum(decided.values()) < len(decided)
    monkeypatch.delenv("SPARSEETY_TRACE_DIR")
    untraced = RoutingCapture()
    worker.add("forced", 3, {"sparseety_tier": 3})
    assert untraced.decide(worker.runner, "forced") is None and "forced" in untraced.decisions


def test_a_recomputed_position_keeps_its_last_row_and_every_routing_counts(tmp_path, monkeypatch):
    """A preempted request recomputes positions 0-3: its rows there are the recompute's; its counts hold every
    token vLLM routed, the recompute's too."""
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))
    capture, worker, sent = RoutingCapture(), Worker(seed=3), []
    capture.send = sent.append
    worker.add("p", 4)
    worker.forward(capture, [("p", 0, 4)])
    first = dict(worker.rows["p"])
    worker.forward(capture, [("p", 0, 5)], pad=1)  # the prompt and its first output token, recomputed
    assert all(not torch.equal(first[p][0], worker.rows["p"][p][0]) for p in first)
    capture.finish("p")
    _, result = sent
    check_rows(result, worker.rows["p"])
    assert counts_of(result).sum(axis=1).tolist() == [(4 + 5) * TOP_K] * len(LAYERS)
    np.testing.assert_array_equal(counts_of(result), worker.counts["p"])


def test_a_dense_model_sends_nothing_and_an_unknown_router_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))
    dense, worker, sent = RoutingCapture(), Worker(modules=[SimpleNamespace(), MoERunner("lm_head")]), []
    dense.send = sent.append
    worker.add("d", 3)
    dense.plan(worker.runner, torch.arange(3))
    assert dense.found and dense.layers == [] and dense.reqs is None
    dense.route(worker.moe[0].router, torch.zeros(3, EXPERTS), torch.zeros(3, TOP_K), torch.zeros(3, TOP_K))
    dense.after_forward()
    dense.finish("d")
    assert sent == [] and dense.acc is None

    moe, worker = RoutingCapture(), Worker(seed=4)
    moe.send = sent.append
    worker.add("m", 2)
    moe.plan(worker.runner, torch.arange(2))
    stranger = MoERunner("model.layers.9.mlp.experts").router  # not one of the model's
    moe.route(stranger, torch.zeros(2, EXPERTS), torch.zeros(2, TOP_K), torch.zeros(2, TOP_K, dtype=torch.int32))
    assert moe.acc is None and moe.layers == list(LAYERS)
    moe.after_forward()
    moe.finish("m")
    assert sent == []  # decided (not sampled) but nothing routed: nothing to send


@pytest.mark.parametrize("raw, on", [(None, True), ("on", True), ("off", False), (" OFF ", False), ("0", False),
                                     ("false", False), ("no", False), ("1", True)])
def test_routing_is_on_unless_turned_off(raw, on):
    assert routing_on({} if raw is None else {"SPARSEETY_ROUTING": raw}) is on
