"""The window-free bookkeeping of :mod:`sparseety.integrations.vllm.observe.window_frees` and the rows of
:mod:`sparseety.integrations.vllm.observe.window_rows`, on small stand-ins with the attribute names vLLM's
coordinator and managers have (no vLLM needed; ``test_vllm_windows.py`` runs the real ones)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from sparseety.engine.window import window_edge
from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.vllm_api.wire_messages import Groups, KVHeld, WindowFree, WindowPeak
from sparseety.integrations.vllm.observe.scheduler_consumer import RequestTable
from sparseety.integrations.vllm.observe.window_frees import WindowFrees
from sparseety.integrations.vllm.observe.window_rows import freed, window_events

NULL = object()
BLOCK = 4


def _coordinator(windows: list[int | None], page: int = 10, layers: int = 2):
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(sliding_window=w, page_size_bytes=page, num_kv_heads=1),
                              layer_names=[f"model.layers.{2 * g + i}.self_attn.attn" for i in range(layers)])
              for g, w in enumerate(windows)]
    managers = tuple(SimpleNamespace(req_to_blocks={}, _null_block=NULL) for _ in windows)
    return SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups), single_type_managers=managers)


def _step(frees: WindowFrees, coordinator, req: str, computed: int, windows: list[int | None]) -> None:
    """What vLLM's allocate_slots does for a step of one token: free below each window, then allocate."""
    nulls = frees.before(coordinator, req)
    for manager, window in zip(coordinator.single_type_managers, windows, strict=True):
        table = manager.req_to_blocks.get(req)
        if table is not None and window is not None:  # SlidingWindowManager.remove_skipped_blocks
            skipped = max(0, computed - window + 1) // BLOCK
            for i in range(min(skipped, len(table)) - 1, -1, -1):
                if table[i] is NULL:
                    break
                table[i] = NULL
    if nulls is not None:
        frees.after(coordinator, req, computed, nulls)
    for manager in coordinator.single_type_managers:
        table = manager.req_to_blocks.setdefault(req, [])
        while len(table) < math.ceil((computed + 1) / BLOCK):
            table.append(object())


def test_frees_and_peak_follow_the_block_tables():
    windows = [None, 8]
    coordinator, frees = _coordinator(windows), WindowFrees()
    for computed in range(20):
        _step(frees, coordinator, "r", computed, windows)
    record = frees.finish(coordinator, "r")
    assert record is not None and "r" not in frees.requests
    peak_bytes, peak_blocks = record.peak_bytes, record.peak_blocks
    # the windowed group freed block i once computed - 8 + 1 >= 4 (i + 1): at computed 11, 15 and 19
    assert record.req_id == "r" and record.frees == (WindowFree(11, 1, 1), WindowFree(15, 1, 1), WindowFree(19, 1, 1))
    held = [b for m in coordinator.single_type_managers for b in m.req_to_blocks["r"] if b is not NULL]
    assert peak_blocks == 5 + 3 and len(held) == 5 + 2  # before the last free: 5 + 3; now 5 + 2
    assert peak_bytes == peak_blocks * 20
    assert frees.groups_message() == Groups((KVGroup(0, None, 20, 1, (0, 1)), KVGroup(1, 8, 20, 1, (2, 3))))


def test_a_request_unknown_to_every_group_is_not_tracked():
    coordinator, frees = _coordinator([8]), WindowFrees()
    assert frees.before(coordinator, "nobody") is None and frees.finish(coordinator, "nobody") is None


def test_nulls_a_prefix_cache_hit_put_in_place_are_not_counted_as_frees():
    coordinator, frees = _coordinator([8]), WindowFrees()
    coordinator.single_type_managers[0].req_to_blocks["r"] = [NULL, NULL, object(), object()]
    nulls = frees.before(coordinator, "r")
    frees.after(coordinator, "r", 14, nulls)
    assert frees.finish(coordinator, "r") == WindowPeak("r", 20 * 2, 2, ())


def test_window_rows_are_the_own_engines_rule():
    groups = [KVGroup(0, None, 100, 2, (2,)), KVGroup(1, 4, 100, 2, (0, 1))]
    sequence = list(range(100, 110))
    arrays, skipped = window_events(groups, sequence, prompt_len=6, outputs=4)
    want = [(s, layer, window_edge(6 + s - 1, 4)) for s in range(4) for layer in (0, 1) if window_edge(6 + s - 1, 4)]
    got = list(zip(arrays["window.step"].tolist(), arrays["window.layer"].tolist(), arrays["window.position"].tolist()))
    assert got == want
    assert arrays["window.token_id"].tolist() == [sequence[p] for _, _, p in want]
    assert (arrays["window.kv_head"] == -1).all() and np.isnan(arrays["window.score"]).all()
    assert skipped == sum(2 * p for _, _, p in want)
    assert window_events([KVGroup(0, None, 100, 2, (0,))], sequence, 6, 4) == ({}, 0)


def test_freed_names_steps_and_bytes():
    groups = [KVGroup(0, None, 100, 2, (2,)), KVGroup(1, 4, 30, 2, (0, 1))]
    info = freed(groups, [[3, 1, 1], [6, 1, 2]], prompt_len=6)
    assert info == {"layers": {"0": 4, "1": 4}, "freed_blocks": 3, "freed_bytes": 90,
                    "frees": [[0, 1, 1, 30], [1, 1, 2, 60]]}


def test_the_table_keeps_the_peak_and_the_dense_bytes_of_the_last_life():
    table = RequestTable(8)
    table.on_groups([Groups((KVGroup(0, None, 100, 2, (2,)), KVGroup(1, 4, 30, 2, (0, 1))))])
    table.on_kv_blocks([KVHeld("r", 500, 5)])  # held when vLLM freed the request's blocks
    table.on_window([WindowPeak("r", 800, 8, (WindowFree(3, 1, 2),))])  # its peak and what the window freed
    chunks, drafts, held, frees = table.take("r")
    assert held == [800, 8, 560] and frees == [[3, 1, 2]]

