"""Eviction inside vLLM's paged KV cache, both processes driven step by step without vLLM: the engine core's
:class:`EngineCoreEviction` (its real :class:`EvictionLedger`, settings from :func:`parse_eviction`) and the
worker's :class:`WorkerEviction` (its real :class:`EvictingRequest`, the own engine's policies, the probed layout
and the in-place compaction), talking through the real :class:`StepOrders` and :class:`StepReport`, pickled
on their way as vLLM's multiproc executor pickles the ``SchedulerOutput`` and ``ModelRunnerOutput`` they ride
on. Each step calls the hooks as :mod:`sparseety.integrations.vllm.evict.hooks`' wrappers call them (the
same guards and fallbacks).

vLLM's objects are ``SimpleNamespace`` stand-ins with exactly the attributes the readers in
``vllm_api/eviction.py`` and ``vllm_api/worker.py`` read: the scheduler's running requests and block
manager (its pool hands freed blocks out again), the model runner's request states, input batch, block
table (rows kept across steps, as vLLM keeps them), slot mapping and attention layers. Every layer's KV cache
is a real torch tensor ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` written by a stand-in of vLLM's
CPU ``vec`` cache writer (keys column-major, values row-major per block and KV head; it is
``vllm._custom_ops`` in ``sys.modules`` for the test), so the layout is found by the real probe. What each
request must keep is computed here by hand (streaming's sinks and newest tokens; tova's last-row attention
per KV group), and every held slot is compared bit for bit with the K/V written for its position.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import pickle
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparseety.integrations.vllm.evict import hooks
from sparseety.integrations.vllm.evict.compaction import split
from sparseety.integrations.vllm.evict.hooks import HOOK, HOOK_WORKER, ORDERS, REPORT, EngineCoreEviction
from sparseety.integrations.vllm.evict.orders import Compaction, StepOrders, StepReport
from sparseety.integrations.vllm.evict.settings import checkpoint_model, parse_eviction
from sparseety.integrations.vllm.evict.worker import WorkerEviction
from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.guards import failures, guarded
from sparseety.integrations.vllm.vllm_api.messages import ImplShape
from sparseety.integrations.vllm.vllm_api.wire_messages import EvictedSlots, EvictionRecord

BS, KV, QH, D, LAYERS = 4, 2, 4, 4, 2  #: block size, KV heads, query heads (2 per KV group), head dim, layers
GROUP = QH // KV
SCALE = 0.5
NUM_BLOCKS, MAX_REQS, MAX_BLOCKS, MAX_TOKENS, MAX_POS = 16, 4, 16, 64, 40
PAD = 2  #: padding rows vLLM adds past the batch's tokens (slot -1, position 0)
PROMPT = 13
FAILED = "its compaction failed; it keeps its oldest slots"


# -- stand-ins for vLLM ------------------------------------------------------------------------------------------
class CPUAttentionBackendImpl:
    """vLLM's CPU attention backend (the adapter picks the CPU cache writer by this class name)."""


class FlashAttentionImpl:
    """Another backend's class, whose cache layout cannot be probed."""


def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa):
    """vLLM's CPU ``vec`` cache writer: per block and KV head, keys column-major ``[D, block_size]``, values
    row-major ``[block_size, D]``; slot -1 (padding) writes nothing."""
    assert isa == "vec"
    size, d = key_cache.shape[2], key_cache.shape[3]
    kc = key_cache.reshape(key_cache.shape[0], key_cache.shape[1], -1)  # views into the layer's cache
    vc = value_cache.reshape(value_cache.shape[0], value_cache.shape[1], -1)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, t = divmod(slot, size)
        kc[block, :, torch.arange(d) * size + t] = key[i]
        vc[block, :, t * d + torch.arange(d)] = value[i]


def cached(kv: torch.Tensor, block: int, t: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value ``[D]`` in slot ``t`` of ``block`` for ``head``, read in the ``vec`` layout (not the
    probe's)."""
    flat = kv.reshape(kv.shape[0], kv.shape[1], -1)
    d = torch.arange(D)
    return flat[block, head, d * BS + t], flat[block, head, BS * D + t * D + d]


@pytest.fixture(autouse=True)
def cpu_kernel(monkeypatch):
    """``vllm._custom_ops`` holding the CPU cache writer, for this test only; no trace store unless a test sets
    one."""
    ops = types.ModuleType("vllm._custom_ops")
    ops.cpu_attn_reshape_and_cache = cpu_attn_reshape_and_cache
    ops.__spec__ = importlib.machinery.ModuleSpec("vllm._custom_ops", None)
    package = types.ModuleType("vllm")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    package._custom_ops = ops
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ops)
    for name in ("SPARSEETY_TRACE_DIR", "SPARSEETY_TIER", "SPARSEETY_SAMPLE_RATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hooks, "_SEND", None)  # the scheduler channel; :meth:`Engine.free` listens on it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A served checkpoint's ``config.json`` (the worker binds each policy to it, as the scheduler does)."""
    path = tmp_path_factory.mktemp("served")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": LAYERS, "num_attention_heads": QH, "num_key_value_heads": KV,
        "hidden_size": QH * D, "head_dim": D, "intermediate_size": 32, "vocab_size": 64}))
    checkpoint_model(str(path))  # transformers' import, once per module
    return str(path)


