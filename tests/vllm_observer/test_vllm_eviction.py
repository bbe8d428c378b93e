"""``SPARSEETY_KV_POLICY=streaming`` inside a real ``vllm serve``: the greedy tokens equal the own engine's
``streaming`` at the same budget (and differ from dense), three requests at once fit a KV cache that could
not hold them dense, and a setting vLLM cannot honour stops vLLM at start with the reason."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from vllm_server import BLOCK_SIZE, NUM_BLOCKS, VllmServer, require_vllm

pytestmark = pytest.mark.model

BUDGET = 64
NEW_TOKENS = 200
COMPARED = 48  # tokens compared with the own engine (the rest is load)
LICENSES = Path("/usr/share/common-licenses")


def prompts() -> list[str]:
    """Three prompts of about 300 tokens from texts that ship on the machine."""
    return [(LICENSES / name).read_text()[start:start + 1400] for name, start in
            (("GPL-3", 2000), ("Apache-2.0", 1500), ("MPL-2.0", 3000))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("eviction")
    env = {"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": str(BUDGET), "SPARSEETY_KV_INTERVAL": "1"}
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log", extra_env=env,
                     speculative=False).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def outputs(server):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda p: server.complete(p, NEW_TOKENS, ignore_eos=True), prompts()))


def test_three_long_requests_at_once_without_preemption(server, outputs):
    # dense, each request needs ceil((~300 + 200) / 32) = 16 blocks: 48 of the 32 the cache has
    lengths = [o["usage"]["prompt_tokens"] + NEW_TOKENS for o in outputs]
    assert sum(-(-n // BLOCK_SIZE) for n in lengths) > NUM_BLOCKS
    assert all(o["usage"]["completion_tokens"] == NEW_TOKENS for o in outputs)
    assert server.metrics().get("vllm:num_preemptions_total", 0.0) == 0.0, server.log_tail()


def test_tokens_equal_the_own_engines_streaming(outputs):
    import sparseety

    model = sparseety.load("smollm2-135m")
    for prompt, out in zip(prompts(), outputs):
        got = out["choices"][0]["token_ids"][:COMPARED]
        own = model.generate(prompt, policy="streaming", budget=BUDGET, max_new_tokens=COMPARED, chat=False)
        assert got == list(own.output_ids), prompt[:40]
    dense = model.generate(prompts()[0], policy="dense", max_new_tokens=COMPARED, chat=False)
    assert list(dense.output_ids) != outputs[0]["choices"][0]["token_ids"][:COMPARED]


def test_a_setting_vllm_cannot_honour_stops_it_at_start(tmp_path):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    env = {"SPARSEETY_KV_POLICY": "kvzip", "SPARSEETY_KV_BUDGET": "64"}
    srv = VllmServer(resolve_model_dir("smollm2-135m"), tmp_path / "traces", tmp_path / "vllm.log", extra_env=env,
                     speculative=False)
    try:
        with pytest.raises(RuntimeError, match="vllm serve exited"):
            srv.start(timeout=300)
    finally:
        srv.stop()
    assert "SPARSEETY_KV_POLICY='kvzip' cannot run inside vLLM: kvzip scores from a reconstruction pass" in \
        srv.log_tail(200)


def test_a_preempted_evicting_request_resumes_and_evicts_again(server, outputs):
    """Two dense requests (``vllm_xargs``) outgrow the 32 blocks beside one evicting request: vLLM preempts the
    newest running request, the evicting one; it recomputes from its prompt after the dense ones finish, is
    evicted again, and every request gives the own engine's tokens up to its preemption."""
    import json
    import time

    import sparseety

    short = [(LICENSES / "GPL-2").read_text()[1000:1450], (LICENSES / "LGPL-2.1").read_text()[1000:1450]]
    long = (LICENSES / "Artistic").read_text()[0:1400]
    before = server.metrics().get("vllm:num_preemptions_total", 0.0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        dense = [pool.submit(server.complete, t, 400, ignore_eos=True, vllm_xargs={"sparseety_policy": "dense"})
                 for t in short]
        deadline = time.monotonic() + 60
        while server.metrics().get("vllm:num_requests_running", 0.0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        evicting = pool.submit(server.complete, long, 420, ignore_eos=True).result()
        dense_out = [f.result() for f in dense]
    assert server.metrics()["vllm:num_preemptions_total"] > before, server.log_tail()
    rid = evicting["id"] + "-0"
    info = json.loads(server.stored([rid])[rid][0])["vllm"]
    assert info["num_preemptions"] >= 1 and info["preempted_at_output_tokens"][0] >= COMPARED
    assert info["eviction"]["compactions"] >= 1  # evicted again after resuming
    assert info["eviction"]["failure"] is None and evicting["usage"]["completion_tokens"] == 420
    model = sparseety.load("smollm2-135m")
    upto = min(COMPARED, info["preempted_at_output_tokens"][0])
    own = model.generate(long, policy="streaming", budget=BUDGET, max_new_tokens=upto, chat=False)
    assert evicting["choices"][0]["token_ids"][:upto] == list(own.output_ids)
    for text, out in zip(short, dense_out):
        own_dense = model.generate(text, policy="dense", max_new_tokens=COMPARED, chat=False)
        assert out["choices"][0]["token_ids"][:COMPARED] == list(own_dense.output_ids)
