"""SparSEEty's scoring policies inside a real ``vllm serve`` (``SPARSEETY_KV_POLICY=dense``: requests choose with
``vllm_xargs``): each of ``tova``, ``snapkv``, ``h2o``, ``streaming`` and ``kvzap`` (its vLLM variant,
``per_head=false``, reading the hidden states entering each layer's attention) gives the own engine's greedy tokens at the
same budget, alone and in one batch with a dense request and the other policies, and its trace holds the slots the
own engine evicts, step by step, layer by layer and head by head; the dense request gives the own engine's dense
tokens; a request asking for a policy vLLM cannot run gets HTTP 400 naming it. The prompts are prefilled in
two chunks (128 tokens a step), so ``snapkv``'s window, ``h2o``'s column sums and ``kvzap``'s per-token scores are
carried over chunks.

One request's failed eviction is its own: a fault injected into the scoring of one request (through a
``sitecustomize`` the worker imports, keyed on that request's prompt length) makes that request keep its newest
tokens once and then stop evicting, with one warning; the request beside it in the same batch still gives the own
engine's tokens, and vLLM goes on serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import textwrap
from pathlib import Path

import pytest

from vllm_server import BLOCK_SIZE, VllmServer, require_vllm

pytestmark = pytest.mark.model

BUDGET = 64
NEW_TOKENS = 32
POLICIES = ("tova", "snapkv", "h2o", "streaming", "kvzap", "dense")
#: the own engine's options for a policy's vLLM variant (kvzap keeps one count per layer inside vLLM)
VARIANTS = {"kvzap": {"per_head": False}}
LICENSES = Path("/usr/share/common-licenses")


FAULTY = (LICENSES / "GPL-3").read_text()[8000:8900]  #: a prompt whose scoring fails (its length is unique)
SITECUSTOMIZE = """
import os
_LEN = int(os.environ.get("SPARSEETY_TEST_FAULT_PROMPT_LEN", "0"))
if _LEN:
    from sparseety.integrations.vllm.evict import slots as eviction_slots

    _observe = eviction_slots.EvictingRequest.observe

    def observe(self, *args, **kwargs):
        if self.prompt_len == _LEN:
            raise RuntimeError("injected fault")
        return _observe(self, *args, **kwargs)

    eviction_slots.EvictingRequest.observe = observe