class BlockPool:
    """vLLM's ``BlockPool``: blocks handed out from the front of the free queue, freed ones appended to it."""

    def __init__(self, ids: list[int]) -> None:
        self.free = list(ids)
        self.freed: list[int] = []

    def free_blocks(self, blocks) -> None:
        blocks = list(blocks)
        self.freed += blocks
        self.free += blocks

    def take(self) -> int:
        return self.free.pop(0)


class Engine:
    """One engine core and one worker over stand-ins of vLLM's scheduler and model runner, stepped as vLLM steps
    them: schedule (``before_schedule``, allocation for ``logical - offset`` tokens, ``message``), the worker's
    ``_update_states`` (``before_update``, then vLLM's own: finished out, new in, new blocks appended),
    ``_prepare_inputs`` (vLLM's slot mapping, then ``shift_inputs``), the forward (``plan``, each layer's cache
    write then ``layer``, ``after_forward``), ``sample_tokens`` (``outbox``) and ``update_from_output``
    (``receive``). ``strict``: a hook's exception fails the test instead of being guarded as in vLLM."""

    def __init__(self, settings, model: str, blocks: list[int], impl: type = CPUAttentionBackendImpl,
                 strict: bool = True, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(LAYERS, MAX_POS, KV, D, generator=gen)
        self.values = torch.randn(LAYERS, MAX_POS, KV, D, generator=gen)
        self.queries = torch.randn(LAYERS, MAX_POS, QH, D, generator=gen)
        self.strict = strict
        self.pool = BlockPool(blocks)
        self.manager = SimpleNamespace(req_to_blocks={}, block_size=BS, block_pool=self.pool)
        self.scheduler = SimpleNamespace(running=[], kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[self.manager])))
        self.core = EngineCoreEviction(settings, BS, model)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.layers = [SimpleNamespace(layer_name=name, impl=impl(), isa="vec",
                                       kv_cache=torch.zeros(NUM_BLOCKS, KV, BS, 2 * D)) for name in names]
        self.table = SimpleNamespace(
            block_size=BS, num_blocks_per_row=np.zeros(MAX_REQS, dtype=np.int32),
            block_table=SimpleNamespace(np=np.zeros((MAX_REQS, MAX_BLOCKS), dtype=np.int32),
                                        gpu=torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32)),
            slot_mapping=SimpleNamespace(gpu=torch.zeros(MAX_TOKENS, dtype=torch.int64)))
        self.runner = SimpleNamespace(
            requests={}, model_config=SimpleNamespace(model=model),
            compilation_config=SimpleNamespace(static_forward_context=dict(zip(names, self.layers))),
            kv_cache_config=SimpleNamespace(kv_cache_groups=[
                SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(block_size=BS))]),
            input_batch=SimpleNamespace(num_reqs=0, req_ids=[], req_id_to_index={},
                                        block_table=SimpleNamespace(block_tables=[self.table])),
            query_start_loc=SimpleNamespace(np=np.zeros(MAX_REQS + 1, dtype=np.int32)),
            positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
            seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
            optimistic_seq_lens_cpu=torch.zeros(MAX_REQS, dtype=torch.int32))
        self.worker = WorkerEviction(settings)
        self.shape = ImplShape(num_heads=QH, num_kv_heads=KV, head_size=D, scale=SCALE)
        self.requests: dict[str, SimpleNamespace] = {}  #: the engine core's ``Request`` s
        self.records: list[EvictionRecord] = []  #: what the scheduler channel carried to the observer
        self.finishing: set[str] = set()
        self.resumed: set[str] = set()

    def guard(self, hook: str, fn, *args):
        return fn(*args) if self.strict else guarded(hook, fn, *args)

    def add(self, rid: str, prompt: int = PROMPT, extra: dict | None = None) -> None:
        """vLLM's ``Scheduler.add_request`` (the ``kv-eviction`` hook admits it first)."""
        request = SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_computed_tokens=0,
                                  sampling_params=SimpleNamespace(extra_args=dict(extra or {})),
                                  skip_reading_prefix_cache=False, is_finished=lambda: rid in self.finishing)
        self.guard(HOOK, hooks._admit, self.core, request)
        self.requests[rid] = request
        self.scheduler.running.append(request)

    def free(self, rid: str, finished: bool) -> None:
        """vLLM's ``_free_request_blocks``: finished, or preempted (recomputed from zero)."""
        request = self.requests[rid]
        if finished:
            self.finishing.add(rid)
            self.scheduler.running.remove(request)
        else:
            request.num_computed_tokens = 0
            self.resumed.add(rid)
        self.pool.free_blocks(reversed(self.manager.req_to_blocks.pop(rid, [])))
        hooks._SEND = lambda messages, requests: self.records.extend(messages)
        try:
            self.guard(HOOK, hooks._freed, self.core, request)
        finally:
            hooks._SEND = None

    def step(self, tokens: dict[str, int]) -> tuple[StepOrders, StepReport | None]:
        """One engine step scheduling ``tokens`` new tokens per request; the orders and report as they arrived."""
        core, worker, runner = self.core, self.worker, self.runner
        # -- the engine core: Scheduler.schedule
        orders = self.guard(HOOK, core.before_schedule, self.scheduler) or []
        new_blocks = {}
        for rid, n in tokens.items():
            held = self.requests[rid].num_computed_tokens + n - core.ledger.offset(rid)  # the managers' count
            blocks = self.manager.req_to_blocks.setdefault(rid, [])
            new_blocks[rid] = [self.pool.take() for _ in range(-(-held // BS) - len(blocks))]
            blocks += new_blocks[rid]
        output = SimpleNamespace(num_scheduled_tokens=dict(tokens), finished_req_ids=set(self.finishing))
        setattr(output, ORDERS, self.guard(HOOK, core.message, orders, output.num_scheduled_tokens)
                or core.fallback_message(orders))
        output = pickle.loads(pickle.dumps(output))  # to the worker process
        # -- the worker: _update_states (the hook first, then vLLM's own)
        message = getattr(output, ORDERS, None)
        done = self.guard(HOOK_WORKER, worker.before_update, runner, message, output.finished_req_ids)
        if done is None and message:
            self.guard(HOOK_WORKER, worker.cut_only, runner, message)
        for rid in output.finished_req_ids:
            runner.requests.pop(rid, None)
        self.finishing.clear()
        for rid, new in new_blocks.items():
            state = runner.requests.get(rid)
            request = self.requests[rid]
            if state is None:
                runner.requests[rid] = SimpleNamespace(num_prompt_tokens=request.num_prompt_tokens,
                                                       sampling_params=request.sampling_params, block_ids=(new,))
            elif rid in self.resumed:
                state.block_ids = (new,)  # resumed from preemption: its block ids replaced
            else:
                state.block_ids[0].extend(new)
        self._batch(tokens, new_blocks)
        self.resumed -= set(tokens)
        if tokens:
            self._prepare(tokens)
            self._forward(tokens)
        # -- sample_tokens, then the engine core's update_from_output
        result = SimpleNamespace(req_ids=list(tokens))
        report = self.guard(HOOK_WORKER, worker.outbox) if tokens else None
        if report:
            setattr(result, REPORT, report)
        result = pickle.loads(pickle.dumps(result))  # back to the engine core
        self.guard(HOOK, core.receive, getattr(result, REPORT, None))
        for rid, n in tokens.items():
            self.requests[rid].num_computed_tokens += n
        return message, getattr(result, REPORT, None)

    def _batch(self, tokens: dict[str, int], new_blocks: dict[str, list[int]]) -> None:
        """vLLM's persistent batch: rows of requests still scheduled keep their block-table row (moved up when
        one before them left), new and resumed requests get a fresh row, the step's new blocks are appended."""
        batch, table = self.runner.input_batch, self.table
        rows = {rid: (table.block_table.np[i].copy(), int(table.num_blocks_per_row[i]))
                for i, rid in enumerate(batch.req_ids[: batch.num_reqs])}
        order = [rid for rid in batch.req_ids[: batch.num_reqs] if rid in tokens and rid not in self.resumed]
        order += [rid for rid in tokens if rid not in order]
        table.block_table.np[:] = 0
        table.num_blocks_per_row[:] = 0
        for i, rid in enumerate(order):
            if rid in rows and rid not in self.resumed:
                entries, count = rows[rid]
                table.block_table.np[i] = entries
                new = new_blocks[rid]
                table.block_table.np[i, count: count + len(new)] = new
                table.num_blocks_per_row[i] = count + len(new)
            else:
                ids = self.runner.requests[rid].block_ids[0]
                table.block_table.np[i, : len(ids)] = ids
                table.num_blocks_per_row[i] = len(ids)
        table.block_table.gpu[:] = torch.from_numpy(table.block_table.np)
        batch.req_ids, batch.num_reqs = order, len(order)
        batch.req_id_to_index = {rid: i for i, rid in enumerate(order)}

    def _prepare(self, tokens: dict[str, int]) -> None:
        """vLLM's ``_prepare_inputs`` (logical positions, sequence lengths, slot mapping from the block table),
        then the hook's ``shift_inputs`` (or ``drop_writes`` when that fails)."""
        runner, table = self.runner, self.table
        start = 0
        runner.query_start_loc.np[0] = 0
        for i, rid in enumerate(runner.input_batch.req_ids):
            computed, n = self.requests[rid].num_computed_tokens, tokens[rid]
            positions = torch.arange(computed, computed + n)
            runner.positions[start: start + n] = positions
            ids = table.block_table.gpu[i].to(torch.int64)
            table.slot_mapping.gpu[start: start + n] = ids[positions // BS] * BS + positions % BS
            runner.seq_lens[i] = runner.optimistic_seq_lens_cpu[i] = computed + n
            start += n
            runner.query_start_loc.np[i + 1] = start
        runner.positions[start: start + PAD] = 0
        table.slot_mapping.gpu[start: start + PAD] = -1
        self.tokens = start
        if self.worker.offsets:
            if self.guard(HOOK_WORKER, adapter.shift_inputs, runner, self.worker.offsets) is None:
                self.guard(HOOK_WORKER, adapter.drop_writes, runner, self.worker.offsets)

    def _forward(self, tokens: dict[str, int]) -> None:
        """The model's forward: each layer writes the step's K/V through the slot mapping, attends, and the
        ``kv-eviction-worker`` backend wrapper hands the layer's query rows to the worker."""
        total = self.tokens + PAD
        positions = self.runner.positions[:total].clone()
        slots = self.table.slot_mapping.gpu[:total].clone()
        self.guard(HOOK_WORKER, self.worker.plan, self.runner, positions)
        for layer, module in enumerate(self.layers):
            cpu_attn_reshape_and_cache(self.keys[layer, positions], self.values[layer, positions],
                                       *split(module.kv_cache), slots, module.isa)
            query = self.queries[layer, positions].reshape(total, QH * D)
            if self.worker.step:
                self.guard(HOOK_WORKER, self.worker.layer, module, query, self.shape)
        self.guard(HOOK_WORKER, self.worker.after_forward)


# -- what must be kept, by hand --------------------------------------------------------------------------------
def streaming_scores(sinks: int):
    """Streaming's score of the held positions: the position, a sink above everything."""
    def scores(engine, layer, head, held, newest):
        return [math.inf if p < sinks else float(p) for p in held]
    return scores


def tova_scores(engine: Engine, layer: int, head: int, held: list[int], newest: int) -> list[float]:
    """tova with ``heads=kv_head``: the newest query row's attention over the held keys, averaged over the KV
    group's query heads."""
    q = engine.queries[layer, newest, head * GROUP: (head + 1) * GROUP]  # [GROUP, D]
    k = engine.keys[layer, held, head]  # [n, D]
    return torch.softmax(q @ k.T * SCALE, dim=-1).mean(dim=0).tolist()


class Reference:
    """What one request's slots hold per layer and KV head (positions, slot by slot), and what it evicted."""

    def __init__(self, engine: Engine, score) -> None:
        self.engine, self.score = engine, score
        self.held = [[[] for _ in range(KV)] for _ in range(LAYERS)]
        self.evicted: dict[tuple[int, int, int], tuple[set[int], dict[int, float]]] = {}

    def forward(self, first: int, n: int) -> None:
        for heads in self.held:
            for held in heads:
                held.extend(range(first, first + n))

    def compact(self, kept: int, newest: int, step: int) -> None:
        """Keep the ``kept`` best (ties to the lower position); kept slots below ``kept`` stay and those past
        it fill the holes, in order."""
        for layer, heads in enumerate(self.held):
            for head, held in enumerate(heads):
                scores = self.score(self.engine, layer, head, held, newest)
                ranked = sorted(range(len(held)), key=lambda s: (-scores[s], held[s]))
                keep = {held[s] for s in ranked[:kept]}
                movers = [s for s in range(kept, len(held)) if held[s] in keep]
                holes = [s for s in range(kept) if held[s] not in keep]
                out = held[:kept]
                for hole, s in zip(holes, movers, strict=True):
                    out[hole] = held[s]
                self.evicted[step, layer, head] = ({p for p in held if p not in keep},
                                                   {p: scores[s] for s, p in enumerate(held) if p not in keep})
                heads[head] = out

    def check_cache(self, rid: str) -> None:
        """Every slot the request holds has the K/V of its position, bit for bit, in every layer and KV head."""
        engine = self.engine
        blocks = engine.runner.requests[rid].block_ids[0]
        for layer, heads in enumerate(self.held):
            kv = engine.layers[layer].kv_cache
            for head, held in enumerate(heads):
                for slot, position in enumerate(held):
                    key, value = cached(kv, blocks[slot // BS], slot % BS, head)
                    assert torch.equal(key, engine.keys[layer, position, head]), (layer, head, slot, position)
                    assert torch.equal(value, engine.values[layer, position, head]), (layer, head, slot, position)

    def check_record_slots(self, slots: EvictedSlots) -> None:
        """The record's evicted slots are exactly those left out, with the score each had."""
        got: dict[tuple[int, int, int], dict[int, float]] = {}
        for step, layer, head, position, score in zip(slots.step, slots.layer, slots.kv_head, slots.position,
                                                      slots.score, strict=True):
            got.setdefault((step, layer, head), {})[position] = score
        assert set(got) == set(self.evicted)
        for key, (positions, scores) in self.evicted.items():
            assert set(got[key]) == positions, key
            for position in positions:
                assert got[key][position] == pytest.approx(scores[position], rel=1e-5), (key, position)


def check_blocks_agree(engine: Engine, rid: str) -> list[int]:
    """The worker's block list and its batch row hold exactly the blocks the scheduler gave the request; the row's
    entries past them are the null block."""
    blocks = engine.manager.req_to_blocks[rid]
    assert engine.runner.requests[rid].block_ids[0] == blocks
    row = engine.runner.input_batch.req_id_to_index[rid]
    assert engine.table.num_blocks_per_row[row] == len(blocks)
    assert engine.table.block_table.np[row].tolist() == blocks + [0] * (MAX_BLOCKS - len(blocks))
    assert engine.table.block_table.gpu[row].tolist() == blocks + [0] * (MAX_BLOCKS - len(blocks))
    return blocks


def settings_of(**env: str):
    return parse_eviction({f"SPARSEETY_KV_{k.upper()}": v for k, v in env.items()})


# -- the whole loop ----------------------------------------------------------------------------------------------
def test_tova_per_kv_head_compacts_twice_and_every_held_slot_is_its_positions_kv(model_dir, tmp_path, monkeypatch):
    """13-token prompt, budget 6, every 4 tokens: the compaction after the prompt keeps each KV head's 6 best
    by the prompt's last row, the next one (held 10 at logical 17) by the newest decode row; blocks freed by the
    scheduler leave the worker's table at once and come back as the request's next block; the record carries
    every evicted slot with its score."""
    monkeypatch.setenv("SPARSEETY_TRACE_DIR", str(tmp_path / "traces"))  # the worker records evicted slots
    settings = settings_of(policy="tova", budget="6", interval="4", policy_opts="heads=kv_head")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4])
    ref = Reference(engine, tova_scores)
    engine.add("r")
    assert engine.requests["r"].skip_reading_prefix_cache  # its blocks will be compacted: never shared
    message, report = engine.step({"r": PROMPT})
    assert message == StepOrders() and report is None
    ref.forward(0, PROMPT)
    ref.check_cache("r")
    assert check_blocks_agree(engine, "r") == [7, 2, 9, 4]

    logical = PROMPT
    for _ in range(6):
        message, report = engine.step({"r": 1})
        if logical in (13, 17):  # 13 held after the prompt; then 10 = budget + interval
            physical = 13 if logical == 13 else 10
            assert message.compact == (Compaction("r", logical, physical, 6),)
            ref.compact(6, logical - 1, logical - PROMPT)
            assert report is not None and not report.failed
            assert len(report.evicted["r"]) == (physical - 6) * LAYERS * KV
        else:
            assert message.compact == () and report is None
        offset = 7 if logical < 17 else 11
        assert message.offset == {"r": offset} and message.reset == ()
        ref.forward(logical, 1)
        ref.check_cache("r")
        logical += 1
        assert engine.runner.seq_lens[0] == logical - offset  # attends over the slots it holds
        assert engine.worker.requests["r"].positions.tolist() == [[h[:6] for h in heads] for heads in ref.held]
    # freed: the prompt's last two blocks, then the one taken back at the third decode step
    assert engine.pool.freed == [4, 9, 4]
    assert check_blocks_agree(engine, "r") == [7, 2]
    assert [[len(h) for h in heads] for heads in ref.held] == [[8, 8], [8, 8]]
    assert any(sorted(first) != sorted(second) for first, second in ref.held)  # KV heads keep their own tokens

    engine.free("r", finished=True)
    engine.step({})
    assert "r" not in engine.worker.requests and "r" not in engine.core.ledger.requests
    (record,) = engine.records
    assert (record.req_id, record.policy, record.budget, record.evicted_tokens_per_layer, record.freed_blocks,
            record.compactions, record.peak_tokens, record.failure, record.refused) == \
        ("r", "tova", 6, 7 + 4, 3, 2, 13, None, None)
    ref.check_record_slots(record.slots)


def test_a_dense_neighbour_is_never_moved_while_a_request_that_asked_for_streaming_evicts(model_dir):
    """A dense server; one request asks for streaming (2 sinks, budget 6) in its ``vllm_xargs``: it keeps
    positions 0, 1 and its 4 newest; its neighbour in the same batch keeps every slot where it was written,
    its blocks, its batch row and its sequence length untouched, even when it is handed a block the other freed."""
    settings = settings_of(policy="dense", budget="64")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4, 3, 12, 5])
    engine.add("e", PROMPT, {"sparseety_policy": "streaming", "sparseety_budget": 6,
                             "sparseety_policy_opts": "sinks=2"})
    engine.add("d", 9)
    assert not engine.requests["d"].skip_reading_prefix_cache
    evicting, dense = Reference(engine, streaming_scores(2)), Reference(engine, None)
    engine.step({"e": PROMPT, "d": 9})
    evicting.forward(0, PROMPT)
    dense.forward(0, 9)
    assert engine.manager.req_to_blocks == {"e": [7, 2, 9, 4], "d": [3, 12, 5]}
    for i in range(5):
        logical = PROMPT + i
        message, _ = engine.step({"e": 1, "d": 1})
        if i in (0, 4):  # after the prompt; then holding 10 = budget + one block
            assert message.compact == (Compaction("e", logical, 13 if i == 0 else 10, 6),)
            evicting.compact(6, logical - 1, logical - PROMPT)
        else:
            assert message.compact == ()
        assert set(message.offset) == {"e"}
        evicting.forward(PROMPT + i, 1)
        dense.forward(9 + i, 1)
        evicting.check_cache("e")
        dense.check_cache("d")
        check_blocks_agree(engine, "e")
        check_blocks_agree(engine, "d")
        assert engine.runner.seq_lens.tolist()[:2] == [logical + 1 - message.offset["e"], 9 + i + 1]
    assert [sorted(h) for heads in evicting.held for h in heads] == [[0, 1, 13, 14, 15, 16, 17]] * (LAYERS * KV)
    assert engine.manager.req_to_blocks == {"e": [7, 2], "d": [3, 12, 5, 9]}  # d's 4th block: one e freed
    assert engine.pool.freed == [4, 9, 4]
    assert engine.core.ledger.requests["e"].policy == "streaming" and "d" not in engine.worker.offsets
    assert engine.worker.requests["d"] is None  # decided dense, as the scheduler decided



def own_engine_prompt_scores(name: str, budget: int, options: dict):
    """The own engine's policy scoring the whole prompt in one pass (the signal its engine would build from
    every query row at once), per layer and KV head: the first compaction's scores."""
    from sparseety.extract.scoring import column_sums, group_mean, row_probs
    from sparseety.policies.base import Observation, Signal
    from sparseety.policies.registry import build_policy

    policy = build_policy(name, budget, options)

    def scores(engine, layer, head, held, newest):
        assert held == list(range(newest + 1))  # the first compaction: every prompt position held
        q = engine.queries[layer, : newest + 1].transpose(0, 1)[None]  # [1, QH, n, D]
        k = engine.keys[layer, : newest + 1].transpose(0, 1)[None]  # [1, KV, n, D]
        signal = policy.prefill_signal
        if signal is Signal.WINDOW:
            attention = group_mean(row_probs(q[:, :, -policy.window_rows():], k, SCALE), KV)
        elif signal is Signal.COLSUM:
            attention = group_mean(column_sums(q, k, SCALE, policy.colsum_stride(newest + 1)), KV)
        else:
            attention = group_mean(row_probs(q[:, :, -1:], k, SCALE)[:, :, 0], KV)
        positions = torch.arange(newest + 1).expand(1, KV, newest + 1)
        out, _ = policy.score(Observation(layer, LAYERS, 0, True, positions, k, attention, None, 0,
                                          values=engine.values[layer, : newest + 1].transpose(0, 1)[None],
                                          newest=newest))
        return out[0, head].tolist()
    return scores


@pytest.mark.parametrize("policy, opts, options, budget, chunks", [
    ("snapkv", "window=4 kernel=3", {"window": 4, "kernel": 3}, 9, (11, 2)),
    ("h2o", "prefill_rows=8", {"prefill_rows": 8}, 6, (8, 5))])
def test_a_prompt_in_two_chunks_is_compacted_as_one_pass_of_the_own_policy(model_dir, policy, opts, options, budget,
                                                                           chunks):
    """Chunked prefill (each chunk's rows in their own forward): the worker carries the window rows (snapkv's
    window reaches into the first chunk) or the column sums across chunks, and the first compaction keeps what
    the own engine's policy keeps from one pass over the whole prompt."""
    settings = settings_of(policy=policy, budget=str(budget), policy_opts=opts)
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4])
    ref = Reference(engine, own_engine_prompt_scores(policy, budget, options))
    engine.add("r")
    first = 0
    for n in chunks:
        message, _ = engine.step({"r": n})
        assert message.compact == ()
        ref.forward(first, n)
        first += n
    message, report = engine.step({"r": 1})
    assert message.compact == (Compaction("r", 13, 13, budget),) and report is None
    ref.compact(budget, 12, 0)
    ref.forward(13, 1)
    ref.check_cache("r")
    assert check_blocks_agree(engine, "r") == [7, 2, 9, 4][: -(-(budget + 1) // BS)]
    assert engine.worker.requests["r"].positions.tolist() == [[h[:budget] for h in heads] for heads in ref.held]

# -- failures ------------------------------------------------------------------------------------------------
def test_a_compaction_that_raises_still_cuts_the_freed_blocks_and_the_request_stops_evicting(model_dir):
    """The worker's compaction raises (a fault injected into ``carry_out``): the hook's fallback ``cut_only`` takes
    the blocks the scheduler freed out of the block list and the batch row, the offset holds (the next token is
    written after the 6 oldest slots it keeps), the next report names the failure once, and the engine core
    stops ordering compactions and records why."""
    settings = settings_of(policy="tova", budget="6", interval="4")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4], strict=False)
    ref = Reference(engine, tova_scores)
    engine.add("r")
    engine.step({"r": PROMPT})
    ref.forward(0, PROMPT)

    def fault(runner, order):
        raise RuntimeError("injected fault")

    engine.worker.carry_out = fault
    before = failures()
    message, report = engine.step({"r": 1})
    assert failures().get(HOOK_WORKER, 0) == before.get(HOOK_WORKER, 0) + 1  # before_update, not cut_only
    assert failures().get(HOOK, 0) == before.get(HOOK, 0)
    assert message.compact == (Compaction("r", 13, 13, 6),)
    assert report == StepReport({}, {"r": FAILED})
    assert check_blocks_agree(engine, "r") == [7, 2] and engine.pool.freed == [4, 9]
    ref.held = [[h[:6] for h in heads] for heads in ref.held]  # uncompacted: its oldest slots
    ref.forward(13, 1)
    ref.check_cache("r")
    assert engine.core.failed == 1 and engine.core.ledger.requests["r"].failure == FAILED
    for position in range(14, 20):
        message, report = engine.step({"r": 1})
        assert message == StepOrders((), {"r": 7}) and report is None  # never again, and reported once
        ref.forward(position, 1)
    ref.check_cache("r")
    engine.free("r", finished=True)
    (record,) = engine.records
    assert (record.compactions, record.evicted_tokens_per_layer, record.freed_blocks, record.failure) == \
        (1, 7, 2, FAILED)


