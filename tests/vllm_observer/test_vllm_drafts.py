"""Draft identities, KV bytes, token texts and the model's name, from the hooks' readers to the stored trace,
without a server: one subprocess of the side venv (vLLM importable, no model loaded) drives the engine-core
readers (``drafts_of``, ``blocks_of``) with the shapes vLLM's scheduler hands them, feeds what they produce
to a real observer over its receiving handlers, and reads the trace it wrote back from the store. The live
counterpart (a real ``vllm serve``) is ``test_vllm_trace_report.py``.
"""

from __future__ import annotations

import subprocess
import textwrap

from vllm_server import ROOT, VENV, require_vllm

SCRIPT = textwrap.dedent('''
    import logging, os, sys, types
    from pathlib import Path
    tmp, model_dir = Path(sys.argv[1]), sys.argv[2]
    os.environ.pop("SPARSEETY_VLLM_CHANNEL", None)
    for var in [v for v in os.environ if v.startswith("SPARSEETY_")]:
        del os.environ[var]
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest
    from sparseety.integrations.vllm.vllm_api.wire_messages import Chunk, Draft, KVHeld
    from sparseety.integrations.vllm.observe.observer import Observer
    from sparseety.integrations.vllm.transport.settings import parse_settings
    from sparseety.store import connect, load_trace

    NS = types.SimpleNamespace

    # -- the engine core's reader: what update_from_output sees before vLLM appends the step's tokens --
    class Req(NS):
        def is_finished(self):
            return self.finished

    prompt = list(range(100, 110))  # 10 prompt tokens
    output = [7, 8, 9, 10, 11, 12, 13]  # what the request generated in the end
    # step 2: 2 tokens out so far, drafts for positions 12, 13, 14; the target accepted 2 and sampled its own
    reqs = {"a": Req(num_tokens=12, num_output_tokens=2, finished=False, num_stale_output_tokens=0,
                     drop_stale_output=False),
            "done": Req(num_tokens=5, num_output_tokens=1, finished=True),
            "nosample": Req(num_tokens=5, num_output_tokens=1, finished=False),
            "stale": Req(num_tokens=5, num_output_tokens=1, finished=False, num_stale_output_tokens=3,
                         drop_stale_output=True)}
    scheduler = NS(requests=reqs, num_sampled_tokens_per_step=1)
    sched_out = NS(scheduled_spec_decode_tokens={"a": [9, 10, 55], "done": [1], "nosample": [1], "stale": [1],
                                                 "gone": [1]})
    runner_out = NS(req_id_to_index={"a": 0, "done": 1, "nosample": 2, "stale": 3, "gone": 4},
                    sampled_token_ids=[[9, 10, 11], [3], [], [4], [5]])
    step2 = adapter.drafts_of(scheduler, sched_out, runner_out)
    assert step2 == [Draft("a", 2, 12, (9, 10, 55), 2)], step2
    # step 5 (5 tokens out, position 15): every draft rejected, the target's own token only
    reqs["a"].num_tokens, reqs["a"].num_output_tokens = 15, 5
    step5 = adapter.drafts_of(scheduler, NS(scheduled_spec_decode_tokens={"a": [1, 2]}),
                             NS(req_id_to_index={"a": 0}, sampled_token_ids=[[13]]))
    assert step5 == [Draft("a", 5, 15, (1, 2), 0)], step5
    assert adapter.drafts_of(scheduler, NS(scheduled_spec_decode_tokens={}), runner_out) == []

    # -- the KV blocks a request held, per KV-cache group (vLLM's null block 0 is not held) --
    group = NS(kv_cache_spec=NS(page_size_bytes=1000), layer_names=["l0", "l1", "l2"])
    kv_scheduler = NS(kv_cache_config=NS(kv_cache_groups=[group]),
                      kv_cache_manager=NS(get_block_ids=lambda rid: ([0, 4, 5, 6],) if rid == "a" else ([],),
                                          block_pool=NS(null_block=NS(block_id=0))))
    assert adapter.blocks_of(kv_scheduler, NS(request_id="a")) == [KVHeld("a", 9000, 3)]
    assert adapter.blocks_of(kv_scheduler, NS(request_id="b")) == []

    # -- the observer: what arrives on the channel joins the finished request in the trace --
    def observe(env, name):
        trace_dir = tmp / name
        obs = Observer(parse_settings({"SPARSEETY_TRACE_DIR": str(trace_dir), "SPARSEETY_KV_EVENTS": "off", **env}))
        obs.configure(model="smollm2-135m", block_size=None, kv_endpoint=None, config={},
                      tokenizer=model_dir, model_path=model_dir)
        obs.requests.on_drafts(step2 + step5)
        obs.requests.on_kv_blocks([KVHeld("a", 4500, 2), KVHeld("a", 9000, 3)])  # preempted with 2, finished with 3
        obs.requests.on_chunks([Chunk("a", 0, 10)])
        obs._enqueue(FinishedRequest("cmpl-a", "a", prompt, output, 0, [], [3, 2], [2, 0], 5, 2, text="x",
                                     finish_reason="length"))
        obs.close()
        return trace_dir, obs

    trace_dir, obs = observe({}, "plain")
    con = connect(trace_dir)
    rows = con.sql("SELECT event, step, position, token_id FROM token_events WHERE request_id = 'cmpl-a' "
                   "AND event LIKE 'draft%' ORDER BY seq").fetchall()
    assert rows == [("draft_accepted", 2, 12, 9), ("draft_accepted", 2, 13, 10), ("draft_rejected", 2, 14, 55),
                    ("draft_rejected", 5, 15, 1), ("draft_rejected", 5, 16, 2)], rows
    sequence = prompt + output
    assert all(sequence[p] == t for e, _, p, t in rows if e == "draft_accepted")
    trace = load_trace(trace_dir, "cmpl-a")
    doc = trace.document
    assert doc["model"] == "smollm2-135m" and doc["provenance"]["model_path"] == model_dir
    assert doc["sparsity"]["kv_cache_bytes_peak"] == 9000 and doc["sparsity"]["skipped_events"] is None
    assert doc["sparsity"]["draft_tokens"] == 5 and doc["sparsity"]["draft_rejected"] == 3
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert doc["token_texts"] == tok.batch_decode([[t] for t in sequence]), doc["token_texts"]
    extra = con.sql("SELECT extra_json FROM requests WHERE request_id = 'cmpl-a'").fetchall()[0][0]
    assert '"kv_blocks_held": 3' in extra and '"draft_ids_recorded": true' in extra

    # without the drafts hook (no identities arrived) the counts still add up, with -1 ids and positions
    obs2 = Observer(parse_settings({"SPARSEETY_TRACE_DIR": str(tmp / "counts"), "SPARSEETY_KV_EVENTS": "off"}))
    obs2.configure(model="m", block_size=None, kv_endpoint=None, config={})
    obs2._enqueue(FinishedRequest("cmpl-b", "b", prompt, output, 0, [], [3, 2], [2, 0], 5, 2, finish_reason="length"))
    obs2.close()
    doc2 = load_trace(tmp / "counts", "cmpl-b").document
    assert doc2["sparsity"]["kv_cache_bytes_peak"] is None and doc2["token_texts"] in (None, [])
    rows = connect(tmp / "counts").sql("SELECT event, position, token_id FROM token_events "
                                       "WHERE request_id = 'cmpl-b' ORDER BY seq").fetchall()
    assert [e for e, _, _ in rows] == ["draft_accepted"] * 2 + ["draft_rejected"] * 3
    assert {(p, t) for _, p, t in rows} == {(-1, -1)}

    # ids-only: no texts and the tokenizer is never loaded; redact: a secret in a token's text is masked
    trace_dir, obs = observe({"SPARSEETY_IDS_ONLY": "1"}, "ids-only")
    doc = load_trace(trace_dir, "cmpl-a").document
    assert obs.finisher._tokenizer is None and not doc.get("token_texts") and doc["ids_only"] is True
    trace_dir, obs = observe({"SPARSEETY_SAMPLE_RATE": "0"}, "unsampled")  # kept at tier 1: nothing decoded
    assert obs.finisher._tokenizer is None and load_trace(trace_dir, "cmpl-a").tier == 1
    secret = tok("my key is sk-abcdefghijklmnopqrstuvwx1234 ok")["input_ids"]
    prompt[:] = secret
    trace_dir, obs = observe({"SPARSEETY_REDACT": "yes"}, "redact")
    doc = load_trace(trace_dir, "cmpl-a").document
    assert doc["redacted"] is True and doc["token_texts"]
    assert "abcdefghijklmnop" not in "".join(doc["token_texts"]), doc["token_texts"]

    # a bad flag: one line, tracing off, like every other SPARSEETY_* setting
    assert parse_settings({"SPARSEETY_IDS_ONLY": "maybe"}).message == (
        "sparseety: SPARSEETY_IDS_ONLY='maybe' is not one of 1, true, yes, on, 0, false, no, off; tracing is off")
    assert parse_settings({"SPARSEETY_REDACT": "0", "SPARSEETY_IDS_ONLY": "true"}).ids_only is True

    # the model's name: --served-model-name, else the model directory's name (a hub snapshot: its repo id)
    from sparseety.integrations.vllm.vllm_api.adapter import served_name
    hub = tmp / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    assert served_name(NS(served_model_name="chat", model=model_dir)) == "chat"
    assert served_name(NS(served_model_name=model_dir, model=model_dir)) == Path(model_dir).name
    assert served_name(NS(served_model_name=str(hub), model=str(hub))) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_name(NS(served_model_name="org/model", model="org/model")) == "org/model"
    print("ok")
''')


def test_draft_identities_kv_bytes_and_texts_reach_the_trace(tmp_path):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    out = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, str(tmp_path), resolve_model_dir("smollm2-135m")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-4000:] + out.stderr[-4000:]
