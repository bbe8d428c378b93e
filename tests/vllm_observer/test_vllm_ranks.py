"""Every data-parallel rank and every API server: the observer inside ``vllm serve --data-parallel-size 2
--api-server-count 2`` (two engine cores, two API-server processes, vLLM's CPU build, loopback).

vLLM's CPU build serves both here (it starts in about 100 s on two cores, against 40-80 s for one
engine), so nothing is simulated: 24 requests from 4 clients spread over both API servers (the kernel
hands each connection to one of them) and both engines (vLLM's DP coordinator balances them). Then:

- every request is stored exactly once, by the API server that owns it, with the engine that served it;
- the engine cores' channel records (prefill chunks, KV bytes) reached the owning API server, and so did
  each request's important tokens (the worker sends them to API server 0, which forwards the others');
- the KV events of both ranks are stored once (by API server 0), each record with its rank and the
  endpoint vLLM's ``GET /kv_event_sources`` names for that rank, and a request's prompt is joined to
  its own rank's cached blocks only;
- the ``sparseety:`` counters per ``engine`` equal vLLM's own per-engine counters and the stored rows.

A second, server-free test feeds two of vLLM's own ``ZmqEventPublisher`` (ranks 0 and 1, on the port
and the port plus one, as each DP rank's scheduler makes them) into one subscriber: the path a CPU build
that refused DP would leave.

Cost: one server start (96-144 s here) and about 20 s of traffic; the server-free test about 10 s.
``SPARSEETY_TEST_VLLM_API_SERVERS=1`` runs the same checks against ``--data-parallel-size 2
--api-server-count 1`` (one API server sees both engines and joins every prompt to its rank's blocks).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_server import ROOT, VENV, VllmServer, free_port, require_vllm, wait_for_vllm_rows

from sparseety.store import connect

pytestmark = pytest.mark.model

WORDS = ("river stone lamp orbit cedar violet signal harbor copper meadow lantern quartz ember falcon "
         "willow prism canyon tide glacier saffron beacon thistle cobalt marble").split()
SHARED = ("The GNU General Public License is a free, copyleft license for software and other kinds of "
          "works. It guarantees your freedom to share and change all versions of a program. ")
N_REQUESTS = 24
API_SERVERS = int(os.environ.get("SPARSEETY_TEST_VLLM_API_SERVERS", "2"))


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt(i: int) -> str:
    """Even: a shared prefix (prefix-cache hits on the rank that cached it); odd: its own first block."""
    return (SHARED + f"Question {i}: " + words(i, 12)) if i % 2 == 0 else f"Note {i}: " + words(1000 + i, 70)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``(family sample name, sorted labels)`` -> value from vLLM's ``/metrics``, with Prometheus's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def per_engine(samples: dict, name: str) -> dict[str, float]:
    """``engine`` label -> value of ``name`` (summed over the other labels)."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            engine = dict(labels).get("engine")
            out[engine] = out.get(engine, 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm-ranks")
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log",
                     extra_args=["--data-parallel-size", "2", "--api-server-count", str(API_SERVERS)]).start()
    print(f"vllm serve (DP 2, {API_SERVERS} API servers) started in {srv.startup_s:.1f} s")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def traffic(server):
    metric_names = ("sparseety:prompt_tokens_total", "sparseety:generation_tokens_total",
                    "sparseety:request_success_total", "sparseety:kv_blocks_stored_total",
                    "vllm:request_success_total", "vllm:generation_tokens_total")
    before = scrape(server.url)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: server.complete(prompt(i), 4), range(N_REQUESTS)))

    wait_for_vllm_rows(server.trace_dir, N_REQUESTS)
    time.sleep(2.5)  # one more KV-event window after the last request
    after = [scrape(server.url) for _ in range(2)]  # two scrapes: either API server may answer
    with urllib.request.urlopen(server.url + "/kv_event_sources", timeout=30) as response:
        sources = json.loads(response.read())
    con = connect(server.trace_dir)
    rows = con.sql("SELECT request_id, policy, prompt_token_ids, output_token_ids, extra_json FROM requests").fetchall()
    requests = [(rid, list(p or []), list(o or []), json.loads(x)) for rid, pol, p, o, x in rows if pol == "vllm"]
    kv = [(rid, json.loads(x)["vllm_kv"]) for rid, pol, p, o, x in rows if pol == "vllm-prefix-cache"]
    ranked = con.sql("SELECT DISTINCT request_id FROM important_tokens").fetchall()
    deltas = [{name: delta(per_engine(a, name), per_engine(before, name)) for name in metric_names} for a in after]
    return {"responses": responses, "requests": requests, "kv": kv, "deltas": deltas, "sources": sources,
            "ranked": ranked}