def test_a_policy_whose_scoring_fails_keeps_the_newest_tokens_and_says_so(model_dir, monkeypatch):
    """tova's scoring raises inside the layer hook: the compaction keeps the newest 6 tokens instead (streaming
    with no sinks), still moved bit for bit, and the report names the scoring failure."""
    from sparseety.policies.tova import TOVAPolicy

    settings = settings_of(policy="tova", budget="6")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4])
    ref = Reference(engine, streaming_scores(0))
    engine.add("r")

    def fault(self, obs):
        raise RuntimeError("injected scoring fault")

    monkeypatch.setattr(TOVAPolicy, "score", fault)
    engine.step({"r": PROMPT})
    ref.forward(0, PROMPT)
    message, report = engine.step({"r": 1})
    ref.compact(6, 12, 0)
    ref.forward(13, 1)
    ref.check_cache("r")
    assert [sorted(h) for heads in ref.held for h in heads] == [[7, 8, 9, 10, 11, 12, 13]] * (LAYERS * KV)
    assert report is not None and report.failed == {"r": "scoring failed: RuntimeError('injected scoring fault')"}
    assert engine.core.ledger.requests["r"].failure == report.failed["r"]


def test_an_order_the_worker_never_decided_still_cuts_the_freed_blocks_and_stops_the_request(model_dir):
    """An attention backend whose cache layout cannot be probed: the worker's ``plan`` fails (guarded) before it
    decides the request; the scheduler still compacts and frees the tail blocks, so the worker takes them out of
    its block table all the same, keeps the oldest slots, and the report stops the request's eviction."""
    settings = settings_of(policy="streaming", budget="6", policy_opts="sinks=2")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4], impl=FlashAttentionImpl, strict=False)
    ref = Reference(engine, None)
    engine.add("r")
    before = failures().get(HOOK_WORKER, 0)
    engine.step({"r": PROMPT})
    assert failures().get(HOOK_WORKER, 0) == before + 1 and engine.worker.requests == {}
    message, report = engine.step({"r": 1})
    assert message.compact == (Compaction("r", 13, 13, 6),) and engine.pool.freed == [4, 9]
    assert check_blocks_agree(engine, "r") == [7, 2]
    assert report is not None and report.evicted == {} and set(report.failed) == {"r"}
    assert engine.core.ledger.requests["r"].failure == report.failed["r"]
    ref.forward(0, 6)  # its oldest slots, then the new token after them
    ref.forward(13, 1)
    ref.check_cache("r")
    message, report = engine.step({"r": 1})
    assert message == StepOrders((), {"r": 7}) and report is None


