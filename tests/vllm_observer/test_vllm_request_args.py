"""Never down, never silent, against a real ``vllm serve`` (``SPARSEETY_KV_POLICY=dense``, ``SPARSEETY_KV_BUDGET=64``):

- every bad ``sparseety_*`` request arg gets HTTP 400 with vLLM's JSON error naming the arg (``param``), the value
  cut short and what is allowed, on ``/v1/completions`` and ``/v1/chat/completions``; the server answers the next
  request as before;
- good requests sent while bad ones arrive each get exactly the answer they get alone;
- the documented ``sparseety_policy_opts`` form (``key=value`` pairs in a string) is honoured, and a request that
  names only a policy takes the server's budget;
- a failure injected into each eviction and observer hook (through a ``sitecustomize`` every vLLM process
  imports; a file names the hook that fails) leaves vLLM answering that request and the next, and the next one's
  tokens equal its alone-answer; with the API server's check failing, a policy vLLM cannot run is served dense,
  recorded as refused and counted.

A second module-scoped server without ``SPARSEETY_KV_POLICY`` refuses eviction args (it cannot evict) and warns once
about a misspelled ``SPARSEETY_*`` variable; a bad ``SPARSEETY_KV_BUDGET`` stops ``vllm serve`` in one line before
the model loads.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_server import VllmServer, require_vllm, side_by_side

pytestmark = pytest.mark.model

BUDGET = 64
NEW_TOKENS = 12
LICENSES = Path("/usr/share/common-licenses")
TEXTS = [(LICENSES / name).read_text()[start:start + 650] for name, start in
         (("GPL-3", 20000), ("Apache-2.0", 5000), ("MPL-2.0", 3000), ("LGPL-3", 4000))]
GOOD = [("tova", TEXTS[0]), ("dense", TEXTS[1]), ("streaming", TEXTS[2]), ("snapkv", TEXTS[3])]

#: hooks a fault is injected into: (module, class or None, function); one process or another imports each
FAULTS = [
    ("sparseety.integrations.vllm.evict.hooks", "EngineCoreEviction", "admit"),
    ("sparseety.integrations.vllm.evict.hooks", "EngineCoreEviction", "before_schedule"),
    ("sparseety.integrations.vllm.evict.hooks", "EngineCoreEviction", "message"),
    ("sparseety.integrations.vllm.evict.hooks", "EngineCoreEviction", "receive"),
    ("sparseety.integrations.vllm.evict.hooks", "EngineCoreEviction", "freed"),
    ("sparseety.integrations.vllm.evict.worker", "WorkerEviction", "before_update"),
    ("sparseety.integrations.vllm.evict.worker", "WorkerEviction", "plan"),
    ("sparseety.integrations.vllm.evict.worker", "WorkerEviction", "layer"),
    ("sparseety.integrations.vllm.evict.worker", "WorkerEviction", "after_forward"),
    ("sparseety.integrations.vllm.evict.worker", "WorkerEviction", "outbox"),
    ("sparseety.integrations.vllm.vllm_api.adapter", None, "shift_inputs"),
    ("sparseety.integrations.vllm.request_guard", "_Guard", "problem"),
    ("sparseety.integrations.vllm.observe.observer", "Observer", "on_finished"),
    ("sparseety.integrations.vllm.observe.observer", "Observer", "on_finished_stats"),
    ("sparseety.integrations.vllm.observe.engine_core_hooks", None, "send"),
]
SITECUSTOMIZE = """
import importlib, os
_FILE = os.environ.get("SPARSEETY_TEST_FAULT_FILE")
_FAULTS = {faults!r}

def _failing(name, fn):
    def wrapper(*args, **kwargs):
        try:
            with open(_FILE) as f:
                failing = f.read().strip() == name
        except FileNotFoundError:
            failing = False
        if failing:
            with open(_FILE + ".fired", "a") as f:
                f.write(name + "\\n")
            raise RuntimeError("injected fault in " + name)
        return fn(*args, **kwargs)
    return wrapper

