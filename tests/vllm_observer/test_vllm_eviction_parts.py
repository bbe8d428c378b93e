"""The parts of eviction inside vLLM that need no vLLM: settings, the engine core's ledger, the in-place
compaction (on a cache written column-major for keys and row-major for values, as vLLM's CPU kernel does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.evict.ledger import EvictionLedger
from sparseety.integrations.vllm.evict.orders import StepReport
from sparseety.integrations.vllm.vllm_api.wire_messages import EvictedSlots, EvictionRecord
from sparseety.integrations.vllm.evict.settings import parse_eviction
from sparseety.integrations.vllm.transport.values import BadValue
from sparseety.integrations.vllm.evict.compaction import (
    compact,
    fill_holes,
    kept_positions,
    probe_layout,
    read_slots,
    split,
)


def test_unset_is_no_eviction_and_dense_evicts_only_what_a_request_asks():
    assert parse_eviction({}) is None
    s = parse_eviction({"SPARSEETY_KV_POLICY": "dense"})
    assert s is not None and s.for_request({}, 300) is None
    asked = s.for_request({"sparseety_policy": "tova", "sparseety_budget": 32}, 300)
    assert asked is not None and (asked.policy, asked.budget, asked.options) == ("tova", 32, {})
    asked = s.for_request({"sparseety_policy": "snapkv", "sparseety_ratio": "0.5",
                           "sparseety_policy_opts": {"window": 8}}, 300)
    assert asked is not None and (asked.policy, asked.budget, asked.options) == ("snapkv", 150, {"window": 8})


def test_a_request_can_ask_for_dense_or_another_policy_and_inherits_the_budget():
    s = parse_eviction({"SPARSEETY_KV_POLICY": "h2o", "SPARSEETY_KV_BUDGET": "64",
                        "SPARSEETY_KV_POLICY_OPTS": "recent_ratio=0.25"})
    assert s is not None and s.for_request({"sparseety_policy": "dense"}, 300) is None
    same = s.for_request({}, 300)
    assert same is not None and (same.policy, same.budget, same.options) == ("h2o", 64, {"recent_ratio": "0.25"})
    other = s.for_request({"sparseety_policy": "tova"}, 300)
    assert other is not None and (other.policy, other.budget, other.options) == ("tova", 64, {})


@pytest.mark.parametrize("extra, message", [
    ({"sparseety_policy": "tova", "sparseety_budget": -1}, "sparseety_budget=-1 is not an integer in [1, 1000000000]"),
    ({"sparseety_policy": "tova", "sparseety_ratio": 2}, "sparseety_ratio=2 is not a number in [0, 1)"),
    ({"sparseety_budget": 8}, "sparseety_budget=8 is not used without an evicting sparseety_policy (this server"),
    ({"sparseety_policy": "tova"}, "sparseety_policy=tova needs sparseety_budget or sparseety_ratio (this server"),
    ({"sparseety_policy": "tova", "sparseety_budget": 1e400}, "sparseety_budget=inf is not an integer in"),
    ({"sparseety_policy": "tova", "sparseety_budget": float("nan")}, "sparseety_budget=nan is not an integer in"),
    ({"sparseety_policy": "tova", "sparseety_budget": 1e300}, "sparseety_budget=1e+300 is not an integer in"),
    ({"sparseety_policy": "tova", "sparseety_budget": True}, "sparseety_budget=True is not an integer in"),
    ({"sparseety_policy": "tova", "sparseety_budget": "\u0666\u0664"}, "is not an integer in [1, 1000000000]"),
    ({"sparseety_policy": "tova", "sparseety_budget": "6_4"}, "sparseety_budget='6_4' is not an integer"),
    ({"sparseety_policy": "tova", "sparseety_budget": 16.5}, "sparseety_budget=16.5 is not an integer"),
    ({"sparseety_policy": "tova", "sparseety_ratio": 1.0}, "sparseety_ratio=1.0 is not a number in [0, 1)"),
    ({"sparseety_policy": "tova", "sparseety_ratio": True}, "sparseety_ratio=True is not a number in [0, 1)"),
    ({"sparseety_policy": "tova", "sparseety_ratio": 0.5, "sparseety_budget": 8},
     "sparseety_budget and sparseety_ratio were both given"),
    ({"sparseety_policy": "dense", "sparseety_budget": 8}, "not used without an evicting sparseety_policy (dense"),
    ({"sparseety_policy": "tovx", "sparseety_budget": 8}, "'tovx' is not a policy that runs inside vLLM (did you "
                                                           "mean tova?): one of dense, streaming"),
    ({"sparseety_policy": 7, "sparseety_budget": 8}, "sparseety_policy=7 is not a policy"),
    ({"sparseety_policy": "x" * 100_000, "sparseety_budget": 8}, "xxx... (100000 chars) is not a policy"),
    ({"sparseety_policy": "tova", "sparseety_budget": 8, "sparseety_policy_opts": 5},
     "sparseety_policy_opts=5 is not key=value pairs or a JSON object in a string"),
    ({"sparseety_policy": "tova", "sparseety_budget": 8, "sparseety_policy_opts": "{nope"},
     "sparseety_policy_opts='{nope' is not a JSON object"),
    ({"sparseety_policy": "kvzip", "sparseety_budget": 8}, "sparseety_policy='kvzip' cannot run inside vLLM"),
    ({"sparseety_policy": "tova", "sparseety_budget": 8, "sparseety_policy_opts": "heads=x"}, "heads must be one of"),
])
def test_bad_request_args_name_the_arg(extra, message):
    s = parse_eviction({"SPARSEETY_KV_POLICY": "dense"})
    with pytest.raises(BadValue) as info:
        s.for_request(extra, 300)
    assert message in str(info.value)
    assert len(str(info.value)) < 600  # a value from a request is never repeated whole
    assert info.value.name.startswith("sparseety_")


def test_a_dense_server_gives_its_budget_to_requests_that_name_a_policy():
    s = parse_eviction({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_BUDGET": "48"})
    assert s is not None and s.for_request({}, 300) is None and s.for_request({"sparseety_policy": "dense"}, 300) is None
    asked = s.for_request({"sparseety_policy": "tova"}, 300)
    assert asked is not None and (asked.policy, asked.budget) == ("tova", 48)
    s = parse_eviction({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_RATIO": "0.5"})
    assert s is not None and s.for_request({"sparseety_policy": "streaming"}, 300).budget == 150
    asked = s.for_request({"sparseety_policy": "streaming", "sparseety_budget": "32"}, 300)
    assert asked is not None and asked.budget == 32  # the request's own, in ASCII digits

@pytest.mark.parametrize("env, message", [
    ({"SPARSEETY_KV_POLICY": "kvzip", "SPARSEETY_KV_BUDGET": "64"}, "reconstruction pass of its own"),
    ({"SPARSEETY_KV_POLICY": "kvzap", "SPARSEETY_KV_BUDGET": "64", "SPARSEETY_KV_POLICY_OPTS": "per_head=true"},
     "kvzap with these options gives layers or KV heads different budgets"),
    ({"SPARSEETY_KV_POLICY": "pyramid", "SPARSEETY_KV_BUDGET": "64"}, "layers different budgets"),
    ({"SPARSEETY_KV_POLICY": "topk_attention", "SPARSEETY_KV_BUDGET": "64"}, "deletes no keys"),
    ({"SPARSEETY_KV_POLICY": "nope", "SPARSEETY_KV_BUDGET": "64"}, "SPARSEETY_KV_POLICY='nope' is not a policy"),
    ({"SPARSEETY_KV_POLICY": "streaming"}, "needs SPARSEETY_KV_BUDGET=N or SPARSEETY_KV_RATIO=r"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "8", "SPARSEETY_KV_RATIO": "0.5"}, "both set"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "0"}, "SPARSEETY_KV_BUDGET='0' is not an integer"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "\u0666\u0664"}, "is not an integer in [1, 1000000000]"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "6_4"}, "SPARSEETY_KV_BUDGET='6_4' is not an integer"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "1e400"}, "SPARSEETY_KV_BUDGET='1e400' is not an"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_RATIO": "inf"}, "SPARSEETY_KV_RATIO='inf' is not a number"),
    ({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_BUDGET": "x"}, "SPARSEETY_KV_BUDGET='x' is not an integer"),
    ({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_POLICY_OPTS": "sinks=8"}, "not used with SPARSEETY_KV_POLICY=dense"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "64", "SPARSEETY_KV_INTERVAL": "-1"},
     "SPARSEETY_KV_INTERVAL='-1'"),
    ({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_RATIO": "1.5"}, "SPARSEETY_KV_RATIO='1.5'"),
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
    assert s is not None and s.for_request({}, 400).budget == 100 and s.options == {"sinks": "8"} and s.interval is None
    s = parse_eviction({"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": "64",
                        "SPARSEETY_KV_INTERVAL": "1"})
    assert s is not None and s.for_request({}, 400).budget == 64 and s.options == {} and s.interval == 1


@pytest.mark.model
def test_kvzap_runs_its_vllm_variant_bound_to_the_served_checkpoint(tmp_path):
    """kvzap keeps one count per layer in vLLM (``per_head=false`` unless given), and its surrogate is found by
    the served checkpoint's fingerprint: a checkpoint none was trained for is refused, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sparseety.models.registry import resolve_model_dir

    s = parse_eviction({"SPARSEETY_KV_POLICY": "kvzap", "SPARSEETY_KV_BUDGET": "64"})
    assert s is not None
    served = resolve_model_dir("smollm2-135m")
    asked = s.for_request({}, 400, served)
    assert asked is not None and (asked.budget, asked.options) == (64, {"per_head": False})
    other = tmp_path / "retrained"
    shutil.copytree(served, other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        s.for_request({}, 400, str(other))
    assert str(info.value).startswith("sparseety_policy='kvzap': kvzap: no surrogate file given, and no linear "
                                      "surrogate ships for model 'retrained'")


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


def test_batched_holes_pad_with_self_copies_and_each_head_keeps_its_own_slots():
    keep = torch.tensor([[0, 1, 5, 6, 7, 9], [0, 1, 2, 3, 4, 5]])  # head 0 moves three slots, head 1 none
    src, dst = fill_holes(keep, 6)
    assert src.shape == dst.shape == (2, 3)
    assert src[0].tolist() == [6, 7, 9] and dst[0].tolist() == [2, 3, 4]
    assert torch.equal(src[1], dst[1])  # padding: a kept slot onto itself
    positions = kept_positions(torch.arange(12).expand(2, 12), (src, dst), 6)
    assert [sorted(p) for p in positions.tolist()] == keep.tolist()


def test_per_head_compaction_and_reading_slots_back():
    torch.manual_seed(1)
    layout = probe_layout(kernel_write, H, BS, D, torch.float32)
    blocks = torch.tensor([4, 1, 2])
    n = 20
    keys, values = torch.randn(n, H, D), torch.randn(n, H, D)
    slots = blocks[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    kv = torch.zeros(6, H, BS, 2 * D)
    kernel_write(keys, values, *split(kv), slots)
    assert torch.equal(read_slots(kv, blocks, n, layout), keys.transpose(0, 1))
    assert torch.equal(read_slots(kv, blocks, n, layout, values=True), values.transpose(0, 1))
    keep = torch.tensor([[0, 3, 11, 12, 19], [1, 2, 3, 4, 18]])
    moves = fill_holes(keep, 5)
    compact([kv], blocks, (moves[0][None], moves[1][None]), layout)
    got = read_slots(kv, blocks, 5, layout)
    positions = kept_positions(torch.arange(n).expand(H, n), moves, 5)
    for h in range(H):
        assert sorted(positions[h].tolist()) == keep[h].tolist()
        assert torch.equal(got[h], keys[positions[h], h])


def simulate(policy_name: str, options: dict, chunks: list[int], budget: int):
    """A two-layer model's prompt fed in ``chunks`` to :class:`EvictingRequest` over a simulated paged cache:
    the kept slots of the first compaction, and the own engine's choice from one pass over the whole prompt."""
    from sparseety.engine.signals import group_mean
    from sparseety.extract.scoring import column_sums, row_probs
    from sparseety.integrations.vllm.evict.slots import EvictingRequest
    from sparseety.policies.base import Observation, Signal, select_keep
    from sparseety.policies.registry import build_policy

    torch.manual_seed(2)
    layers, heads, n, scale = 2, 4, sum(chunks), 0.5
    policy = build_policy(policy_name, budget, options)
    layout = probe_layout(kernel_write, H, BS, D, torch.float32)
    blocks = torch.arange(-(-n // BS))
    queries, keys = torch.randn(layers, n, heads, D), torch.randn(layers, n, H, D)
    caches = [torch.zeros(len(blocks), H, BS, 2 * D) for _ in range(layers)]
    request = EvictingRequest("r", policy, n, layers, H)

    def read(layer, count, values):
        return read_slots(caches[layer], blocks, count, layout, values)

    end = 0
    for size in chunks:
        rows = torch.arange(end, end + size)
        for layer in range(layers):
            kernel_write(keys[layer, rows], keys[layer, rows], *split(caches[layer]), rows)
            request.observe(layer, queries[layer, rows], end + size, end + size, scale, read)
        end += size
        request.finish_forward(end)
    got = request.moves(n, n, budget, read)
    kept = [sorted(p) for p in request.positions.reshape(-1, budget).tolist()]
    want = []
    for layer in range(layers):
        q, k = queries[layer].transpose(0, 1)[None], keys[layer].transpose(0, 1)[None]
        signal = policy.prefill_signal
        attention = None
        if signal is Signal.WINDOW:
            attention = group_mean(row_probs(q[:, :, -policy.window_rows():], k, scale), H)
        elif signal is Signal.COLSUM:
            attention = group_mean(column_sums(q, k, scale, policy.colsum_stride(n)), H)
        elif signal is Signal.LAST_ROW:
            attention = group_mean(row_probs(q[:, :, -1:], k, scale)[:, :, 0], H)
        positions = torch.arange(n).expand(1, H, n)
        scores, _ = policy.score(Observation(layer, layers, 0, True, positions, k, attention, None, 0,
                                             values=k, newest=n - 1))
        want += [sorted(p) for p in select_keep(scores, budget, positions)[0].tolist()]
    return kept, want, got


@pytest.mark.parametrize("policy, options", [
    ("snapkv", {"window": 6, "kernel": 3}), ("h2o", {"prefill_rows": 8}), ("tova", {"heads": "kv_head"}),
    ("streaming", {"sinks": 2}), ("knorm", {}), ("snapkv", {"window": 4, "value_aware": True}),
])
def test_chunked_prompt_keeps_what_one_pass_of_the_own_policy_keeps(policy, options):
    kept, want, (src, dst) = simulate(policy, options, [11, 3, 6], budget=9)
    assert kept == want
    assert src.shape[:2] == (2, H)


def test_the_worker_report_joins_its_request_and_a_failure_stops_its_eviction():
    ledger = EvictionLedger(interval=1)
    ledger.track("a", 8, "tova")
    ledger.track("b", 8, "h2o")
    order = ledger.plan("a", 20, 20)
    ledger.apply(order, freed_blocks=1)
    slots = EvictedSlots.of_rows([[0, 0, 0, 3, 0.5]])
    failed = ledger.receive(StepReport({"a": slots, "gone": EvictedSlots.of_rows([[0, 0, 0, 1, 0.1]])},
                                       {"b": "scoring failed: boom"}))
    assert failed == [("b", "scoring failed: boom")]
    assert ledger.receive(StepReport(failed={"b": "again"})) == []  # warned once
    assert ledger.plan("b", 40, 20) is None  # b stops evicting and keeps what it holds
    record = ledger.forget("a").record("a")
    assert record == EvictionRecord("a", "tova", 8, 12, 1, 1, 20, slots, None, None)


def test_the_kept_positions_are_the_fed_positions_not_evicted():
    """The refused record and the live path are checked against a real server (test_vllm_eviction_dp)."""
    from sparseety.integrations.vllm.transport.record import kept_after

    slots = np.array([[0, 1, 0, 3, 0.5], [1, 0, 1, 0, 0.1], [2, 1, 0, 9, 0.2]])  # position 9 was never fed
    assert kept_after(slots, (2, 2), 5) == {"0": {"0": [0, 1, 2, 3, 4], "1": [1, 2, 3, 4]},
                                            "1": {"0": [0, 1, 2, 4], "1": [0, 1, 2, 3, 4]}}


def test_recorded_evictions_are_the_complement_of_the_kept_slots():
    from sparseety.integrations.vllm.evict.slots import EvictingRequest
    from sparseety.policies.registry import build_policy

    request = EvictingRequest("r", build_policy("streaming", 4, {"sinks": 1}), 6, 2, H, trace=True)
    read = lambda layer, n, values: torch.zeros(H, n, D)  # noqa: E731 (streaming reads positions only)
    request.moves(6, 6, 4, read)
    rows = request.take_evicted()
    assert sorted((int(r[1]), int(r[2]), int(r[3])) for r in rows) == [
        (layer, head, p) for layer in range(2) for head in range(H) for p in (1, 2)]
    assert all(r[0] == 0 for r in rows) and request.take_evicted() == []
