"""Parts of the server on their own: the request sink, extraction health, config, request ids."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sparseety.engine.result import RunResult
from sparseety.errors import ConfigError
from sparseety.serve import ServeConfig
from sparseety.serve.errors import APIError
from sparseety.serve.health import extraction_health
from sparseety.serve.planning import check_request_id
from sparseety.serve.engine_loop import RequestSink


def _result(prompt_ids, output_ids, importance=None) -> RunResult:
    arrays = {} if importance is None else {"importance": np.asarray(importance, dtype=np.float16)}
    return RunResult(
        request_id="r", model="m", text="", prompt_ids=list(prompt_ids), output_ids=list(output_ids),
        policy="dense", params={}, budget=None, tier=2, evicted_positions=0, eviction_events=0,
        skipped_events=0, kept_positions_final=None, kv_cache_bytes_peak=1, kv_cache_bytes_dense=1,
        draft_tokens=0, draft_rejected=0, prefill_s=0.0, decode_s=0.0, arrays=arrays,
    )


def test_sink_pieces_join_to_the_decoded_text_and_never_split_a_character(smollm):
    _, tokenizer = smollm
    ids = tokenizer("Grüße aus Köln 世界 🙂 done", add_special_tokens=False)["input_ids"]

    async def scenario() -> tuple[list[str], tuple]:
        sink = RequestSink(tokenizer, asyncio.get_running_loop(), stream=True)

        def feed() -> None:  # the engine loop's thread: one token per step
            for step, token in enumerate(ids):
                sink.token(token, float(step))
            sink.finish(_result([5, 6], ids), "length")

        await asyncio.to_thread(feed)
        pieces = []
        while (piece := await sink.pieces.get()) is not None:
            pieces.append(piece)
        assert sink.times.stamps == [float(i) for i in range(len(ids))]
        assert sink.times.gaps() == [1.0] * (len(ids) - 1)
        result, reason = await sink.done
        return pieces, (result.output_ids, reason)

    pieces, (output, reason) = asyncio.run(scenario())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    assert output == ids and reason == "length"


def test_a_failed_sink_ends_its_stream_and_raises():
    async def scenario() -> None:
        sink = RequestSink(None, asyncio.get_running_loop(), stream=True)
        await asyncio.to_thread(sink.fail, ValueError("bad step"))
        assert await sink.pieces.get() is None
        with pytest.raises(ValueError, match="bad step"):
            await sink.done

    asyncio.run(scenario())


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
    ({"kv_memory_limit": "lots"}, "kv_memory_limit must be a size such as 512MiB"),
    ({"kv_memory_limit": "0MiB"}, "kv_memory_limit must be between 1 byte and 1 PiB"),
    ({"kv_memory_limit": "9" * 30}, "kv_memory_limit must be between 1 byte and 1 PiB"),
    ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"api_key": "  "}, "api_key is empty"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_serve_config_rejects(settings, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**settings)


def test_queue_capacity_defaults_to_four_per_worker():
    assert ServeConfig(max_concurrency=3).queue_capacity == 12
    assert ServeConfig(max_concurrency=3, max_queue=0).queue_capacity == 0


@pytest.mark.parametrize(("given", "expected"), [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5 GB", 1_500_000_000),
                                                 ("4096", 4096), (4096, 4096)])
def test_kv_memory_limit_takes_sizes_as_people_write_them(given, expected):
    assert ServeConfig(kv_memory_limit=given).kv_memory_limit == expected