# -- preemption --------------------------------------------------------------------------------------------------
def test_a_preempted_request_starts_afresh_and_its_recompute_is_compacted_as_a_first_time(model_dir):
    """After one compaction vLLM preempts the request: the next step's message resets it on the worker (no offset,
    no order), the recompute of its 15 tokens into new blocks is compacted once more from the recompute's last
    row, as a first compaction; the record sums what both lives evicted and freed."""
    settings = settings_of(policy="tova", budget="6", interval="4", policy_opts="heads=kv_head")
    engine = Engine(settings, model_dir, blocks=[7, 2, 9, 4, 11, 5])
    engine.add("r")
    engine.step({"r": PROMPT})
    engine.step({"r": 1})  # compacted to 6, then one more
    engine.step({"r": 1})
    assert engine.worker.requests["r"].compacted
    engine.free("r", finished=False)
    assert engine.pool.freed == [4, 9, 2, 7]
    message, _ = engine.step({})
    assert message == StepOrders((), {}, ("r",))
    request = engine.worker.requests["r"]
    assert request.positions is None and not request.compacted and not request.prefilled

    ref = Reference(engine, tova_scores)
    engine.step({"r": 15})  # the prompt and both output tokens, recomputed
    ref.forward(0, 15)
    assert engine.manager.req_to_blocks["r"] == [11, 5, 4, 9]
    message, _ = engine.step({"r": 1})
    assert message.compact == (Compaction("r", 15, 15, 6),) and message.offset == {"r": 9}
    ref.compact(6, 14, 2)
    ref.forward(15, 1)
    ref.check_cache("r")
    assert check_blocks_agree(engine, "r") == [11, 5]
    engine.free("r", finished=True)
    (record,) = engine.records
    assert (record.evicted_tokens_per_layer, record.freed_blocks, record.compactions, record.peak_tokens) == \
        (7 + 9, 2 + 2, 1, 15)


