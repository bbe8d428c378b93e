"""Important tokens of requests served by a real ``vllm serve`` (side venv, loopback; prefix caching, ngram
speculative decoding, prefill chunks of at most 128 tokens), against SparSEEty's own engine on the same
prompt: one server for the module, one round of traffic, then each test checks one property.

Exactness: for the same prompt and greedy output, the all-layer ranking from inside vLLM has the own
engine's top-16 positions in the same order (swaps allowed only where scores tie within 1e-4 relative),
and each layer's importance vector agrees within 1e-3 of that layer's largest score (both stored as
float16, as every trace stores them). vLLM's CPU kernel sums in another order: bit-equality is not asked.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from vllm_server import BLOCK_SIZE, MAX_BATCHED_TOKENS, VllmServer, require_vllm

from sparseety.store import connect, load_trace, should_sample

pytestmark = pytest.mark.model

TOP = 16
RATE = 0.5  #: the server's sample rate: requests get ids chosen to be sampled, or not, by the store's hash
TIE = 1e-4
LAYER_TOL = 1e-3
PROMPTS = {
    "value": "Alice keeps the red key in the blue box and Bob keeps the green key in the yellow box. "
             "The red key is in the",
    "attention": "Alice keeps the red key in the blue box and Bob keeps the green key in the yellow box. "
                 "The green key is in the",
    "output": "Alice keeps the red key in the blue box and Bob keeps the green key in the yellow box. "
              "The yellow box holds the",
    "batch": ["The capital of France is Paris, and the capital of Italy is",
              "Water boils at one hundred degrees Celsius, and it freezes at",
              "The three primary colors of light are red, green and"],
    "chunked": ("A lighthouse keeper wrote in his log every evening. " + "The sea was calm and the lamp was lit. "
                "A ship passed to the north. " * 14 + "On the last evening he wrote that the lamp"),
    "tier3": "One, two, three, four, five, six, seven,",
}
LICENSE = open("/usr/share/common-licenses/GPL-3").read().split()  # noqa: SIM115 (real text, on every Debian)
LONG = [" ".join(LICENSE[500 + 300 * i : 690 + 300 * i]) for i in range(3)]  # ~250 tokens each
SHARED = ("The GNU General Public License is a free, copyleft license for software and other kinds of works. "
          "It guarantees your freedom to share and change all versions of a program. ") * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm-importance")
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log",
                     extra_env={"SPARSEETY_SAMPLE_RATE": str(RATE)}).start()
    print(f"vllm serve started in {srv.startup_s:.1f} s")
    yield srv
    srv.stop()


def request_id(tag: str, sampled: bool) -> str:
    """A request id (the ``request_id`` field vLLM's API takes) whose stored id the hash samples, or not."""
    for i in range(10_000):
        rid = f"importance-{tag}-{i}"
        if should_sample(f"cmpl-{rid}-0", RATE) == sampled:  # vLLM serves it as cmpl-<id>, prompt 0: -0
            return rid
    raise AssertionError("no such id")


def _stored(con, response: dict) -> dict:
    rows = con.sql("SELECT request_id, tier, extra_json FROM requests WHERE request_id = ?",
                   params=[response["id"] + "-0"]).fetchall()
    if not rows:
        raise KeyError(response["id"])
    [(rid, tier, extra)] = rows
    return {"request_id": rid, "tier": tier, "extra": json.loads(extra)}


@pytest.fixture(scope="module")
def traffic(server):
    tags = iter(range(1000))

    def complete(prompt: str, max_tokens: int = 12, sampled: bool = True, **xargs) -> dict:
        extra = {"vllm_xargs": xargs} if xargs else {}
        return server.complete(prompt, max_tokens, request_id=request_id(str(next(tags)), sampled), **extra)

    out = {"value": complete(PROMPTS["value"]),
           "attention": complete(PROMPTS["attention"], sparseety_importance="attention"),
           "output": complete(PROMPTS["output"], sparseety_importance="output")}
    with ThreadPoolExecutor(3) as pool:  # one batch: their rows share forwards
        out["batch"] = list(pool.map(complete, PROMPTS["batch"]))
    out["chunked"] = complete(PROMPTS["chunked"], 8)
    out["tier3"] = complete(PROMPTS["tier3"], 6, sampled=False, sparseety_tier=3)  # forced, whatever the hash
    out["unsampled"] = complete(PROMPTS["tier3"] + " eight,", 6, sampled=False)
    out["shared"] = [complete(SHARED + "Question one: what does it guarantee?", 8),
                     complete(SHARED + "Question two: who may change it?", 8)]
    # the same prefix, but the request that fills the prefix cache records no importance of its own
    out["unshared"] = [complete("Preface. " + SHARED + "Question three: is it free?", 8, sampled=False),
                       complete("Preface. " + SHARED + "Question four: what is copyleft?", 8)]
    with ThreadPoolExecutor(3) as pool:  # 3 x (~250 + 200) tokens > the 1,024-token KV cache: preemption
        out["long"] = list(pool.map(lambda prompt: complete(prompt, 200), LONG))
    responses = [out["value"], out["attention"], out["output"], *out["batch"], out["chunked"], out["tier3"], out["unsampled"],
                 *out["shared"],
                 *out["unshared"], *out["long"]]
    deadline = time.monotonic() + 90
    con = None
    while time.monotonic() < deadline:
        try:
            con = connect(server.trace_dir)
            stored = {id(r): _stored(con, r) for r in responses}
            if all(s["extra"]["vllm"].get("importance", {}).get("status") for s in stored.values()):
                break
        except Exception:
            pass
        time.sleep(1)
    con = connect(server.trace_dir)
    return {"responses": out, "con": con, "stored": lambda r: _stored(con, r)}


def _own(engine, response: dict, mode: str):
    from sparseety.engine.inputs import EncodedInput
    from sparseety.policies.registry import build_policy

    choice = response["choices"][0]
    encoded = EncodedInput(torch.tensor([choice["prompt_token_ids"]]))
    result = engine.generate(encoded, build_policy("dense"), max_new_tokens=len(choice["token_ids"]), tier=2,
                             top_k=TOP, importance=mode)
    assert result.output_ids == choice["token_ids"], "vLLM's greedy output differs from the own engine's"
    return result


def _ranking(con, request_id: str, layer: int | None = None) -> list[tuple[int, float]]:
    where = "layer IS NULL" if layer is None else f"layer = {int(layer)}"
    return [(p, s) for p, s in con.sql(f"SELECT position, score FROM important_tokens WHERE request_id = ? AND "
                                       f"{where} ORDER BY rank", params=[request_id]).fetchall()]


def assert_same_ranking(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> int:
    """The same top positions in the same order, except where scores tie within ``TIE`` relative; returns
    how many ranks hold another position than the own engine's (tied swaps)."""
    got, want = got[:TOP], want[:TOP]
    assert len(got) == len(want) == TOP
    assert {p for p, _ in got} == {p for p, _ in want}, (got, want)
    score = dict(want)
    for (p_got, _), (p_want, s_want) in zip(got, want, strict=True):
        if p_got != p_want:  # a swap: only between scores that tie
            assert abs(score[p_got] - s_want) <= TIE * max(abs(s_want), 1e-12), (got, want)
    return sum(p_got != p_want for (p_got, _), (p_want, _) in zip(got, want, strict=True))


def layer_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per layer: the largest difference over that layer's largest score."""
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.astype(np.float64), want.astype(np.float64)
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


def check_exact(server, con, stored: dict, own, mode: str) -> float:
    info = stored["extra"]["vllm"]["importance"]
    assert info["status"] == "recorded" and info["mode"] == mode and info["unscored_positions"] == 0, info
    assert info["rows"] == info["expected_rows"] == len(own.output_ids)
    vllm_rank = _ranking(con, stored["request_id"])
    own_rank = [(t.position, t.score) for t in own.important_tokens if t.layer is None]
    swaps = assert_same_ranking(vllm_rank, own_rank)
    print(f"\n  {stored['request_id']} ({mode}): top-{TOP} of all layers, {TOP - swaps}/{TOP} ranks identical", end="; ")
    trace = load_trace(server.trace_dir, stored["request_id"])
    errors = layer_errors(trace.arrays["importance"], own.arrays["importance"])
    assert errors.max() <= LAYER_TOL, errors
    print(f"per-layer relative error at most {errors.max():.2e}")
    if mode != "attention":
        assert list(trace.arrays["sink.position"]) == list(own.arrays["sink.position"])
    for layer in (0, 15, 29):
        assert_same_ranking(_ranking(con, stored["request_id"], layer),
                            [(t.position, t.score) for t in own.important_tokens if t.layer == layer])
    return float(errors.max())


@pytest.mark.parametrize("mode", ["value", "attention", "output"])
def test_ranking_equals_the_own_engines(server, traffic, smollm_engine, mode):
    response = traffic["responses"][mode]
    check_exact(server, traffic["con"], traffic["stored"](response), _own(smollm_engine, response, mode), mode)


def test_requests_in_one_batch_rank_as_alone(server, traffic, smollm_engine):
    for response in traffic["responses"]["batch"]:
        check_exact(server, traffic["con"], traffic["stored"](response), _own(smollm_engine, response, "value"),
                    "value")


def test_chunked_prefill_ranks_as_unchunked(server, traffic, smollm_engine):
    response = traffic["responses"]["chunked"]
    stored = traffic["stored"](response)
    chunks = stored["extra"]["vllm"]["prefill_chunks"]
    assert len(chunks) >= 2 and all(n <= MAX_BATCHED_TOKENS for _, n in chunks), chunks
    check_exact(server, traffic["con"], stored, _own(smollm_engine, response, "value"), "value")


def test_tier3_request_stores_each_steps_vector(server, traffic):
    response = traffic["responses"]["tier3"]
    stored = traffic["stored"](response)
    trace = load_trace(server.trace_dir, stored["request_id"])
    steps = trace.arrays["step_importance"].astype(np.float32)
    n_out = len(response["choices"][0]["token_ids"])
    seen = len(response["choices"][0]["prompt_token_ids"]) + n_out - 1
    assert steps.shape == (n_out, 30, seen)
    for i in range(n_out):  # step i is the row of query position prompt_len - 1 + i: it sees that many keys
        width = seen - n_out + 1 + i
        assert not np.isnan(steps[i, :, :width]).any() and np.isnan(steps[i, :, width:]).all()
    total = np.nansum(steps, axis=0)
    assert np.abs(total - trace.arrays["importance"]).max() <= 5e-3 * np.abs(total).max()
    assert trace.document["tier"] == 3
    from sparseety.store.replay import replay_inputs  # replay reads the stored per-step vectors

    inputs = replay_inputs(trace)
    assert len(inputs) == 30 and inputs[3].layer == 3


def test_prefix_cache_hit_after_a_sampled_request_ranks_completely(server, traffic, smollm_engine):
    """The second request of a shared-prefix pair never computes its cached positions; the keys the first
    (sampled) request computed there complete it: the ranking equals the own engine's on the whole prompt."""
    first, second = traffic["responses"]["shared"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK_SIZE and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for response in (first, second):
        check_exact(server, traffic["con"], traffic["stored"](response), _own(smollm_engine, response, "value"),
                    "value")
    assert traffic["stored"](second)["extra"]["vllm"]["importance"]["shared_positions"] == cached


def test_prefix_cache_hit_positions_nobody_sampled_are_explicitly_unscored(server, traffic):
    con = traffic["con"]
    first, second = traffic["responses"]["unshared"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK_SIZE
    assert traffic["stored"](first)["tier"] == 1  # not sampled: no importance, and none of its keys kept
    stored = traffic["stored"](second)
    info = stored["extra"]["vllm"]["importance"]
    assert info["status"] == "recorded" and info["unscored_positions"] == cached and info["shared_positions"] == 0
    rows = con.sql("SELECT position, token_id FROM token_events WHERE request_id = ? AND event = 'unscored' "
                   "ORDER BY position", params=[stored["request_id"]]).fetchall()
    prompt = second["choices"][0]["prompt_token_ids"]
    assert rows == [(p, prompt[p]) for p in range(cached)]
    trace = load_trace(server.trace_dir, stored["request_id"])
    assert list(trace.arrays["unscored.position"]) == list(range(cached))
    assert not trace.arrays["importance"][:, :cached].any()
    assert trace.document["provenance"]["extraction"]["unscored"]
    ranked = con.sql("SELECT DISTINCT position FROM important_tokens WHERE request_id = ?",
                     params=[stored["request_id"]]).fetchall()
    assert ranked and all(p >= cached for (p,) in ranked)


def test_preempted_and_recomputed_request_ranks_as_alone(server, traffic, smollm_engine):
    con = traffic["con"]
    stored = [traffic["stored"](r) for r in traffic["responses"]["long"]]
    preempted = [i for i, s in enumerate(stored) if s["extra"]["vllm"]["num_preemptions"]]
    assert preempted, [s["extra"]["vllm"]["num_preemptions"] for s in stored]
    response = traffic["responses"]["long"][preempted[0]]
    check_exact(server, con, stored[preempted[0]], _own(smollm_engine, response, "value"), "value")


def test_sampling_is_the_stores_hash(server, traffic):
    """The worker captures exactly the requests the store keeps above tier 1 (the same hash of the same id),
    plus those forced to tier 3; the others cost it nothing but a look-up."""
    unsampled = traffic["stored"](traffic["responses"]["unsampled"])
    assert unsampled["tier"] == 1 and unsampled["extra"]["vllm"]["importance"] == {"status": "not_sampled"}
    assert not traffic["con"].sql("SELECT count(*) FROM important_tokens WHERE request_id = ?",
                                  params=[unsampled["request_id"]]).fetchall()[0][0]
    forced = traffic["stored"](traffic["responses"]["tier3"])
    assert not should_sample(forced["request_id"], RATE) and forced["tier"] == 3
    for response in (traffic["responses"]["value"], *traffic["responses"]["batch"]):
        stored = traffic["stored"](response)
        assert should_sample(stored["request_id"], RATE) and stored["tier"] == 2
        assert stored["extra"]["vllm"]["importance"]["status"] == "recorded"
