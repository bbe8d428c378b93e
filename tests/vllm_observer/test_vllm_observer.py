"""SparSEEty's observer inside a real ``vllm serve`` (side venv, loopback, prefix caching, KV events,
ngram speculative decoding, a 1,024-token KV cache): one server for the whole module, one round of
traffic, then each test checks one part of the token lifecycle against what vLLM itself reports.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_server import BLOCK_SIZE, MAX_BATCHED_TOKENS, VllmServer, require_vllm, wait_for_vllm_rows

from sparseety.store import connect, load_trace

pytestmark = pytest.mark.model

WORDS = ("river stone lamp orbit cedar violet signal harbor copper meadow lantern quartz ember falcon "
         "willow prism canyon tide glacier saffron beacon thistle cobalt marble").split()
PREFIX = ("The GNU General Public License is a free, copyleft license for software and other kinds of "
          "works. It guarantees your freedom to share and change all versions of a program. ") * 6


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm")
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log").start()
    print(f"vllm serve started in {srv.startup_s:.1f} s")
    yield srv
    srv.stop()


def _row_for(con, prompt_ids: list[int], output_ids: list[int]) -> dict:
    rows = con.sql("SELECT request_id, prompt_token_ids, output_token_ids, extra_json FROM requests "
                   "WHERE policy = 'vllm'").fetchall()
    for request_id, prompt, output, extra in rows:
        if list(prompt or []) == prompt_ids and list(output or []) == output_ids:
            return {"request_id": request_id, "extra": json.loads(extra)}
    raise AssertionError(f"no stored request with prompt {prompt_ids[:8]}... and output {output_ids[:8]}...")


@pytest.fixture(scope="module")
def traffic(server):
    """All requests, sent once: a shared-prefix pair, distinct prompts that overflow the prefix cache, and
    concurrent long generations that overflow the KV cache (preemption)."""
    before = server.metrics()
    prefix_pair = [server.complete(PREFIX + "First question: what does it guarantee?", 16),
                   server.complete(PREFIX + "Second question: who may change it?", 16)]
    distinct = [server.complete(f"Note {i}: " + words(i, 220), 8) for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        long_runs = list(pool.map(
            lambda i: server.complete(f"Story {i}: " + words(100 + i, 200), 320, ignore_eos=True), range(3)))
    responses = prefix_pair + distinct + long_runs
    expected = len(responses)

    wait_for_vllm_rows(server.trace_dir, expected)
    time.sleep(2.5)  # one more KV-event window after the last request
    after = server.metrics()
    con = connect(server.trace_dir)
    rows = [_row_for(con, r["choices"][0]["prompt_token_ids"], r["choices"][0]["token_ids"]) for r in responses]
    return {"before": before, "after": after, "responses": responses, "rows": rows, "con": con,
            "prefix_pair": (0, 1), "distinct": range(2, 8), "long": range(8, 11)}


def delta(traffic, name: str) -> float:
    return traffic["after"].get(name, 0.0) - traffic["before"].get(name, 0.0)


def test_every_request_is_stored_with_vllm_provenance(server, traffic):
    assert len({r["request_id"] for r in traffic["rows"]}) == len(traffic["responses"])
    trace = load_trace(server.trace_dir, traffic["rows"][0]["request_id"])
    prov = trace.document["provenance"]
    assert prov["engine"] == "vllm" and prov["vllm_version"] == "0.32.0"
    assert trace.document["usage"]["prompt_tokens"] == traffic["responses"][0]["usage"]["prompt_tokens"]
    from sparseety.schema import SCHEMA_VERSION

    [(version,)] = traffic["con"].sql("SELECT DISTINCT schema_version FROM requests").fetchall()
    assert version == SCHEMA_VERSION


def test_shared_prefix_cached_tokens_equal_vllms(traffic):
    con = traffic["con"]
    first, second = (traffic["rows"][i] for i in traffic["prefix_pair"])
    response = traffic["responses"][1]
    vllm_cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert vllm_cached >= 4 * BLOCK_SIZE and vllm_cached % BLOCK_SIZE == 0
    assert second["extra"]["vllm"]["num_cached_tokens"] == vllm_cached
    assert traffic["responses"][0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = con.sql("SELECT position, token_id FROM token_events WHERE request_id = ? AND event = 'cached' "
                     "ORDER BY position", params=[second["request_id"]]).fetchall()
    prompt = response["choices"][0]["prompt_token_ids"]
    assert [p for p, _ in cached] == list(range(vllm_cached))
    assert [t for _, t in cached] == prompt[:vllm_cached]
    # the first request computed those blocks and the KV stream says they entered the cache
    stored = con.sql("SELECT count(*) FROM token_events WHERE request_id = ? AND event = 'kv_stored'",
                     params=[first["request_id"]]).fetchall()[0][0]
    assert stored >= vllm_cached
    assert second["extra"]["vllm"]["prefix_cache_blocks"][: vllm_cached // BLOCK_SIZE] == \
        first["extra"]["vllm"]["prefix_cache_blocks"][: vllm_cached // BLOCK_SIZE]
    assert delta(traffic, "sparseety:cached_prompt_tokens_total") == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in traffic["responses"])


def test_chunked_prefill_steps_are_recorded(traffic):
    con = traffic["con"]
    checked = 0
    for r, resp in zip(traffic["rows"], traffic["responses"], strict=True):
        info = r["extra"]["vllm"]
        if info["num_preemptions"]:
            continue  # a resumed request prefills again: more chunks than its prompt
        prompt_len = len(resp["choices"][0]["prompt_token_ids"])
        cached = info["num_cached_tokens"]
        chunks = info["prefill_chunks"]
        assert chunks, r["request_id"]
        assert chunks[0][0] == cached and sum(n for _, n in chunks) == prompt_len - cached
        assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:], strict=False))  # contiguous
        assert all(n <= MAX_BATCHED_TOKENS for _, n in chunks)
        rows = con.sql("SELECT step, position, score FROM token_events WHERE request_id = ? AND "
                       "event = 'prefill_chunk' ORDER BY step", params=[r["request_id"]]).fetchall()
        assert [(p, int(n)) for _, p, n in rows] == [tuple(c) for c in chunks]
        if prompt_len - cached > MAX_BATCHED_TOKENS:
            assert len(chunks) >= 2
            checked += 1
    assert checked > 0, "no prompt was long enough to be prefilled in chunks"


def _windows(con) -> list[dict]:
    rows = con.sql("SELECT request_id, extra_json FROM requests WHERE policy = 'vllm-prefix-cache'").fetchall()
    return [{"request_id": rid, **json.loads(extra)["vllm_kv"]} for rid, extra in rows]


def test_evicted_blocks_are_token_events_and_were_stored_before(traffic):
    con = traffic["con"]
    windows = sorted(_windows(con), key=lambda w: w["first_seq"])
    blocks = [b for w in windows for b in w["blocks"]]
    removed = [b for b in blocks if b["event"] == "removed"]
    assert len(removed) > 0, "the small KV cache should have evicted prefix-cache blocks"
    stored_at = {}
    for b in blocks:
        if b["event"] == "stored":
            stored_at.setdefault(b["hash"], b["seq"])
    for b in removed:
        assert b["hash"] in stored_at and stored_at[b["hash"]] <= b["seq"], b
    assert windows[-1]["removed_unknown_total"] == 0 and windows[-1]["dropped_changes_total"] == 0
    # the evicted tokens are rows of token_events, and they are the tokens of the prompts that used them
    prompts = {r["request_id"]: resp["choices"][0]["prompt_token_ids"]
               for r, resp in zip(traffic["rows"], traffic["responses"], strict=True)}
    total = con.sql("SELECT count(*) FROM token_events WHERE event = 'kv_removed'").fetchall()[0][0]
    assert total == sum(b["tokens"] for b in removed)
    checked = 0
    for w in windows:
        # a window's kv_removed rows follow its removed blocks in order (seq), block after block
        rows = con.sql("SELECT position, token_id, layer FROM token_events WHERE request_id = ? AND "
                       "event = 'kv_removed' ORDER BY seq", params=[w["request_id"]]).fetchall()
        offset = 0
        for b in (b for b in w["blocks"] if b["event"] == "removed"):
            part, offset = rows[offset : offset + b["tokens"]], offset + b["tokens"]
            assert b["depth"] >= 0, b  # the subscriber saw every block's chain from its first block
            start = b["depth"] * BLOCK_SIZE
            assert [p for p, _, _ in part] == list(range(start, start + b["tokens"]))
            assert {layer for _, _, layer in part} == {b["depth"]}
            for rid in b["requests"]:
                if rid in prompts:
                    assert [t for _, t, _ in part] == prompts[rid][start : start + b["tokens"]]
                    checked += 1
        assert offset == len(rows)
    assert checked > 0, "no evicted block was joined to the request whose prompt held it"
    assert delta(traffic, "sparseety:kv_blocks_evicted_total") == len(removed)


def test_preemption_is_recorded(traffic):
    preempted_vllm = delta(traffic, "vllm:num_preemptions_total")
    assert preempted_vllm > 0, "three 520-token sequences in a 1,024-token KV cache should preempt"
    rows = traffic["rows"]
    assert sum(r["extra"]["vllm"]["num_preemptions"] for r in rows) == preempted_vllm
    assert delta(traffic, "sparseety:preemptions_total") == preempted_vllm
    freed = sum(r["extra"]["vllm"]["recomputed_tokens"] for r in rows)
    assert freed > 0 and delta(traffic, "sparseety:preempted_freed_tokens_total") == freed
    assert 0 <= delta(traffic, "sparseety:preempted_recomputed_tokens_total") <= freed
    con = traffic["con"]
    for r, resp in zip(rows, traffic["responses"], strict=True):
        info = r["extra"]["vllm"]
        n = con.sql("SELECT count(*) FROM token_events WHERE request_id = ? AND event = 'recomputed'",
                    params=[r["request_id"]]).fetchall()[0][0]
        prompt_len = len(resp["choices"][0]["prompt_token_ids"])
        assert n == info["recomputed_tokens"] == sum(prompt_len + k for k in info["preempted_at_output_tokens"])
        assert len(info["preempted_at_output_tokens"]) == info["num_preemptions"]


def test_speculative_drafts_add_up_and_match_vllms_counters(traffic):
    con = traffic["con"]
    total_drafted = total_accepted = 0
    for r in traffic["rows"]:
        spec = r["extra"]["vllm"]["spec_decode"]
        counts = dict(con.sql("SELECT event, count(*) FROM token_events WHERE request_id = ? AND event IN "
                              "('draft_accepted', 'draft_rejected') GROUP BY event",
                              params=[r["request_id"]]).fetchall())
        drafted = spec["num_draft_tokens"] if spec else 0
        accepted = spec["num_accepted_tokens"] if spec else 0
        assert counts.get("draft_accepted", 0) == accepted
        assert counts.get("draft_rejected", 0) == drafted - accepted
        assert sum(spec["per_step_drafted"] or []) == drafted if spec else True
        total_drafted += drafted
        total_accepted += accepted
    assert total_drafted > 0 and 0 < total_accepted < total_drafted
    assert total_drafted == delta(traffic, "vllm:spec_decode_num_draft_tokens_total")
    assert total_accepted == delta(traffic, "vllm:spec_decode_num_accepted_tokens_total")
    assert total_drafted == delta(traffic, "sparseety:draft_tokens_total")
    assert total_drafted - total_accepted == delta(traffic, "sparseety:draft_rejected_tokens_total")


def test_vllm_greedy_tokens_equal_sparseetys_dense(traffic, smollm_engine):
    from sparseety.engine.inputs import EncodedInput
    from sparseety.policies import build_policy
    import torch

    for index in (*traffic["prefix_pair"], 2, 3):
        choice = traffic["responses"][index]["choices"][0]
        encoded = EncodedInput(torch.tensor([choice["prompt_token_ids"]], dtype=torch.long))
        dense = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=len(choice["token_ids"]),
                                       tier=1)
        assert dense.output_ids == choice["token_ids"], index


def test_audit_usage_explains_vllms_cached_tokens(server, traffic, tmp_path):
    """`sparseety audit-usage` against this vllm serve: counts agree and cached_tokens is explained."""
    import subprocess
    import sys
    from pathlib import Path

    lines = [{"prompt": PREFIX + "Audit question one?"}, {"prompt": PREFIX + "Audit question two?"},
             {"messages": [{"role": "user", "content": "Name a prime number."}]}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = subprocess.run(
        [str(Path(sys.executable).with_name("sparseety")), "audit-usage", "--base-url", server.url + "/v1",
         "--model", server.model, "--tokenizer", "smollm2-135m", "--requests", str(requests), "--json",
         "--timeout", "300"],
        capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    checks = report["checks"]
    assert report["disagreements"] == 0, checks
    first, second, chat = checks
    assert first["server_cached"] is not None and second["server_cached"] >= 4 * BLOCK_SIZE
    assert second["server_cached"] % BLOCK_SIZE == 0 and second["server_cached"] < second["server_prompt"]
    assert f"{second['server_cached']} of the {second['server_prompt']} prompt tokens came from the server's " \
           "prefix cache" in second["cached_note"]
    assert chat["server_cached"] is not None and chat["cached_note"]


def test_project_tools_read_vllm_traces(server, traffic, tmp_path):
    """`traces show`, `report` and `query` run unchanged on what the observer wrote."""
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).with_name("sparseety"))
    request_id = traffic["rows"][1]["request_id"]
    shown = subprocess.run([cli, "traces", "show", "--trace-dir", str(server.trace_dir), request_id],
                           capture_output=True, text=True, check=True).stdout
    assert request_id in shown and "policy vllm" in shown and "cached.position" in shown
    html = tmp_path / "report.html"
    subprocess.run([cli, "report", str(server.trace_dir), "--request-id", request_id, "-o", str(html)],
                   capture_output=True, text=True, check=True)
    assert request_id in html.read_text()
    cached = traffic["responses"][1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    out = subprocess.run([cli, "query", "--trace-dir", str(server.trace_dir), "--format", "json",
                          f"SELECT count(*) AS n FROM token_events WHERE request_id = '{request_id}' "
                          "AND event = 'cached'"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [{"n": cached}]