def test_an_order_of_a_request_preempted_while_scheduling_is_dropped_and_it_is_reset():
    """``before_schedule`` compacted a request, then vLLM preempted it in the same ``schedule``: its order and
    offset leave the message (its blocks are all free) and the worker resets it; its neighbour's stay."""
    core = EngineCoreEviction(settings_of(policy="streaming", budget="6", policy_opts="sinks=2"), BS)
    pool = BlockPool([])
    manager = SimpleNamespace(req_to_blocks={"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}, block_size=BS, block_pool=pool)
    scheduler = SimpleNamespace(running=[SimpleNamespace(request_id=rid, num_computed_tokens=PROMPT,
                                                         num_prompt_tokens=PROMPT) for rid in "ab"],
                                kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
                                    single_type_managers=[manager])))
    assert core.admit("a", PROMPT, {}) and core.admit("b", PROMPT, {})
    orders = core.before_schedule(scheduler)
    assert orders == [Compaction("a", 13, 13, 6), Compaction("b", 13, 13, 6)]
    assert manager.req_to_blocks == {"a": [1, 2], "b": [5, 6]} and pool.freed == [4, 3, 8, 7]
    assert core.freed("a", finished=False) is None  # vLLM's preemption frees all of a's blocks
    message = core.message(orders, {"b": 1})
    assert message == StepOrders((Compaction("b", 13, 13, 6),), {"b": 7}, ("a",))
    assert core.message([], {"b": 1}).reset == ()  # reset once
    assert core.fallback_message(orders) == StepOrders(tuple(orders), {"b": 7})


