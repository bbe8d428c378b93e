"""Sliding windows inside ``vllm serve --data-parallel-size 2 --api-server-count 2`` on Gemma 3 270M: each
engine core's window frees reach the API server that owns the request, whose ``window`` rows, ranking and
freed blocks are those of one engine (:mod:`test_vllm_windows`). A module of its own so that its two engine
cores start after that module's two servers have stopped (four Gemma workers at once exhaust the memory
of a 2-core, 23 GiB machine)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_vllm_windows import NEW_TOKENS, WINDOW, WORDS, _check, _server, _wait, own  # noqa: F401 (own: a fixture)
from vllm_server import require_vllm

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def ranks_traffic(tmp_path_factory, gemma):
    """Gemma 3 behind ``--data-parallel-size 2 --api-server-count 2``: prompts past the window, four at once."""
    require_vllm()
    _, tokenizer = gemma
    # four processes share the cores: a worker's importance result can come seconds after its request finished
    server = _server(tmp_path_factory.mktemp("vllm-windows-dp"), "dp",
                     ["--data-parallel-size", "2", "--api-server-count", "2"],
                     extra_env={"SPARSEETY_IMPORTANCE_WAIT_S": "60"}).start()
    try:
        responses: list[dict] = []
        stored: dict[str, dict] = {}
        for batch in range(4):  # the kernel picks the API server per connection: more batches until both served
            prompts = [tokenizer(" ".join(WORDS[300 * i + 50 : 300 * i + 530])).input_ids
                       for i in range(4 * batch, 4 * batch + 4)]
            with ThreadPoolExecutor(4) as pool:
                sent = list(pool.map(lambda i: server.complete(i, NEW_TOKENS), prompts))
            responses += sent
            stored.update(_wait(server, sent))
            seen = {(r["vllm"]["api_server"], r["vllm"]["data_parallel_rank"]) for r in stored.values()}
            if {a for a, _ in seen} == {0, 1} and {d for _, d in seen} == {0, 1}:
                break
        yield {"responses": responses, "stored": stored}
    finally:
        server.stop()


def test_every_rank_and_api_server_records_its_requests_windows(ranks_traffic, own):
    """Each engine core's frees reach the API server that owns the request: rows, ranking and freed blocks
    as with one engine."""
    stored = ranks_traffic["stored"]
    ranks, api_servers = set(), set()
    for response in ranks_traffic["responses"]:
        _check(stored, response, own)
        record = stored[response["id"] + "-0"]["vllm"]
        ranks.add(record["data_parallel_rank"])
        api_servers.add(record["api_server"])
        choice = response["choices"][0]
        skipped = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 2 - WINDOW + 1
        assert record["window"]["freed_blocks"] == 5 * (skipped // (record["block_size"] or 32)), record["window"]
    assert ranks == {0, 1} and api_servers == {0, 1}, (ranks, api_servers)