def test_every_request_is_stored_exactly_once_with_its_api_server_and_engine(traffic):
    requests = traffic["requests"]
    assert len(requests) == N_REQUESTS, [r[0] for r in requests]
    assert len({r[0] for r in requests}) == N_REQUESTS
    for response in traffic["responses"]:
        choice = response["choices"][0]
        match = [r for r in requests if r[1] == choice["prompt_token_ids"] and r[2] == choice["token_ids"]]
        assert len(match) == 1, (response["id"], len(match))
        assert match[0][0].startswith(response["id"])  # vLLM's request id: the response's id plus the choice
    servers = {r[3]["vllm"]["api_server"] for r in requests}
    engines = {r[3]["vllm"]["data_parallel_rank"] for r in requests}
    assert servers == set(range(API_SERVERS)), servers
    assert engines == {0, 1}, engines


def test_engine_core_records_reach_the_api_server_that_owns_the_request(traffic):
    """Prefill chunks and KV bytes come from the engine cores' scheduler hooks over the channel; each
    must reach the API server that records the request, whichever engine and server served it."""
    for rid, prompt_ids, _, extra in traffic["requests"]:
        info = extra["vllm"]
        chunks = info["prefill_chunks"]
        assert chunks, (rid, info["api_server"], info["data_parallel_rank"])
        assert sum(n for _, n in chunks) + info["num_cached_tokens"] == len(prompt_ids), (rid, chunks, info)
        assert info["kv_blocks_held"] and info["kv_blocks_held"] >= len(prompt_ids) // 32, (rid, info)


def test_important_tokens_reach_the_api_server_that_owns_the_request(traffic):
    """Every request is sampled (rate 1, tier 2): the worker's rows reach API server 0, which forwards
    those of API server 1's requests; each request's ranking is stored with its record, whichever server."""
    for rid, prompt_ids, output_ids, extra in traffic["requests"]:
        importance = extra["vllm"]["importance"]
        assert importance["status"] == "recorded", (rid, extra["vllm"]["api_server"], importance)
        assert importance["rows"] == len(output_ids)
    ranked = {r for (r,) in traffic["ranked"]}
    assert ranked == {r[0] for r in traffic["requests"]}, sorted({r[0] for r in traffic["requests"]} - ranked)


def test_kv_events_of_every_rank_are_stored_once_with_their_rank_and_endpoint(traffic):
    kv, sources = traffic["kv"], traffic["sources"]
    assert set(sources) == {"0", "1"}, sources
    ranks = {info["data_parallel_rank"] for _, info in kv}
    assert ranks == {0, 1}, ranks
    for _, info in kv:
        assert info["endpoint"] == sources[str(info["data_parallel_rank"])]["endpoint"], info["endpoint"]
    writers = {rid.split("-")[2] for rid, _ in kv}  # vllm-kv-<pid>-r<rank>-...: one process writes them
    assert len(writers) == 1, writers
    stored = {r: [b["hash"] for _, i in kv if i["data_parallel_rank"] == r for b in i["blocks"] if b["event"] == "stored"]
              for r in (0, 1)}
    for r in (0, 1):
        assert len(stored[r]) == len(set(stored[r])), f"rank {r}: a block stored twice"
        assert stored[r], f"rank {r} stored no blocks"
    assert all(i["seq_gaps_total"] == 0 for _, i in kv)  # each rank numbers its own stream


def test_a_prompt_is_joined_to_its_own_ranks_blocks(traffic):
    """API server 0 subscribes to both ranks' events and joins each of its requests' prompts to the
    blocks of the rank that served it; a prompt with its own first block is cached on that rank only."""
    kv = traffic["kv"]
    hashes = {r: {b["hash"] for _, i in kv if i["data_parallel_rank"] == r for b in i["blocks"]
                  if b["event"] == "stored"} for r in (0, 1)}
    shared_head = traffic["responses"][0]["choices"][0]["prompt_token_ids"][:8]  # request 0: shared prefix
    joined = {0: 0, 1: 0}
    for rid, prompt_ids, _, extra in traffic["requests"]:
        info = extra["vllm"]
        if info["api_server"] != 0:
            assert info["prefix_cache_blocks"] == []  # the KV-event stream is API server 0's (documented)
            continue
        rank = info["data_parallel_rank"]
        blocks = info["prefix_cache_blocks"]
        assert len(blocks) == len(prompt_ids) // 32, (rid, rank, blocks)
        assert set(blocks) <= hashes[rank], (rid, rank)
        if prompt_ids[:8] != shared_head:  # its own first block: never cached on the other rank
            assert blocks[0] not in hashes[1 - rank], (rid, rank)
        joined[rank] += 1
    assert joined[0] and joined[1], joined  # both ranks' joins were exercised