# -- the engine core alone ---------------------------------------------------------------------------------------
def test_admission_tracks_evicting_requests_and_records_a_refused_one_as_served_dense():
    core = EngineCoreEviction(settings_of(policy="dense", budget="64"), BS)
    assert not core.admit("plain", 300, {}) and "plain" not in core.ledger.requests
    assert core.admit("tova", 300, {"sparseety_policy": "tova", "sparseety_budget": "32"})
    assert (core.ledger.requests["tova"].budget, core.ledger.requests["tova"].policy) == (32, "tova")
    assert not core.admit("bad", 300, {"sparseety_policy": "tova", "sparseety_budget": "0"})
    assert core.freed("bad", finished=False) is None  # a preemption keeps the refusal until it finishes
    record = core.freed("bad", finished=True)
    assert record == EvictionRecord("bad", "tova", refused="sparseety_budget='0' is not an integer in "
                                                             "[1, 1000000000]")
    assert core.freed("bad", finished=True) is None and core.freed("plain", finished=True) is None
    assert core.freed("tova", finished=True) == EvictionRecord("tova", "tova", 32)


def test_refused_requests_are_remembered_up_to_the_limit_oldest_first():
    core = EngineCoreEviction(settings_of(policy="dense"), BS)
    for i in range(hooks.REFUSED_LIMIT + 1):
        assert not core.admit(f"r{i}", 10, {"sparseety_policy": "nope"})
    assert len(core.refused) == hooks.REFUSED_LIMIT and "r0" not in core.refused
    assert core.freed(f"r{hooks.REFUSED_LIMIT}", True).refused.startswith("sparseety_policy='nope' is not a policy")


