"""One request's failed eviction inside a real ``vllm serve`` is its own: a fault injected into the scoring of one
request (through a ``sitecustomize`` the worker imports) makes that request keep its newest tokens once and then
stop evicting, with one warning; the request beside it in the same batch still gives the own engine's tokens, and
vLLM goes on serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.model

BUDGET = 64
NEW_TOKENS = 24
LICENSES = Path("/usr/share/common-licenses")
TEXTS = [(LICENSES / "GPL-3").read_text()[8000:8600], (LICENSES / "Apache-2.0").read_text()[6000:6700]]

SITECUSTOMIZE = """
import os
_LEN = int(os.environ.get("SPARSEETY_TEST_FAULT_PROMPT_LEN", "0"))
if _LEN:
    from sparseety.integrations.vllm import eviction_slots

    _observe = eviction_slots.EvictingRequest.observe

    def observe(self, *args, **kwargs):
        if self.prompt_len == _LEN:
            raise RuntimeError("injected fault")
        return _observe(self, *args, **kwargs)

    eviction_slots.EvictingRequest.observe = observe
"""


def prompt_lengths() -> list[int]:
    from transformers import AutoTokenizer

    from sparseety.models.registry import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    return [len(tokenizer(t)["input_ids"]) for t in TEXTS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    lengths = prompt_lengths()
    assert lengths[0] != lengths[1]
    base = tmp_path_factory.mktemp("eviction-faults")
    site = base / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    env = {"SPARSEETY_KV_POLICY": "tova", "SPARSEETY_KV_BUDGET": str(BUDGET), "SPARSEETY_KV_INTERVAL": "1",
           "SPARSEETY_TIER": "1", "SPARSEETY_TEST_FAULT_PROMPT_LEN": str(lengths[0]),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log", extra_env=env,
                     speculative=False).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def outputs(server):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda t: server.complete(t, NEW_TOKENS, ignore_eos=True), TEXTS))


def test_the_neighbour_of_a_failing_request_gives_the_own_engines_tokens(outputs):
    import sparseety

    model = sparseety.load("smollm2-135m")
    own = [list(model.generate(t, policy="tova", budget=BUDGET, max_new_tokens=NEW_TOKENS, chat=False).output_ids)
           for t in TEXTS]
    assert outputs[1]["choices"][0]["token_ids"] == own[1]
    assert outputs[0]["choices"][0]["token_ids"] != own[0]  # the injected fault changed the failing request
    assert all(o["usage"]["completion_tokens"] == NEW_TOKENS for o in outputs)


def test_the_failure_is_warned_once_recorded_and_vllm_goes_on(server, outputs):
    log = server.log_tail(2000)
    assert log.count("stops evicting") == 1 and "injected fault" in log
    again = server.complete(TEXTS[1], 4)
    assert again["usage"]["completion_tokens"] == 4
    from sparseety.store import connect

    failing, neighbour = outputs[0]["id"] + "-0", outputs[1]["id"] + "-0"
    deadline = time.monotonic() + 120
    while True:
        try:
            rows = connect(server.trace_dir).sql("SELECT request_id, extra_json FROM requests").fetchall()
            found = {r[0]: json.loads(r[1])["vllm"]["eviction"] for r in rows}
            if failing in found and neighbour in found:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(1)
    assert "injected fault" in found[failing]["failure"] and found[failing]["compactions"] == 1
    assert found[neighbour]["failure"] is None and found[neighbour]["compactions"] == NEW_TOKENS - 1