if _FILE:
    for module, cls, fn in _FAULTS:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, fn, _failing(f"{{cls or module.rpartition('.')[2]}}.{{fn}}", getattr(owner, fn)))
"""


def fault_name(module: str, cls: str | None, fn: str) -> str:
    return f"{cls or module.rpartition('.')[2]}.{fn}"


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "failing"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, fault_file):
    """The module's two servers, started side by side: one that evicts (with the fault injector) and one that
    does not (:func:`plain`)."""
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("request-args")
    site = base / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE.format(faults=FAULTS)))
    env = {"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_BUDGET": str(BUDGET), "SPARSEETY_KV_INTERVAL": "1",
           "SPARSEETY_TIER": "2", "SPARSEETY_IMPORTANCE": "off", "SPARSEETY_TEST_FAULT_FILE": str(fault_file),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    evicting = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log", extra_env=env,
                          speculative=False)
    other = tmp_path_factory.mktemp("no-eviction")
    plain = VllmServer(resolve_model_dir("smollm2-135m"), other / "traces", other / "vllm.log", speculative=False,
                       extra_env={"SPARSEETY_KV_POLCY": "tova"})
    with side_by_side(evicting, plain):
        yield evicting, plain


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def xargs(policy: str) -> dict:
    return {"sparseety_policy": policy, **({} if policy == "dense" else {"sparseety_budget": BUDGET})}


def tokens(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def ask(server: VllmServer, policy: str, text: str) -> list[int]:
    return tokens(server.complete(text, NEW_TOKENS, ignore_eos=True, vllm_xargs=xargs(policy)))


@pytest.fixture(scope="module")
def alone(server):
    return {policy: ask(server, policy, text) for policy, text in GOOD}


def post_raw(server: VllmServer, path: str, body: str) -> tuple[int, dict]:
    """POST ``body`` as sent (JSON as a client may write it: ``1e400``, ``Infinity``, ``true``)."""
    request = urllib.request.Request(server.url + path, data=body.encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def completion_body(server: VllmServer, xargs_json: str, chat: bool = False) -> str:
    prompt = ('"messages": [{"role": "user", "content": "Hello"}]' if chat else f'"prompt": {json.dumps(TEXTS[0])}')
    return (f'{{"model": {json.dumps(server.model)}, {prompt}, "max_tokens": 4, "temperature": 0, '
            f'"vllm_xargs": {xargs_json}}}')


LONG = "x" * 100_000
BAD = [  # (vllm_xargs as JSON text, the arg named, words of the message)
    ('{"sparseety_policy": "tova", "sparseety_budget": 1e400}', "sparseety_budget", "=inf is not an integer in [1, 1000000000]"),
    ('{"sparseety_policy": "tova", "sparseety_budget": Infinity}', "sparseety_budget", "=inf is not an integer"),
    ('{"sparseety_policy": "tova", "sparseety_budget": 1e300}', "sparseety_budget", "=1e+300 is not an integer"),
    ('{"sparseety_policy": "tova", "sparseety_budget": true}', "sparseety_budget", "=True is not an integer"),
    ('{"sparseety_policy": "tova", "sparseety_ratio": true}', "sparseety_ratio", "=True is not a number in [0, 1)"),
    ('{"sparseety_policy": "tova", "sparseety_budget": -1}', "sparseety_budget", "=-1 is not an integer"),
    ('{"sparseety_policy": "tova", "sparseety_budget": "\\u0666\\u0664"}', "sparseety_budget", "is not an integer"),
    ('{"sparseety_policy": "tova", "sparseety_ratio": 1.0}', "sparseety_ratio", "=1.0 is not a number in [0, 1)"),
    ('{"sparseety_policy": "tova", "sparseety_budget": 32, "sparseety_ratio": 0.5}', "sparseety_ratio", "both given"),
    ('{"sparseety_polcy": "tova", "sparseety_budget": 32}', "sparseety_polcy",
     "is not a SparSEEty request arg (did you mean sparseety_policy?)"),
    ('{"sparseety_policy": "tova", "sparseety_budegt": 32}', "sparseety_budegt", "(did you mean sparseety_budget?)"),
    ('{"sparseety_policy": "nope", "sparseety_budget": 32}', "sparseety_policy", "'nope' is not a policy that runs"),
    ('{"sparseety_policy": "kvzip", "sparseety_budget": 32}', "sparseety_policy", "'kvzip' cannot run inside vLLM"),
    (json.dumps({"sparseety_policy": LONG, "sparseety_budget": 32}), "sparseety_policy", "(100000 chars) is not a"),
    ('{"sparseety_policy": "dense", "sparseety_budget": 32}', "sparseety_budget", "dense keeps every token"),
    ('{"sparseety_policy": "tova", "sparseety_budget": 32, "sparseety_policy_opts": "bogus=1"}', "sparseety_policy",
     "unknown option 'bogus'"),
    ('{"sparseety_tier": 2}', "sparseety_tier", "=2 is not 3"),
    ('{"sparseety_importance": "loud"}', "sparseety_importance", "'loud' is not one of value, attention, output, off"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("xargs_json, arg, words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_arg_gets_http_400_naming_it(server, alone, xargs_json, arg, words, chat):
    status, body = post_raw(server, "/v1/chat/completions" if chat else "/v1/completions",
                            completion_body(server, xargs_json, chat))
    assert status == 400, body
    error = body["error"]
    assert error["param"] == arg and error["code"] == 400 and error["type"] == "BadRequestError"
    assert words in error["message"] and len(error["message"]) < 1000


def test_the_server_answers_as_before_after_bad_requests(server, alone):
    assert post_raw(server, "/v1/completions", completion_body(server, BAD[0][0]))[0] == 400
    for policy, text in GOOD:
        assert ask(server, policy, text) == alone[policy], policy


def test_good_requests_among_bad_ones_get_their_alone_answers(server, alone):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        good = [pool.submit(ask, server, policy, text) for policy, text in GOOD * 2]
        bad = [pool.submit(post_raw, server, "/v1/completions", completion_body(server, b[0])) for b in BAD]
        assert all(f.result()[0] == 400 for f in bad)
        for (policy, _), future in zip(GOOD * 2, good):
            assert future.result() == alone[policy], policy


def test_policy_opts_in_the_documented_string_form_and_the_servers_budget(server):
    import sparseety

    text = TEXTS[2]
    out = server.complete(text, NEW_TOKENS, ignore_eos=True,
                          vllm_xargs={"sparseety_policy": "streaming", "sparseety_policy_opts": "sinks=8"})
    model = sparseety.load("smollm2-135m")
    own = model.generate(text, policy="streaming", budget=BUDGET, policy_opts={"sinks": 8}, max_new_tokens=NEW_TOKENS,
                         chat=False)
    assert tokens(out) == list(own.output_ids)
    rid = out["id"] + "-0"
    policy, budget, document = server.stored([rid], "policy, budget, document_json")[rid]
    assert (policy, budget) == ("streaming", BUDGET)  # the server's budget, as documented
    kept = json.loads(document)["sparsity"]["kept_positions_final"]["0"]["0"]
    assert set(range(8)) <= set(kept)  # sinks=8 was applied: the default (4 sinks) evicts position 4 first
    default = model.generate(text, policy="streaming", budget=BUDGET, max_new_tokens=NEW_TOKENS, chat=False)
    assert 4 not in default.run.kept_positions_final["0"]["0"]


@pytest.mark.parametrize("fault", FAULTS, ids=[fault_name(*f) for f in FAULTS])
def test_a_failing_hook_leaves_vllm_answering(server, alone, fault_file, fault):
    name = fault_name(*fault)
    fault_file.write_text(name)
    try:
        faulty = server.complete(TEXTS[0], NEW_TOKENS, ignore_eos=True, vllm_xargs=xargs("tova"))
        assert len(tokens(faulty)) == NEW_TOKENS  # answered, whatever the hook lost
    finally:
        fault_file.unlink()
    for policy, text in GOOD[1:3]:
        assert ask(server, policy, text) == alone[policy], (name, policy, server.log_tail(80))
    assert name in Path(f"{fault_file}.fired").read_text().split()  # the fault did fire


def test_what_only_the_engine_can_refuse_is_served_dense_recorded_and_counted(server, alone, fault_file):
    fault_file.write_text("_Guard.problem")  # the API server's check fails: the request reaches the engine core
    try:
        out = server.complete(TEXTS[1], NEW_TOKENS, ignore_eos=True,
                              vllm_xargs={"sparseety_policy": "kvzip", "sparseety_budget": BUDGET})
    finally:
        fault_file.unlink()
    assert tokens(out) == alone["dense"]
    rid = out["id"] + "-0"
    record = json.loads(server.stored([rid])[rid][0])["vllm"]["eviction"]
    assert record["policy"] == "kvzip" and "cannot run inside vLLM" in record["refused"]
    assert server.metrics()["sparseety:eviction_refused_total"] >= 1.0


# -- a server that does not evict ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(servers):
    return servers[1]


def test_a_server_that_does_not_evict_refuses_eviction_args(plain):
    status, body = post_raw(plain, "/v1/completions",
                            completion_body(plain, '{"sparseety_policy": "tova", "sparseety_budget": 32}'))
    assert status == 400 and body["error"]["param"] == "sparseety_policy"
    assert "this vLLM server does not evict" in body["error"]["message"]
    assert post_raw(plain, "/v1/completions", completion_body(plain, '{"sparseety_policy": "dense"}'))[0] == 200


def test_a_misspelled_variable_warns_once_naming_the_closest(plain):
    log = plain.log_path.read_text(errors="replace")
    line = "SPARSEETY_KV_POLCY is not a SparSEEty setting and is ignored; did you mean SPARSEETY_KV_POLICY?"
    assert log.count(line) == 1


def test_a_bad_setting_stops_vllm_in_one_line_before_the_model_loads(tmp_path):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    srv = VllmServer(resolve_model_dir("smollm2-135m"), tmp_path / "traces", tmp_path / "vllm.log", speculative=False,
                     extra_env={"SPARSEETY_KV_POLICY": "tova", "SPARSEETY_KV_BUDGET": "\u0666\u0664"})
    with pytest.raises(RuntimeError, match="vllm serve exited"):
        srv.start(timeout=300)
    srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert "sparseety: SPARSEETY_KV_BUDGET='\u0666\u0664' is not an integer in [1, 1000000000]; vLLM not started" in log
    assert "Traceback" not in log and "Loading weights" not in log and "Starting to load model" not in log


def test_every_choice_of_n_is_a_row_with_its_own_tokens(plain):
    out = plain.complete(TEXTS[0], 6, n=4, temperature=1.0, seed=7, ignore_eos=True)
    assert len(out["choices"]) == 4
    ids = [f"{i}_{out['id']}-0" for i in range(4)]
    rows = plain.stored(ids, "output_token_ids, extra_json")
    by_choice = {json.loads(extra)["vllm"]["choice"]: list(tokens_) for tokens_, extra in rows.values()}
    assert by_choice == {c["index"]: c["token_ids"] for c in out["choices"]}
    assert len({tuple(t) for t in by_choice.values()}) > 1  # sampled: the rows are not one choice four times


def test_a_stream_its_client_aborts_is_stored_with_what_it_produced(plain):
    body = json.dumps({"model": plain.model, "prompt": TEXTS[1], "max_tokens": 400, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(plain.url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    response = urllib.request.urlopen(request, timeout=600)
    chunks = []
    while len(chunks) < 3:
        line = response.readline().decode().strip()
        if line.startswith("data: {"):
            chunks.append(json.loads(line[6:]))
    response.close()  # the client goes away mid-stream
    rid = chunks[0]["id"] + "-0"
    output, extra = plain.stored([rid], "output_token_ids, extra_json")[rid]
    assert json.loads(extra)["vllm"]["finish_reason"] == "abort"
    assert 3 <= len(output) < 400