def test_a_failed_shrink_stops_only_that_request_and_frees_nothing_for_it():
    """``shrink_blocks`` raises for one request (its manager entry is not a list): it stops evicting, no order,
    its offset stays 0; the other request is compacted."""
    core = EngineCoreEviction(settings_of(policy="streaming", budget="6", policy_opts="sinks=2"), BS)
    pool = BlockPool([])
    manager = SimpleNamespace(req_to_blocks={"a": (1, 2, 3, 4), "b": [5, 6, 7, 8]}, block_size=BS, block_pool=pool)
    scheduler = SimpleNamespace(running=[SimpleNamespace(request_id=rid, num_computed_tokens=PROMPT,
                                                         num_prompt_tokens=PROMPT) for rid in "ab"],
                                kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
                                    single_type_managers=[manager])))
    core.admit("a", PROMPT, {})
    core.admit("b", PROMPT, {})
    assert core.before_schedule(scheduler) == [Compaction("b", 13, 13, 6)]
    assert core.failed == 1 and core.ledger.requests["a"].failure.startswith("planning its compaction failed: ")
    assert core.ledger.offset("a") == 0 and pool.freed == [8, 7]
    assert core.before_schedule(scheduler) == []  # a never again; b holds 6


def test_a_report_that_is_not_a_step_report_is_ignored():
    core = EngineCoreEviction(settings_of(policy="streaming", budget="6"), BS)
    core.admit("a", PROMPT, {})
    for outbox in (None, {"failed": {"a": "x"}}, "a"):
        core.receive(outbox)
    assert core.failed == 0 and core.ledger.requests["a"].failure is None