"""


def token_count(text: str) -> int:
    from transformers import AutoTokenizer

    from sparseety.models.registry import resolve_model_dir

    return len(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))(text)["input_ids"])


def prompts() -> list[str]:
    """Six prompts of about 150 tokens (more than the budget) from texts that ship on the machine."""
    return [(LICENSES / name).read_text()[start:start + 650] for name, start in
            (("GPL-3", 5000), ("Apache-2.0", 4000), ("MPL-2.0", 6000), ("LGPL-3", 1500), ("Apache-2.0", 9000),
             ("GPL-2", 3000))]


def xargs(policy: str) -> dict:
    asked = {"sparseety_policy": policy}
    if policy != "dense":
        asked["sparseety_budget"] = BUDGET
    return {"vllm_xargs": asked}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("eviction-policies")
    faulty = token_count(FAULTY)
    assert faulty not in {token_count(p) for p in prompts()}
    site = base / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    env = {"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_INTERVAL": "1", "SPARSEETY_TIER": "2",
           "SPARSEETY_SAMPLE_RATE": "1", "SPARSEETY_IMPORTANCE": "off", "SPARSEETY_TEST_FAULT_PROMPT_LEN": str(faulty),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log", extra_env=env,
                     speculative=False).start()
    try:
        yield srv
    finally:
        srv.stop()


def tokens(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def alone_responses(server):
    return {p: server.complete(text, NEW_TOKENS, ignore_eos=True, **xargs(p)) for p, text in zip(POLICIES, prompts())}


@pytest.fixture(scope="module")
def alone(alone_responses):
    return {p: tokens(out) for p, out in alone_responses.items()}


@pytest.fixture(scope="module")
def batched(server, alone):
    with concurrent.futures.ThreadPoolExecutor(len(POLICIES)) as pool:
        outs = pool.map(lambda pt: server.complete(pt[1], NEW_TOKENS, ignore_eos=True, **xargs(pt[0])),
                        zip(POLICIES, prompts()))
        return {p: tokens(o) for p, o in zip(POLICIES, outs)}


@pytest.fixture(scope="module")
def own_runs():
    import sparseety

    model = sparseety.load("smollm2-135m")
    out = {}
    for policy, text in zip(POLICIES, prompts()):
        budget = {} if policy == "dense" else {"budget": BUDGET}
        out[policy] = model.generate(text, policy=policy, max_new_tokens=NEW_TOKENS, chat=False,
                                     policy_opts=VARIANTS.get(policy, {}), **budget)
    return out


@pytest.fixture(scope="module")
def own(own_runs):
    return {p: list(run.output_ids) for p, run in own_runs.items()}


@pytest.fixture(scope="module")
def stored(server, alone_responses):
    """The stored record and evicted slots of each request served alone (once the observer wrote them)."""
    from sparseety.store import connect

    ids = {r["id"] + "-0": p for p, r in alone_responses.items()}
    rows = server.stored(list(ids), "policy, budget, evicted_positions, eviction_events, kv_cache_bytes_peak, "
                         "kv_cache_bytes_dense, extra_json, document_json")
    con = connect(server.trace_dir)
    return {ids[rid]: {"policy": r[0], "budget": r[1], "evicted_positions": r[2], "eviction_events": r[3],
                       "peak": r[4], "dense": r[5], "vllm": json.loads(r[6])["vllm"],
                       "kept": json.loads(r[7])["sparsity"]["kept_positions_final"],
                       "slots": {tuple(e) for e in con.sql(
                           "SELECT step, layer, kv_head, position FROM token_events WHERE request_id = ? "
                           "AND event = 'evicted'", params=[rid]).fetchall()}}
            for rid, r in rows.items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_alone_equals_the_own_engine(policy, alone, own):
    assert alone[policy] == own[policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_in_a_mixed_batch_equals_the_own_engine(policy, batched, own):
    assert batched[policy] == own[policy]


def test_eviction_changes_the_tokens(server, own):
    import sparseety

    model = sparseety.load("smollm2-135m")
    text = prompts()[0]
    dense = list(model.generate(text, policy="dense", max_new_tokens=NEW_TOKENS, chat=False).output_ids)
    assert dense != own["tova"]  # the comparison above could fail: eviction is visible in these tokens


def test_a_policy_vllm_cannot_run_gets_http_400_naming_it(server):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as info:
        server.complete(prompts()[-1], NEW_TOKENS, vllm_xargs={"sparseety_policy": "kvzip", "sparseety_budget": BUDGET})
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and error["param"] == "sparseety_policy"
    assert "sparseety_policy='kvzip' cannot run inside vLLM" in error["message"]


@pytest.mark.parametrize("policy", POLICIES[:-1])
def test_the_trace_holds_the_slots_the_own_engine_evicts(policy, stored, own_runs, alone_responses):
    record = stored[policy]
    # the own engine also evicts after the last forward; vLLM stops with the request (nothing to free)
    last = NEW_TOKENS - 2
    own_slots = {(e["step"], e["layer"], e["kv_head"], e["position"]) for e in own_runs[policy].events()
                 if e["event"] == "evicted" and e["step"] <= last}
    assert own_slots and record["slots"] == own_slots
    # what vLLM still held at the end: the own engine's final slots plus those it evicted after the last forward
    own_kept = own_runs[policy].run.kept_positions_final
    late = [e for e in own_runs[policy].events() if e["event"] == "evicted" and e["step"] > last]
    assert record["kept"].keys() == own_kept.keys() and late
    for layer, heads in own_kept.items():
        for head, positions in heads.items():
            extra = {e["position"] for e in late if (str(e["layer"]), str(e["kv_head"])) == (layer, head)}
            assert record["kept"][layer][head] == sorted({*positions, *extra}), (layer, head)
    assert (record["policy"], record["budget"]) == (policy, BUDGET)
    assert record["eviction_events"] == len(record["slots"])
    assert record["evicted_positions"] == len({s[3] for s in record["slots"]})
    eviction = record["vllm"]["eviction"]
    assert eviction["failure"] is None and eviction["compactions"] == NEW_TOKENS - 1
    # blocks back to vLLM's pool: the prompt's beyond the budget's, then at every later compaction the block the
    # budget's next token opened (the budget is two whole blocks)
    blocks = lambda tokens: -(-tokens // BLOCK_SIZE)  # noqa: E731
    prompt = alone_responses[policy]["usage"]["prompt_tokens"]
    assert BUDGET % BLOCK_SIZE == 0 and eviction["freed_blocks"] == blocks(prompt) - blocks(BUDGET) + NEW_TOKENS - 2
    assert record["peak"] < record["dense"]
    assert len(record["vllm"]["prefill_chunks"]) == 2  # the window and column sums crossed a chunk


def test_prometheus_counts_the_evicted_tokens_and_freed_blocks(server, stored):
    metrics = server.metrics()
    per_layer = sum(r["vllm"]["eviction"]["evicted_tokens_per_layer"] for r in stored.values() if r["vllm"]["eviction"])
    assert metrics["sparseety:evicted_tokens_total"] >= per_layer > 0
    assert metrics["sparseety:evicted_freed_blocks_total"] >= sum(
        r["vllm"]["eviction"]["freed_blocks"] for r in stored.values() if r["vllm"]["eviction"]) > 0
    assert stored["dense"]["vllm"]["eviction"] is None


@pytest.fixture(scope="module")
def faulty(server, stored):
    """The faulty request and a ``tova`` request beside it, at once (after the other tests' requests)."""
    pair = [(FAULTY, "tova"), (prompts()[0], "tova")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda tp: server.complete(tp[0], NEW_TOKENS, ignore_eos=True, **xargs(tp[1])), pair))


def test_the_neighbour_of_a_failing_request_gives_the_own_engines_tokens(faulty, own):
    import sparseety

    assert tokens(faulty[1]) == own["tova"]
    model = sparseety.load("smollm2-135m")
    assert tokens(faulty[0]) != list(model.generate(FAULTY, policy="tova", budget=BUDGET, max_new_tokens=NEW_TOKENS,
                                                    chat=False).output_ids)
    assert all(o["usage"]["completion_tokens"] == NEW_TOKENS for o in faulty)


def test_the_failure_is_warned_once_recorded_and_vllm_goes_on(server, faulty):
    log = server.log_tail(3000)
    assert log.count("stops evicting") == 1 and "injected fault" in log
    assert server.complete(prompts()[1], 4, **xargs("snapkv"))["usage"]["completion_tokens"] == 4
    failing, neighbour = faulty[0]["id"] + "-0", faulty[1]["id"] + "-0"
    found = {rid: json.loads(r[0])["vllm"]["eviction"] for rid, r in server.stored([failing, neighbour]).items()}
    assert "injected fault" in found[failing]["failure"] and found[failing]["compactions"] == 1
    assert found[neighbour]["failure"] is None and found[neighbour]["compactions"] == NEW_TOKENS - 1
