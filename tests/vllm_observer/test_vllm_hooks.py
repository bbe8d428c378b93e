"""The plugin's hooks on vLLM's real ``OutputProcessor`` (side venv, no model): preemptions, the
FinishedRequestStats join, bounded queues that drop and count, and the rows that reach the store; every choice of
an ``n > 1`` completion is its own row, and an aborted request is stored with what it produced.

vLLM's frontend is driven directly with the ``EngineCoreOutput`` messages its engine core would send,
so each case is exact and takes a second.
"""

from __future__ import annotations

import subprocess
import textwrap

from vllm_server import ROOT, VENV, require_vllm

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    trace_dir = sys.argv[1]
    os.environ.update(SPARSEETY_TRACE_DIR=trace_dir, SPARSEETY_QUEUE_SIZE="2", SPARSEETY_KV_EVENTS="off")
    from vllm import SamplingParams
    from vllm.v1.engine import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest,
                                FinishReason)
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    from sparseety.integrations.vllm import plugin
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.observe.observer import observer
    from sparseety.integrations.vllm.transport.metrics import metrics
    from sparseety.store import connect

    plugin.register()
    plugin.register()  # vLLM may load general plugins twice: patched once
    obs = observer()
    proc = OutputProcessor(None, log_stats=True)

    def add(rid, prompt):
        params = SamplingParams(max_tokens=8, detokenize=False)
        proc.add_request(EngineCoreRequest(rid, prompt, None, params, None, time.time(), None, None, None,
                                           external_req_id=rid), None)

    def step(outputs):
        stats = IterationStats()
        proc.process_outputs(outputs, time.monotonic(), stats)
        return stats

    # 1) stat-logger path: captures joined to vLLM's FinishedRequestStats
    obs.has_stat_logger = True
    add("a", list(range(10, 20)))
    step([EngineCoreOutput("a", [5])])
    step([EngineCoreOutput("a", [], events=[EngineCoreEvent(EngineCoreEventType.PREEMPTED, time.monotonic())])])
    step([EngineCoreOutput("a", [6, 7])])
    stats = step([EngineCoreOutput("a", [8], finish_reason=FinishReason.LENGTH)])
    assert [f.request_id for f in stats.finished_requests] == ["a"]
    assert stats.finished_requests[0].num_preemptions == 1  # vLLM's own count of the same event
    assert "a" in obs._captures
    for finished in adapter.finished_stats(stats):  # what SparseetyStatLogger.record does (engine 0's logger)
        obs.on_finished_stats(finished, 0)
    assert not obs._captures and len(obs._ready) == 1
    obs.flush()

    # 2) the ready queue holds SPARSEETY_QUEUE_SIZE records; the rest are dropped and counted
    obs.has_stat_logger = False
    obs._stop.set(); obs._thread.join()  # hold the worker so the queue fills
    for rid in "bcde":
        add(rid, [1, 2, 3])
    step([EngineCoreOutput(rid, [9], finish_reason=FinishReason.STOP) for rid in "bcde"])
    assert len(obs._ready) == 2 and obs.dropped_records == 2
    assert metrics().trace_dropped._value.get() == 2
    obs._stop.clear()
    obs.flush()

    con = connect(trace_dir)
    rows = {r[0]: r for r in con.sql("SELECT request_id, prompt_token_ids, output_token_ids, extra_json "
                                     "FROM requests").fetchall()}
    assert sorted(rows) == ["a", "b", "c"], sorted(rows)
    extra = json.loads(rows["a"][3])["vllm"]
    assert list(rows["a"][1]) == list(range(10, 20)) and list(rows["a"][2]) == [5, 6, 7, 8]
    assert extra["num_preemptions"] == 1 and extra["preempted_at_output_tokens"] == [1]
    assert extra["finish_reason"] == "length" and extra["timings"]["e2e_s"] > 0
    assert extra["data_parallel_rank"] == 0 and extra["api_server"] == 0
    assert json.loads(rows["b"][3])["vllm"]["data_parallel_rank"] is None  # no stat logger: engine unknown
    recomputed = con.sql("SELECT position, token_id FROM token_events WHERE request_id = 'a' AND "
                         "event = 'recomputed' ORDER BY position").fetchall()
    assert recomputed == [(p, t) for p, t in enumerate(list(range(10, 20)) + [5])]
    assert json.loads(rows["b"][3])["vllm"]["finish_reason"] == "stop"
    m = metrics()  # counted under the engine that served "a"; "b" and "c" under engine "unknown"
    assert m.preemptions.labels(engine="0")._value.get() == 1 and m.freed_tokens.labels(engine="0")._value.get() == 11
    assert m.prompt_tokens.labels(engine="0")._value.get() == 10
    assert m.prompt_tokens.labels(engine="unknown")._value.get() == 6
    print("ok")
