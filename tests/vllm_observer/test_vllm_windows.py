"""Sliding windows inside a real ``vllm serve`` of Gemma 3 270M (five sliding layers of 512 tokens to each
global one; vLLM's hybrid KV-cache manager gives each layer kind its own block table and frees what left
the windows), against SparSEEty's own engine on the same prompts past the window.

Two servers: one prefills in chunks of at most 128 tokens, one in one step. For each request: the
``window`` rows equal the own engine's (alone, in a batch, chunked, unchunked, after a prefix-cache hit),
``skipped_events`` too, the top-16 important tokens equal the own engine's, and the blocks vLLM freed
are vLLM's own rule (``SlidingWindowManager.get_num_skipped_tokens``) applied to what it computed, and
add up with the blocks still held to what the request allocated. The ``sparseety:window_freed_*``
counters equal the sum over the records, and the observer left vLLM's hybrid manager on.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_vllm_importance import TOP, assert_same_ranking
from vllm_server import VllmServer, require_vllm, side_by_side

from sparseety.store import connect

pytestmark = pytest.mark.model

WINDOW = 512
NEW_TOKENS = 12
WORDS = open("/usr/share/common-licenses/GPL-3").read().split()  # noqa: SIM115 (real text, on every Debian)
PROMPTS = [" ".join(WORDS[400 * i : 400 * i + 480]) for i in range(4)]  # 560-640 Gemma tokens each
SERVER_ARGS = ["--num-gpu-blocks-override", "256"]  # 6 KV-cache groups x ~20 blocks per request


def _server(base, name: str, extra_args: list[str], extra_env: dict[str, str] | None = None) -> VllmServer:
    from sparseety.models.registry import resolve_model_dir

    return VllmServer(resolve_model_dir("gemma3-270m"), base / name / "traces", base / f"{name}.log",
                      speculative=False, extra_args=[*SERVER_ARGS, *extra_args], extra_env=extra_env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    require_vllm()
    base = tmp_path_factory.mktemp("vllm-windows")
    with side_by_side(_server(base, "chunked", []),
                      _server(base, "whole", ["--max-num-batched-tokens", "1024"])) as (chunked, whole):
        yield {"chunked": chunked, "whole": whole}


def _wait(server: VllmServer, responses: list[dict]) -> dict[str, dict]:
    """The stored ``requests`` row (as a dict) of each response, once its importance is in."""
    ids = [r["id"] + "-0" for r in responses]
    deadline = time.monotonic() + 120
    while True:
        try:
            con = connect(server.trace_dir)
            rows = con.sql("SELECT request_id, skipped_events, kv_cache_bytes_peak, kv_cache_bytes_dense, extra_json "
                           "FROM requests WHERE policy = 'vllm'").fetchall()
            found = {r[0]: {"skipped_events": r[1], "peak": r[2], "dense": r[3], "vllm": json.loads(r[4])["vllm"],
                            "con": con} for r in rows if r[0] in ids}
            if len(found) == len(ids) and all(f["vllm"].get("importance", {}).get("status") for f in found.values()):
                return found
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"records of {ids} not stored:\n{server.log_tail()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def traffic(servers, gemma):
    _, tokenizer = gemma
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert all(len(i) > WINDOW + 32 for i in ids), [len(i) for i in ids]
    chunked, whole = servers["chunked"], servers["whole"]
    out: dict[str, list[dict]] = {"alone": [chunked.complete(ids[0], NEW_TOKENS)]}
    # the same prompt again, before a batch reuses the blocks: a prefix-cache hit
    out["cached"] = [chunked.complete(ids[0], NEW_TOKENS)]
    with ThreadPoolExecutor(3) as pool:  # one batch: their rows share forwards
        out["batch"] = list(pool.map(lambda i: chunked.complete(i, NEW_TOKENS), ids[1:]))
    out["whole"] = [whole.complete(ids[0], NEW_TOKENS)]
    stored = {**_wait(chunked, out["alone"] + out["batch"] + out["cached"]), **_wait(whole, out["whole"])}
    return {"responses": out, "stored": stored}


@pytest.fixture(scope="module")
def own(gemma_engine):
    """The own engine's dense run (tier 2, ``value`` importance) of a response's prompt, by prompt."""
    from sparseety.engine.inputs import EncodedInput
    from sparseety.policies.registry import build_policy

    runs: dict[tuple[int, ...], object] = {}

    def run(response: dict):
        choice = response["choices"][0]
        key = tuple(choice["prompt_token_ids"])
        if key not in runs:
            encoded = EncodedInput(torch.tensor([choice["prompt_token_ids"]]))
            runs[key] = gemma_engine.generate(encoded, build_policy("dense"), max_new_tokens=len(choice["token_ids"]),
                                              tier=2, top_k=TOP, importance="value")
        result = runs[key]
        assert result.output_ids == choice["token_ids"], "vLLM's greedy output differs from the own engine's"
        return result
    return run


def _rows(con, request_id: str) -> list[tuple[int, int, int, int]]:
    return [tuple(r) for r in con.sql(
        "SELECT step, layer, position, token_id FROM token_events WHERE request_id = ? AND event = 'skipped' "
        "AND reason = 'window' ORDER BY step, layer", params=[request_id]).fetchall()]


def _own_rows(result) -> list[tuple[int, int, int, int]]:
    a = result.arrays
    return sorted(zip(a["window.step"].tolist(), a["window.layer"].tolist(), a["window.position"].tolist(),
                      a["window.token_id"].tolist(), strict=True))


def _check(stored: dict, response: dict, own) -> None:
    rid = response["id"] + "-0"
    record, result = stored[rid], own(response)
    rows = _rows(record["con"], rid)
    assert rows and rows == _own_rows(result)
    assert record["skipped_events"] == result.skipped_events
    importance = record["vllm"]["importance"]
    assert importance["status"] == "recorded" and importance["unscored_positions"] == 0, importance
    got = [(p, s) for p, s in record["con"].sql(
        "SELECT position, score FROM important_tokens WHERE request_id = ? AND layer IS NULL ORDER BY rank",
        params=[rid]).fetchall()]
    assert_same_ranking(got, [(t.position, t.score) for t in result.important_tokens if t.layer is None])


@pytest.mark.parametrize("kind", ["alone", "batch", "cached", "whole"])
def test_window_rows_and_ranking_equal_the_own_engines(traffic, own, kind):
    for response in traffic["responses"][kind]:
        _check(traffic["stored"], response, own)


def test_prefill_was_chunked_on_one_server_and_whole_on_the_other_and_the_cache_hit(traffic):
    stored = traffic["stored"]
    chunked = stored[traffic["responses"]["alone"][0]["id"] + "-0"]["vllm"]["prefill_chunks"]
    whole = stored[traffic["responses"]["whole"][0]["id"] + "-0"]["vllm"]["prefill_chunks"]
    assert len(chunked) >= 5 and len(whole) == 1, (chunked, whole)
    assert stored[traffic["responses"]["cached"][0]["id"] + "-0"]["vllm"]["num_cached_tokens"] >= WINDOW


def test_freed_blocks_follow_vllms_rule_and_add_up_to_what_was_allocated(traffic):
    for kind in ("alone", "batch", "whole"):
        for response in traffic["responses"][kind]:
            choice = response["choices"][0]
            prompt, outputs = len(choice["prompt_token_ids"]), len(choice["token_ids"])
            record = traffic["stored"][response["id"] + "-0"]
            window, block = record["vllm"]["window"], record["vllm"]["block_size"] or 32
            layers = {int(k): v for k, v in window["layers"].items()}
            assert sorted(layers) == [i for i in range(18) if i % 6 != 5] and set(layers.values()) == {WINDOW}
            groups = {g for _, g, _, _ in window["frees"]}
            assert len(groups) == 5  # the five sliding-window groups, never the global one
            # vLLM frees, before each step, the blocks below its window: the last step scheduled computed
            # prompt + outputs - 2 tokens before it, so floor((that - window + 1) / block) blocks per group
            skipped = prompt + outputs - 2 - WINDOW + 1
            per_group = {g: sum(n for _, gg, n, _ in window["frees"] if gg == g) for g in groups}
            assert set(per_group.values()) == {skipped // block}, per_group
            assert window["freed_blocks"] == 5 * (skipped // block)
            # dense: every block of the 6 groups for the prompt and the outputs fed back; the peak lies
            # between what was held at the end and that (these prompts are short enough that vLLM still
            # held every prompt block when the prefill completed: the first frees come on the next step)
            allocated = 6 * math.ceil((prompt + outputs - 1) / block)
            block_bytes = window["freed_bytes"] // window["freed_blocks"]
            assert record["dense"] == allocated * block_bytes
            assert record["dense"] - window["freed_bytes"] <= record["peak"] <= record["dense"]
            assert record["peak"] >= 6 * math.ceil(prompt / block) * block_bytes


def test_counters_equal_the_records_and_the_hybrid_manager_stays_on(servers, traffic):
    stored = traffic["stored"]
    for name, kinds in (("chunked", ("alone", "batch", "cached")), ("whole", ("whole",))):
        metrics = servers[name].metrics()
        records = [stored[r["id"] + "-0"]["vllm"]["window"] for k in kinds for r in traffic["responses"][k]]
        assert metrics["sparseety:window_freed_blocks_total"] == sum(w["freed_blocks"] for w in records)
        assert metrics["sparseety:window_freed_bytes_total"] == sum(w["freed_bytes"] for w in records)
        log = servers[name].log_path.read_text(errors="replace")
        assert "Disabling hybrid" not in log and "hybrid kv cache manager is disabled" not in log.lower()


def test_report_shows_window_edges_and_the_memory_the_windows_freed(servers, traffic, tmp_path):
    """The report of a vLLM Gemma 3 trace, in Chromium: window edges on the timeline (each sliding layer
    hides ``max(0, P + s - w)`` positions at step ``s``), the skipped count, and the freed memory per group."""
    from report_page import report_page

    from sparseety.report.data import trace_view
    from sparseety.store import load_trace

    server = servers["chunked"]
    response = traffic["responses"]["alone"][0]
    rid = response["id"] + "-0"
    record = traffic["stored"][rid]
    window = record["vllm"]["window"]
    prompt = len(response["choices"][0]["prompt_token_ids"])
    view = trace_view(load_trace(server.trace_dir, rid))
    edges = view["timeline"].window_edge
    for layer in (int(k) for k in window["layers"]):
        assert edges[layer].tolist() == [max(0, prompt + s - 1 - WINDOW + 1) for s in range(view["steps"])]
    assert not edges[5].any()  # a global layer sees everything
    frees = view["window_frees"]
    assert [g["bytes"] for g in frees["groups"]] == [window["freed_bytes"] // 5] * 5
    assert len(frees["bytes"]) == view["steps"] and frees["bytes"][-1] == window["freed_bytes"]
    assert frees["bytes"] == sorted(frees["bytes"])

    with report_page(server.trace_dir, rid, tmp_path / "vllm-gemma3-windows.html") as page:
        cards = page.locator('section[data-section="summary"]')
        skipped = cards.locator("tr", has_text="skipped (sliding window)").locator("td").nth(1).inner_text()
        assert skipped == str(record["skipped_events"])
        assert f"({window['freed_blocks']} blocks)" in cards.locator("tr", has_text="KV cache peak").inner_text()
        timeline = page.locator('section[data-section="timeline"]')
        assert "outside the window (sliding layers)" in timeline.inner_text()
        assert timeline.locator("canvas.timeline").count() == 1
        section = page.locator('section[data-section="window-frees"]')
        assert f"in {window['freed_blocks']} blocks" in section.inner_text()
        assert section.locator("svg path[stroke-width='2']").count() == 1  # freed so far, all windowed groups
        assert section.locator("svg circle").count() == view["steps"]

