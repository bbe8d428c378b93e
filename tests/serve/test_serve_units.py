"""Parts of the server on their own: admission, the token streamer, extraction health, config, request ids."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from sparseety.engine.result import RunResult
from sparseety.errors import ConfigError
from sparseety.serve import ServeConfig
from sparseety.serve.errors import APIError
from sparseety.serve.execution import finish_reason
from sparseety.serve.health import extraction_health
from sparseety.serve.planning import check_request_id
from sparseety.serve.scheduler import QueueFull, Scheduler
from sparseety.serve.streaming import TokenStreamer


def _result(prompt_ids, output_ids, importance=None) -> RunResult:
    arrays = {} if importance is None else {"importance": np.asarray(importance, dtype=np.float16)}
    return RunResult(
        request_id="r", model="m", text="", prompt_ids=list(prompt_ids), output_ids=list(output_ids),
        policy="dense", params={}, budget=None, tier=2, evicted_positions=0, eviction_events=0,
        skipped_events=0, kept_positions_final=None, kv_cache_bytes_peak=1, kv_cache_bytes_dense=1,
        draft_tokens=0, draft_rejected=0, prefill_s=0.0, decode_s=0.0, arrays=arrays,
    )


def test_scheduler_admits_up_to_workers_plus_queue_then_refuses():
    scheduler = Scheduler(max_concurrency=1, max_queue=1)
    gate, started = threading.Event(), threading.Event()

    def blocked() -> str:
        started.set()
        gate.wait(10)
        return "done"

    async def scenario() -> list[object]:
        scheduler.admit()
        first = asyncio.ensure_future(scheduler.run(blocked))
        await asyncio.to_thread(started.wait, 10)
        scheduler.admit()
        second = asyncio.ensure_future(scheduler.run(lambda: "second"))
        await asyncio.sleep(0)
        seen = [scheduler.running, scheduler.waiting]
        with pytest.raises(QueueFull):
            scheduler.admit()
        gate.set()
        seen += [await first, await second, scheduler.running, scheduler.waiting]
        scheduler.admit()  # room again
        scheduler.release()
        return seen

    assert asyncio.run(scenario()) == [1, 1, "done", "second", 0, 0]
    scheduler.shutdown()


def test_scheduler_gives_back_the_place_of_a_job_cancelled_before_it_started():
    scheduler = Scheduler(max_concurrency=1, max_queue=1)
    gate, started = threading.Event(), threading.Event()

    async def scenario() -> int:
        scheduler.admit()
        first = asyncio.ensure_future(scheduler.run(lambda: (started.set(), gate.wait(10))))
        await asyncio.to_thread(started.wait, 10)
        scheduler.admit()
        queued = asyncio.ensure_future(scheduler.run(lambda: "never"))
        await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        waiting = scheduler.waiting
        gate.set()
        await first
        return waiting

    assert asyncio.run(scenario()) == 0
    scheduler.shutdown()


def test_streamer_pieces_join_to_the_decoded_text_and_never_split_a_character(smollm):
    _, tokenizer = smollm
    ids = tokenizer("Grüße aus Köln 世界 🙂 done", add_special_tokens=False)["input_ids"]

    async def scenario() -> list[str | None]:
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        streamer = TokenStreamer(tokenizer, asyncio.get_running_loop(), queue)

        def feed() -> None:
            streamer.put(torch.tensor([[5, 6, 7]]))  # the prompt: skipped
            for token in ids:
                streamer.put(torch.tensor([token]))
            streamer.end()

        await asyncio.to_thread(feed)
        pieces = []
        while (piece := await queue.get()) is not None:
            pieces.append(piece)
        assert len(streamer.times.stamps) == len(ids)
        assert len(streamer.times.gaps()) == len(ids) - 1
        return pieces

    pieces = asyncio.run(scenario())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_streamer_spreads_a_multi_token_step_over_its_tokens():
    streamer = TokenStreamer(tokenizer=None)
    streamer.times.stamps.extend([(1.0, 1), (1.6, 3), (2.0, 1)])
    assert streamer.times.gaps() == pytest.approx([0.2, 0.2, 0.2, 0.4])


def test_extraction_health_against_a_hand_computed_example():
    # Position 0 is a special token (an attention sink) and is left out of rankings and ratios.
    importance = [[9, 0.1, 0.5, 0.02, 0.3],   # top-2 {2, 4}
                  [9, 0.2, 0.6, 0.01, 0.1],   # top-2 {2, 1}
                  [9, 0.1, 0.2, 0.7, 0.0]]    # top-2 {3, 2}; summed over layers position 2 leads
    health = extraction_health(_result([1, 10, 11], [12, 13], importance), special_ids=(1,), top_k=2)
    assert health.top1_hit_rate == pytest.approx(2 / 3)
    assert health.adjacent_overlap == {0: 0.5, 1: 0.5}
    assert health.filtered_ratio == pytest.approx(3 / 12)  # 0.02/0.5, 0.01/0.6 and 0/0.7 are below 0.05
    assert health.extraction_s >= 0


def test_extraction_health_needs_importance():
    assert extraction_health(_result([1, 2], [3]), special_ids=(), top_k=4) is None


@pytest.mark.parametrize(("output", "max_tokens", "expected"), [
    ([5, 6, 2], 8, "stop"), ([5, 6, 7], 3, "length"), ([5, 2], 2, "stop"), ([5], 4, "stop")])
def test_finish_reason(output, max_tokens, expected):
    assert finish_reason(_result([1], output), max_tokens, frozenset({2})) == expected


@pytest.mark.parametrize("bad", ["", "../etc", ".hidden", "a b", "x" * 129, "é"])
def test_request_ids_that_could_not_name_a_trace_are_refused(bad):
    with pytest.raises(APIError) as info:
        check_request_id(bad)
    assert info.value.status == 400 and info.value.param == "X-Request-Id"


def test_request_id_accepted():
    assert check_request_id("req-1.a:b_C") == "req-1.a:b_C"


@pytest.mark.parametrize(("settings", "message"), [
    ({"budget": 8, "ratio": 0.5}, "either budget or ratio"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"tier": 0}, "tier"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"api_key": "  "}, "api_key is empty"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_serve_config_rejects(settings, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**settings)


def test_queue_capacity_defaults_to_four_per_worker():
    assert ServeConfig(max_concurrency=3).queue_capacity == 12
    assert ServeConfig(max_concurrency=3, max_queue=0).queue_capacity == 0