''')


def test_hooks_on_vllms_output_processor(tmp_path):
    require_vllm()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, str(tmp_path / "traces")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


CHOICES = textwrap.dedent('''
    import json, os, sys, time
    from copy import copy
    trace_dir = sys.argv[1]
    os.environ.update(SPARSEETY_TRACE_DIR=trace_dir, SPARSEETY_KV_EVENTS="off")
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.metrics.stats import IterationStats

    from sparseety.integrations.vllm import plugin
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.observe.observer import observer
    from sparseety.store import connect

    plugin.register()
    obs = observer()
    obs.has_stat_logger = True
    proc = OutputProcessor(None, log_stats=True)

    def step(outputs):
        stats = IterationStats()
        proc.process_outputs(outputs, time.monotonic(), stats)
        for finished in adapter.finished_stats(stats):  # what SparseetyStatLogger.record does
            obs.on_finished_stats(finished, 0)

    # n = 3: three children of one parent, as AsyncLLM adds them (child ids "<index>_<parent id>")
    request = EngineCoreRequest("cmpl-x-0-abcd1234", [1, 2, 3], None, SamplingParams(n=3, max_tokens=4,
                                detokenize=False), None, time.time(), None, None, None, external_req_id="cmpl-x-0")
    parent = ParentRequest(request)
    for index in range(3):
        child_id, child_params = parent.get_child_info(index)
        child = copy(request)
        child.request_id, child.sampling_params = child_id, child_params
        proc.add_request(child, None, parent, index)
    step([EngineCoreOutput(f"{i}_cmpl-x-0-abcd1234", [10 * i + 1]) for i in range(3)])
    step([EngineCoreOutput(f"{i}_cmpl-x-0-abcd1234", [10 * i + 2], finish_reason=FinishReason.LENGTH)
          for i in (2, 0, 1)])  # the choices finish in any order

    # a request aborted by its client after one token (vLLM reports no stats for it)
    proc.add_request(EngineCoreRequest("q-abcd1234", [4, 5], None, SamplingParams(max_tokens=8, detokenize=False),
                                       None, time.time(), None, None, None, external_req_id="q"), None)
    step([EngineCoreOutput("q-abcd1234", [7])])
    proc.abort_requests(["q"], internal=False)
    obs.flush()

    rows = {r[0]: (list(r[1]), json.loads(r[2])["vllm"]) for r in connect(trace_dir).sql(
        "SELECT request_id, output_token_ids, extra_json FROM requests").fetchall()}
    assert sorted(rows) == ["0_cmpl-x-0", "1_cmpl-x-0", "2_cmpl-x-0", "q"], sorted(rows)
    for i in range(3):
        ids, extra = rows[f"{i}_cmpl-x-0"]
        assert ids == [10 * i + 1, 10 * i + 2] and extra["finish_reason"] == "length"
        assert extra["choice"] == i and extra["timings"]["e2e_s"] > 0  # each joined to its own stats
    assert rows["q"][0] == [7] and rows["q"][1]["finish_reason"] == "abort"
    assert obs.unjoined == 0
    print("ok")
''')


def test_every_choice_and_every_aborted_request_is_a_row(tmp_path):
    require_vllm()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", CHOICES, str(tmp_path / "traces")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