def test_sparseety_counters_per_engine_match_vllms_own_and_the_rows(traffic):
    rows = traffic["requests"]
    by_rank_prompt = {str(r): sum(len(p) for _, p, _, x in rows if x["vllm"]["data_parallel_rank"] == r) for r in (0, 1)}
    by_rank_count = {str(r): sum(1 for *_, x in rows if x["vllm"]["data_parallel_rank"] == r) for r in (0, 1)}
    by_rank_output = {str(r): sum(len(o) for _, _, o, x in rows if x["vllm"]["data_parallel_rank"] == r)
                      for r in (0, 1)}
    for d in traffic["deltas"]:  # the same from either API server: vLLM's multiprocess metric files
        assert d["sparseety:prompt_tokens_total"] == by_rank_prompt, d
        assert d["sparseety:request_success_total"] == by_rank_count == d["vllm:request_success_total"], d
        assert d["sparseety:generation_tokens_total"] == by_rank_output == d["vllm:generation_tokens_total"], d
        kv_stored = {str(r): float(sum(i["stored_blocks"] for _, i in traffic["kv"] if i["data_parallel_rank"] == r))
                     for r in (0, 1)}
        assert d["sparseety:kv_blocks_stored_total"] == kv_stored, (d, kv_stored)


RANKS_SCRIPT = textwrap.dedent('''
    import sys
    from sparseety.integrations.vllm.observe.kv_events import (
        KVEventSubscriber, RankedBlockIndex, rank_endpoint, subscriber_endpoint, wait_for)
    from vllm.distributed.kv_events import BlockStored, BlockRemoved, KVEventBatch, ZmqEventPublisher

    port = int(sys.argv[1])
    endpoint = f"tcp://127.0.0.1:{port}"
    for e in (endpoint, "tcp://*:5557", "tcp://*:0", "inproc://cache"):
        for r in (0, 1, 3):
            assert rank_endpoint(e, r) == ZmqEventPublisher.offset_endpoint_port(e, r), (e, r)
    places = [subscriber_endpoint(rank_endpoint(endpoint, r)) for r in (0, 1)]
    assert [a for a, _ in places] == [endpoint, f"tcp://127.0.0.1:{port + 1}"] and all(b for _, b in places)
    index = RankedBlockIndex()
    sub = KVEventSubscriber([a for a, _ in places], index, bind=True).start()
    assert sub.error is None, sub.error
    # as each DP rank's scheduler makes its publisher: the configured endpoint and its rank
    pubs = [ZmqEventPublisher(data_parallel_rank=r, endpoint=endpoint) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        for _ in range(100):
            pub.publish(KVEventBatch(ts=0.0, events=[]))
            if wait_for(lambda: sub.batches_by_rank.get(r, 0) > 0, 0.1):
                break
        assert sub.batches_by_rank.get(r, 0) > 0, f"rank {r} never arrived"
    sub.take()

    prompt = list(range(500, 564))
    same = BlockStored(block_hashes=[b"\\x01" * 32], parent_block_hash=None, token_ids=prompt[:32], block_size=32,
                       lora_id=None, medium="CPU", lora_name=None)
    only1 = BlockStored(block_hashes=[b"\\x02" * 32], parent_block_hash=b"\\x01" * 32, token_ids=prompt[32:],
                        block_size=32, lora_id=None, medium="CPU", lora_name=None)
    base = sub.batches
    pubs[0].publish(KVEventBatch(ts=1.0, events=[same]))  # both ranks cache the same first block
    pubs[1].publish(KVEventBatch(ts=1.0, events=[same, only1]))
    for i in range(5):  # interleaved streams, each with its own sequence numbers
        pubs[0].publish(KVEventBatch(ts=2.0 + i, events=[]))
        pubs[1].publish(KVEventBatch(ts=2.0 + i, events=[]))
    assert wait_for(lambda: sub.batches == base + 12, 5), sub.batches - base
    changes = sub.take()
    assert sorted((c.rank, c.kind, c.block.depth) for c in changes) == [(0, "stored", 0), (1, "stored", 0), (1, "stored", 1)]
    assert [b.block_hash for b in index.prompt_blocks(prompt, 32, rank=1)] == [b"\\x01" * 32, b"\\x02" * 32]
    assert [b.block_hash for b in index.prompt_blocks(prompt, 32, rank=0)] == [b"\\x01" * 32]
    pubs[1].publish(KVEventBatch(ts=9.0, events=[BlockRemoved(block_hashes=[b"\\x01" * 32], medium="CPU")]))
    assert wait_for(lambda: sub.batches == base + 13, 5)
    assert [(c.rank, c.kind) for c in sub.take()] == [(1, "removed")]
    assert len(index.prompt_blocks(prompt, 32, rank=0)) == 1  # rank 1's eviction leaves rank 0's copy
    assert index.prompt_blocks(prompt, 32, rank=1) == []
    assert sub.seq_gaps == 0 and sub.decode_errors == 0 and index.removed_unknown == 0
    for pub in pubs:
        pub.shutdown()
    sub.stop()
    print("ok")
''')


def test_two_ranks_event_streams_into_one_subscriber():
    """vLLM's own publishers for ranks 0 and 1 (port and port + 1) into one subscriber: every change
    carries its rank, each rank has its own block index and sequence numbers (no false gaps)."""
    require_vllm()
    port = free_port()
    while True:  # the port and the next one must both be free
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", RANKS_SCRIPT, str(port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
