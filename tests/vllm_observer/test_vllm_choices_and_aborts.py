"""Every choice and every request is a row, against a real ``vllm serve`` (side venv, loopback; one server for the
module): the ``n`` choices of a completion (vLLM runs them as ``n`` child requests, ``<index>_<parent id>``) are ``n``
rows with their own ids and tokens, streamed or not; a stream its client closes is stored with what it produced and
``finish_reason`` ``abort``, in a bounded time; a request served alongside is stored as if alone. The join itself,
without a server, is ``test_vllm_choices_join.py``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.model

PROMPT = "The lighthouse keeper opened the old logbook and read"
STORED_WITHIN_S = 20.0  #: an aborted request is queued at once (no stats to wait for); well under STATS_WAIT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm-choices")
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log").start()
    print(f"vllm serve started in {srv.startup_s:.1f} s")
    yield srv
    srv.stop()


def rows_of(server, ids, timeout=120):
    """``request id -> (prompt ids, output ids, extra_json.vllm)`` once every one of ``ids`` is stored."""
    got = server.stored(ids, "prompt_token_ids, output_token_ids, extra_json", timeout=timeout)
    return {rid: (list(p or []), list(o or []), json.loads(e)["vllm"]) for rid, (p, o, e) in got.items()}


def open_stream(server, body: dict):
    request = urllib.request.Request(server.url + "/v1/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": server.model, "stream": True, "return_token_ids": True,
                                                      **body}).encode())
    return urllib.request.urlopen(request, timeout=600)


def chunks(response, limit: int | None = None):
    """The stream's data chunks (``limit``: stop after that many carrying tokens)."""
    out = []
    while limit is None or sum(1 for c in out if c["choices"] and c["choices"][0].get("token_ids")) < limit:
        line = response.readline()
        if not line:
            break
        line = line.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    return out


def streamed_tokens(parts) -> dict[int, list[int]]:
    """choice index -> the token ids the client received."""
    tokens: dict[int, list[int]] = {}
    for part in parts:
        for choice in part["choices"]:
            tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    return tokens


def test_every_choice_of_n_is_a_row_with_its_own_tokens(server):
    out = server.complete(PROMPT, 12, n=4, temperature=1.0, seed=7, ignore_eos=True)
    choices = {c["index"]: c for c in out["choices"]}
    assert sorted(choices) == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in choices.values()}) > 1  # sampled: the choices differ
    ids = [f"{i}_{out['id']}-0" for i in range(4)]  # vLLM's child ids without their random tail
    rows = rows_of(server, ids)
    assert len(set(rows)) == 4
    for i, rid in enumerate(ids):
        prompt, output, extra = rows[rid]
        assert output == choices[i]["token_ids"], (rid, output, choices[i]["token_ids"])
        assert prompt == choices[i]["prompt_token_ids"]
        assert extra["choice"] == i and extra["completion_id"] == f"{out['id']}-0"
        assert extra["finish_reason"] == "length" and extra["timings"]["e2e_s"] > 0  # joined to its own stats
    from sparseety.store import connect

    stored = connect(server.trace_dir).sql(f"SELECT request_id FROM requests WHERE request_id LIKE '%{out['id']}%'")
    assert sorted(r[0] for r in stored.fetchall()) == ids  # no row twice, none under the completion's own id


def test_every_streamed_choice_is_a_row(server):
    response = open_stream(server, {"prompt": PROMPT, "max_tokens": 10, "n": 2, "temperature": 1.0, "seed": 11,
                                    "ignore_eos": True})
    parts = chunks(response)
    response.close()
    tokens = streamed_tokens(parts)
    assert sorted(tokens) == [0, 1] and all(len(t) == 10 for t in tokens.values()), tokens
    completion = parts[0]["id"]
    rows = rows_of(server, [f"{i}_{completion}-0" for i in range(2)])
    for i in range(2):
        _, output, extra = rows[f"{i}_{completion}-0"]
        assert output == tokens[i] and extra["choice"] == i and extra["finish_reason"] == "length"


def test_an_aborted_stream_is_stored_and_its_neighbour_unaffected(server):
    neighbour: dict = {}

    def alongside():
        neighbour["response"] = server.complete("A neighbour's question: what is a river?", 48, ignore_eos=True)

    thread = threading.Thread(target=alongside)
    response = open_stream(server, {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True})
    thread.start()
    parts = chunks(response, limit=3)
    response.close()  # the client goes away mid-stream: vLLM aborts the request
    closed = time.monotonic()
    received = streamed_tokens(parts)[0]
    assert len(received) >= 3
    rid = parts[0]["id"] + "-0"
    _, output, extra = rows_of(server, [rid], timeout=STORED_WITHIN_S)[rid]
    stored_after = time.monotonic() - closed
    assert stored_after < STORED_WITHIN_S
    assert extra["finish_reason"] == "abort" and extra["choice"] is None
    assert output[:len(received)] == received and len(received) <= len(output) < 400, (received, output)
    assert extra["timings"]["e2e_s"] > 0 and "prefill_s" in extra["timings"]  # vLLM's own times, from its state
    # what it produced is the greedy continuation, as far as it went
    reference = server.complete(PROMPT, len(output), ignore_eos=True)["choices"][0]["token_ids"]
    assert output == reference

    thread.join(300)
    answer = neighbour["response"]["choices"][0]
    assert answer["finish_reason"] == "length" and len(answer["token_ids"]) == 48
    nid = neighbour["response"]["id"] + "-0"
    _, n_output, n_extra = rows_of(server, [nid])[nid]
    assert n_output == answer["token_ids"] and n_extra["finish_reason"] == "length"
    assert n_extra["timings"]["e2e_s"] > 0


def test_an_aborted_stream_of_n_choices_is_a_row_per_choice(server):
    response = open_stream(server, {"prompt": PROMPT, "max_tokens": 400, "n": 2, "temperature": 1.0, "seed": 5,
                                    "ignore_eos": True})
    parts = chunks(response, limit=6)
    response.close()
    received = streamed_tokens(parts)
    completion = parts[0]["id"]
    ids = [f"{i}_{completion}-0" for i in range(2)]
    rows = rows_of(server, ids, timeout=STORED_WITHIN_S)
    for i, rid in enumerate(ids):
        _, output, extra = rows[rid]
        got = received.get(i, [])
        assert extra["finish_reason"] == "abort" and extra["choice"] == i
        assert output[:len(got)] == got and len(output) < 400, (rid, got, output)


def test_no_row_was_lost(server):
    """After the module's traffic: nothing dropped, and the log has no observer failure."""
    metrics = server.metrics()
    assert metrics.get("sparseety:trace_records_dropped_total", 0.0) == 0.0
    log = server.log_path.read_text(errors="replace")
    assert "failed; vLLM is unaffected" not in log and "could not be built" not in log
