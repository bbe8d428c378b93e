"""The observer's join of the frontend's requests with vLLM's ``FinishedRequestStats``, without a server and without
vLLM: recorded messages (what the hooks and the stat logger hand over) fed to a real :class:`Observer` in one
subprocess of the side venv (the observer's own dependencies; vLLM is not imported, no model loaded), then the rows
it stored read back. The live counterpart (a real ``vllm serve``) is ``test_vllm_choices_and_aborts.py``.

- the ``n`` choices of one completion share the id their stats carry: each row is joined to its own stats, in the
  order vLLM finished them, whatever the choices' order;
- a request whose stats never come is written after a bounded wait, and its late stats are skipped, never joined to
  a sibling still waiting; a full map writes its oldest request at once: no row lost;
- an aborted request (no stats) is written at once with what it produced, ``finish_reason`` ``abort`` and vLLM's own
  times from its state;
- a record that cannot be read or built, or that the trace writer fails to write, is counted as dropped, and the
  requests behind it are stored.
"""

from __future__ import annotations

import subprocess
import textwrap

from vllm_server import ROOT, VENV, require_vllm

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from types import SimpleNamespace as NS
    for var in [v for v in os.environ if v.startswith("SPARSEETY_")]:
        del os.environ[var]
    trace_dir = sys.argv[1]
    from sparseety.integrations.vllm.observe import observer as observer_module
    from sparseety.integrations.vllm.observe.observer import Observer
    from sparseety.integrations.vllm.transport.metrics import metrics
    from sparseety.integrations.vllm.transport.settings import parse_settings
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest, FinishedStats
    from sparseety.store import connect
    assert "vllm" not in sys.modules

    def dropped():
        return metrics().trace_dropped._value.get()

    def new_observer(name, **env):
        obs = Observer(parse_settings({"SPARSEETY_TRACE_DIR": f"{trace_dir}/{name}", "SPARSEETY_KV_EVENTS": "off",
                                       **env}))
        obs.has_stat_logger = True  # as SparseetyStatLogger sets it once configured
        return obs

    def rows(obs):
        obs.flush()
        return stored(obs)

    def stored(obs):
        got = connect(obs.settings.trace_dir).sql(
            "SELECT request_id, output_token_ids, extra_json FROM requests").fetchall()
        return {r[0]: (list(r[1]), json.loads(r[2])["vllm"]) for r in got}

    def choice(index, completion="cmpl-x-0", output=None):
        """One choice of an n > 1 completion as the finished hook captures it (vLLM's child id and its row id)."""
        return FinishedRequest(request_id=f"{index}_{completion}", internal_id=f"{index}_{completion}-abcd1234",
                               prompt_ids=[1, 2, 3], output_ids=output or [10 * index + 1, 10 * index + 2],
                               num_cached_tokens=0, preempted_at=[], per_step_drafted=None, per_step_accepted=None,
                               num_draft_tokens=0, num_accepted_tokens=0, finish_reason="length",
                               join_id=completion, choice=index)

    def stats(completion, e2e, reason="length", cached=0):
        return FinishedStats(request_id=completion, finish_reason=reason, num_cached_tokens=cached, num_preemptions=0,
                             timings={"e2e_s": e2e, "queued_s": 0.0, "prefill_s": e2e / 2, "decode_s": e2e / 4,
                                      "inference_s": e2e})

    def capture(obs, request):
        """What on_finished does after reading the request (adapter.finished_request needs vLLM's RequestState)."""
        original = adapter.finished_request
        adapter.finished_request = lambda req_state, finish_reason: request
        try:
            obs.on_finished(None, None)
        finally:
            adapter.finished_request = original

    # 1) n = 4, the choices finishing in the order 2, 0, 3, 1, each followed by its stats as vLLM reports them
    obs = new_observer("choices")
    for i in (2, 0, 3, 1):
        capture(obs, choice(i))
    assert obs._waiting == 4 and list(obs._captures) == ["cmpl-x-0"]
    for i in (2, 0, 3, 1):
        obs.on_finished_stats(stats("cmpl-x-0", 10.0 + i, reason="stop" if i == 3 else "length"), 0)
    got = rows(obs)
    assert sorted(got) == [f"{i}_cmpl-x-0" for i in range(4)], sorted(got)
    for i in range(4):
        ids, extra = got[f"{i}_cmpl-x-0"]
        assert ids == [10 * i + 1, 10 * i + 2], (i, ids)
        assert extra["choice"] == i and extra["completion_id"] == "cmpl-x-0"
        assert extra["timings"]["e2e_s"] == 10.0 + i, (i, extra["timings"])  # its own stats, not a sibling's
        assert extra["finish_reason"] == ("stop" if i == 3 else "length")
        assert extra["data_parallel_rank"] == 0
    assert obs.unjoined == 0 and obs.dropped_records == 0
    obs.close()

    # 2) stats that never come: written after the bounded wait; their late stats are skipped, not given to a sibling
    obs = new_observer("late")
    old, young = choice(0, "cmpl-y-0"), choice(1, "cmpl-y-0")
    old.finished_at -= observer_module.STATS_WAIT_S + 1
    capture(obs, old)
    capture(obs, young)
    obs._give_up_on_stats(time.monotonic() - observer_module.STATS_WAIT_S)
    assert obs._waiting == 1 and obs.unjoined == 1
    obs.on_finished_stats(stats("cmpl-y-0", 1.0), 0)  # choice 0's, late: skipped
    assert obs._waiting == 1
    obs.on_finished_stats(stats("cmpl-y-0", 2.0, cached=3), 0)  # choice 1's
    assert obs._waiting == 0
    obs.on_finished_stats(stats("cmpl-nobody", 1.0), 0)  # stats of no request: counted
    got = rows(obs)
    assert got["0_cmpl-y-0"][1]["timings"] == {} and got["0_cmpl-y-0"][1]["data_parallel_rank"] is None
    assert got["1_cmpl-y-0"][1]["timings"]["e2e_s"] == 2.0 and got["1_cmpl-y-0"][1]["num_cached_tokens"] == 3
    assert obs.unjoined == 2 and obs.dropped_records == 0
    # a request still waiting when the observer closes is written, without stats
    capture(obs, choice(0, "cmpl-z-0"))
    obs.close()
    assert "0_cmpl-z-0" in stored(obs) and obs.unjoined == 3

    # 3) a full map (SPARSEETY_QUEUE_SIZE=2) writes its oldest request without stats at once: none is lost
    before = dropped()
    obs = new_observer("full", SPARSEETY_QUEUE_SIZE="2")
    obs._stop.set()  # no worker thread: the queues fill as they would under load
    for completion in ("cmpl-a-0", "cmpl-b-0", "cmpl-c-0"):
        capture(obs, choice(0, completion))
    assert obs._waiting == 2 and list(obs._captures) == ["cmpl-b-0", "cmpl-c-0"] and len(obs._ready) == 1
    obs.on_finished_stats(stats("cmpl-a-0", 5.0), 0)  # a's late stats: skipped
    obs.on_finished_stats(stats("cmpl-b-0", 6.0), 0)
    obs._stop.clear()
    got = rows(obs)
    assert sorted(got) == ["0_cmpl-a-0", "0_cmpl-b-0"], sorted(got)  # c still waits for its stats
    assert got["0_cmpl-a-0"][1]["timings"] == {} and got["0_cmpl-b-0"][1]["timings"]["e2e_s"] == 6.0
    assert obs.dropped_records == 0 and dropped() == before and obs.unjoined == 1
    obs.close()

    # 4) aborted requests: no stats to wait for; what they produced, finish_reason abort, vLLM's own times
    obs = new_observer("aborted")
    now = time.monotonic()
    def state(request_id, external, output, parent=None, stamps=(now - 3, now - 2, now - 1.5, now - 0.5)):
        queued, scheduled, first, last = stamps
        return NS(request_id=request_id, external_req_id=external, parent_req=parent, prompt_token_ids=[4, 5, 6],
                  num_cached_tokens=0, spec_decode_metrics=None,
                  detokenizer=NS(output_token_ids=output, output_text="", num_output_tokens=lambda: len(output)),
                  stats=NS(num_preemptions=1, arrival_time=time.time() - 4, queued_ts=queued, scheduled_ts=scheduled,
                           first_token_ts=first, last_token_ts=last))
    obs.on_aborted(state("q-abcd1234", "q", [7, 8, 9]))
    obs.on_aborted(state("1_cmpl-w-0-abcd1234", "cmpl-w-0", [3], parent=object()))  # one choice of n > 1
    obs.on_aborted(state("w-abcd1234", "w", [], stamps=(now - 1, 0.0, 0.0, 0.0)))  # aborted while queued
    assert obs._waiting == 0 and not obs._captures  # queued at once, never held for stats
    got = rows(obs)
    ids, extra = got["q"]
    assert ids == [7, 8, 9] and extra["finish_reason"] == "abort" and extra["num_preemptions"] == 1
    timings = extra["timings"]
    assert abs(timings["queued_s"] - 1.0) < 1e-6 and abs(timings["prefill_s"] - 0.5) < 1e-6, timings
    assert abs(timings["decode_s"] - 1.0) < 1e-6 and abs(timings["inference_s"] - 1.5) < 1e-6, timings
    assert 3.9 < timings["e2e_s"] < 60, timings
    assert got["1_cmpl-w-0"][0] == [3] and got["1_cmpl-w-0"][1]["choice"] == 1
    assert got["1_cmpl-w-0"][1]["finish_reason"] == "abort"
    assert got["w"][0] == [] and set(got["w"][1]["timings"]) == {"e2e_s"}  # never scheduled: no other interval
    assert obs.unjoined == 0 and obs.dropped_records == 0
    obs.close()

    # 5) a record that cannot be read or built is dropped and counted; the requests behind it are stored
    before = dropped()
    obs = new_observer("failing")
    try:
        obs.on_aborted(NS())  # a state without what the reader needs
    except AttributeError:
        pass
    else:
        raise AssertionError("a bad state must raise (the hook's guard logs it)")
    assert obs.failed_records == 1 and dropped() == before + 1
    finish = obs.finisher.finish
    def failing(c):
        if c.request_id == "0_cmpl-bad-0":
            raise ValueError("cannot build this record")
        finish(c)
    obs.finisher.finish = failing
    obs._stop.set()
    capture(obs, choice(0, "cmpl-bad-0"))
    capture(obs, choice(0, "cmpl-good-0"))
    obs.on_finished_stats(stats("cmpl-bad-0", 1.0), 0)
    obs.on_finished_stats(stats("cmpl-good-0", 1.0), 0)
    obs._stop.clear()
    got = rows(obs)
    assert sorted(got) == ["0_cmpl-good-0"], sorted(got)
    assert obs.failed_records == 2 and obs.dropped_records == 2 and dropped() == before + 2
    assert obs.stats()["failed_records"] == 2
    # the trace writer fails to write one (a conversion error in its thread): counted too, once
    obs.finisher.finish = finish
    real = obs.sink.writer.stats
    obs.sink.writer.stats = lambda: real().__class__(**{**real().__dict__, "failed_records": 1})
    obs.process(final=True)
    obs.process(final=True)
    assert obs.dropped_records == 3 and dropped() == before + 3
    obs.sink.writer.stats = real
    obs.close()
    print("ok")
''')


def test_choices_aborts_and_losses_join_and_count(tmp_path):
    require_vllm()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, str(tmp_path / "traces")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