# -- what vLLM carries between processes -------------------------------------------------------------------------
def test_orders_and_reports_survive_the_pickling_of_the_vllm_objects_they_ride_on():
    """vLLM's multiproc executor pickles the ``SchedulerOutput`` (to the workers) and ``ModelRunnerOutput`` (back):
    both typed messages come out equal and typed."""
    orders = StepOrders((Compaction("a", 300, 300, 64), Compaction("b", 332, 96, 64)), {"a": 236, "b": 268},
                        ("c",))
    slots = EvictedSlots.of_rows([[0, 0, 1, 3, 0.25], [4, 1, 0, 17, float("inf")]])
    report = StepReport({"a": slots, "b": EvictedSlots()}, {"c": "scoring failed: RuntimeError('x')"})
    output = SimpleNamespace(num_scheduled_tokens={"a": 1}, finished_req_ids=set())
    setattr(output, ORDERS, orders)
    result = SimpleNamespace(req_ids=["a"])
    setattr(result, REPORT, report)
    for carrier, name, message in ((output, ORDERS, orders), (result, REPORT, report)):
        back = getattr(pickle.loads(pickle.dumps(carrier, protocol=pickle.HIGHEST_PROTOCOL)), name)
        assert back == message and type(back) is type(message)
    back = getattr(pickle.loads(pickle.dumps(result)), REPORT)
    assert type(back.evicted["a"]) is EvictedSlots and back.evicted["a"].score == (0.25, math.inf)
    assert back.evicted["a"].position == (3, 17) and len(back.evicted["b"]) == 0
    assert type(pickle.loads(pickle.dumps(output)).sparseety_kv.compact[1]) is Compaction


# -- the worker's inputs -----------------------------------------------------------------------------------------
def test_shift_inputs_moves_only_offset_rows_and_drop_writes_sends_them_nowhere():
    """Rows of a request holding 7 fewer tokens than it computed attend over 7 fewer and write at ``position -
    7`` through its block table; a dense row is untouched. ``drop_writes`` (when shifting failed) gives its
    rows slot -1."""
    table = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(
        gpu=torch.tensor([[7, 2, 0, 0], [3, 12, 5, 0]], dtype=torch.int32)),
        slot_mapping=SimpleNamespace(gpu=torch.full((4,), 99, dtype=torch.int64)))
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_id_to_index={"e": 0, "d": 1},
                                    block_table=SimpleNamespace(block_tables=[table])),
        query_start_loc=SimpleNamespace(np=np.array([0, 2, 3])), positions=torch.tensor([13, 14, 9, 0]),
        seq_lens=torch.tensor([15, 10]), optimistic_seq_lens_cpu=torch.tensor([15, 10]))
    assert adapter.shift_inputs(runner, {"e": 7, "gone": 3})
    assert runner.seq_lens.tolist() == [8, 10] and runner.optimistic_seq_lens_cpu.tolist() == [8, 10]
    assert table.slot_mapping.gpu.tolist() == [2 * BS + 2, 2 * BS + 3, 99, 99]  # slots 6 and 7: block 2
    adapter.drop_writes(runner, {"e": 7, "d": 0})
    assert table.slot_mapping.gpu.tolist() == [-1, -1, 99, 99]
