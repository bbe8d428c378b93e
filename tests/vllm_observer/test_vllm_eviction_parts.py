"""The parts of eviction inside vLLM that need no vLLM: settings, the engine core's ledger, the in-place
compaction (on a cache written column-major for keys and row-major for values, as vLLM's CPU kernel does)."""

from __future__ import annotations

import pytest
import torch

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.eviction_ledger import EvictionLedger
from sparseety.integrations.vllm.eviction_settings import parse_eviction
from sparseety.integrations.vllm.kv_compaction import compact, fill_holes, kept_positions, probe_layout, split


def test_unset_or_dense_is_no_eviction():
    assert parse_eviction({}) is None
    assert parse_eviction({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_BUDGET": "x"}) is None


@pytest.mark.parametrize("env, message", [
    ({"SPARSEETY_KV_POLICY": "snapkv", "SPARSEETY_KV_BUDGET": "64"}, "SPARSEETY_KV_POLICY='snapkv' cannot run"),
    ({"SPARSEETY_KV_POLICY": "nope", "SPARSEETY_KV_BUDGET": "64"}, "allowed: dense, streaming"),
    ({"SPARSEETY_KV_POLICY": "streaming"}, "needs exactly one of SPARSEETY_KV_BUDGET"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "8", "SPARSEETY_KV_RATIO": "0.5"}, "exactly one"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "0"}, "SPARSEETY_KV_BUDGET='0' is not an integer"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "64", "SPARSEETY_KV_INTERVAL": "-1"},
     "SPARSEETY_KV_INTERVAL='-1'"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_RATIO": "1.5"}, "ratio"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "2"}, "budget (2) must be >= sinks (4)"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "64", "SPARSEETY_KV_POLICY_OPTS": "window=3"},
     "unknown option 'window'"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=None) as info:
        parse_eviction(env)
    assert message in str(info.value)


def test_settings_resolve_budget_ratio_and_options():
    s = parse_eviction({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_RATIO": "0.75",
                        "SPARSEETY_KV_POLICY_OPTS": "sinks=8"})
    assert s is not None and s.budget_for(400) == 100 and s.sinks == 8 and s.interval is None
    s = parse_eviction({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "64",
                        "SPARSEETY_KV_INTERVAL": "1"})
    assert s is not None and s.budget_for(400) == 64 and s.sinks == 4 and s.interval == 1


def test_ledger_compacts_after_the_prompt_then_every_interval():
    ledger = EvictionLedger(interval=32)
    ledger.track("a", 64)
    assert ledger.plan("a", 100, 300) is None  # chunked prefill: the prompt is not complete
    order = ledger.plan("a", 300, 300)
    assert order is not None and (order.physical, order.kept, order.evicted) == (300, 64, 236)
    ledger.apply(order, freed_blocks=7)
    assert ledger.offset("a") == 236
    assert ledger.plan("a", 300 + 31, 300) is None  # 95 held: under budget + interval
    order = ledger.plan("a", 300 + 32, 300)
    assert order is not None and (order.logical, order.physical, order.kept) == (332, 96, 64)
    ledger.apply(order, 1)
    assert ledger.offset("a") == 268 and ledger.totals == {"evicted_tokens": 268, "freed_blocks": 8, "compactions": 2}
    ledger.reset("a")  # preempted: recomputed from the prompt
    assert ledger.offset("a") == 0 and ledger.plan("a", 300, 300).physical == 300
    assert ledger.forget("a") is not None and ledger.plan("a", 300, 300) is None and ledger.offset("a") == 0


def test_ledger_short_prompt_waits_for_the_budget():
    ledger = EvictionLedger(interval=1)
    ledger.track("b", 64)
    assert ledger.plan("b", 40, 40) is None and ledger.plan("b", 64, 40) is None
    assert ledger.plan("b", 65, 40).evicted == 1


BS, H, D = 8, 2, 4


def kernel_write(key, value, key_cache, value_cache, slots):
    """Keys column-major ``[D, block_size]`` and values row-major per block and head (vLLM's CPU ``vec``)."""
    kc = key_cache.reshape(key_cache.shape[0], key_cache.shape[1], -1)
    vc = value_cache.reshape(value_cache.shape[0], value_cache.shape[1], -1)
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, BS)
        for d in range(D):
            kc[block, :, d * BS + t] = key[i, :, d]
            vc[block, :, t * D + d] = value[i, :, d]


def test_probe_finds_the_kernels_layout():
    layout = probe_layout(kernel_write, H, BS, D, torch.float32)
    assert layout is not None
    assert layout.index[3, 1].item() == 1 * BS + 3  # key of slot 3, channel 1: column-major
    assert layout.index[3, D + 1].item() == BS * D + 3 * D + 1  # value: row-major after the keys
    assert probe_layout(lambda *a: None, H, BS, D, torch.float32) is None  # a writer that writes nothing


def test_fill_holes_moves_only_the_tail():
    src, dst = fill_holes(torch.tensor([0, 1, 5, 6, 7, 9]), 6)
    assert src.tolist() == [6, 7, 9] and dst.tolist() == [2, 3, 4]


def test_compaction_keeps_exactly_the_kept_tokens_in_place():
    torch.manual_seed(0)
    layout = probe_layout(kernel_write, H, BS, D, torch.float32)
    blocks = torch.tensor([3, 0, 5])
    n = 20
    keys, values = torch.randn(n, H, D), torch.randn(n, H, D)
    slots = blocks[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    kvs = [torch.zeros(6, H, BS, 2 * D) for _ in range(2)]
    for kv in kvs:
        kernel_write(keys, values, *split(kv), slots)
    keep = torch.tensor([0, 1, 12, 13, 14, 15, 16, 17, 18, 19])
    moves = fill_holes(keep, keep.numel())
    positions = kept_positions(torch.arange(n), moves, keep.numel())
    assert sorted(positions.tolist()) == keep.tolist()
    compact(kvs, blocks, moves, layout)
    expected = torch.zeros(6, H, BS, 2 * D)
    kernel_write(keys[positions], values[positions], *split(expected), slots[: keep.numel()])
    for kv in kvs:  # the first 10 slots: block 3 whole, block 0's first two
        assert torch.equal(kv[3], expected[3])
        flat, want = kv[0].reshape(H, -1), expected[0].reshape(H, -1)
        cols = layout.index[:2].reshape(-1)
        assert torch.equal(flat[:, cols], want[:, cols])
