"""The vLLM capture's bookkeeping and scoring on small tensors, against a plain loop over heads and rows.

No vLLM: :class:`RequestCapture` is driven the way the backend wrapper drives it (a prefill in chunks,
decode steps, drafted rows a later step re-feeds, a prefix it never saw) and :func:`importance.summed_rows`
folds the result as the observer does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparseety.integrations.vllm.observe.attention_capture import RequestCapture
from sparseety.integrations.vllm.vllm_api.ids import external_id
from sparseety.integrations.vllm.transport.channels import client_channel, importance_channel
from sparseety.integrations.vllm.observe.importance import summed_rows

LAYERS, HEADS, KV_HEADS, D = 2, 6, 2, 8
SCALE = 1 / math.sqrt(D)


W_O = torch.randn(LAYERS, 16, HEADS * D, generator=torch.Generator().manual_seed(1)).numpy()  # o_proj weights


def reference(q_all, k_all, v_all, rows, mode, visible=None):
    """Per layer, sum over ``rows`` of the mean over heads of softmax(q·K[:q+1]) (times ‖v‖ for ``value``,
    ‖W_O^h v‖ for ``output``), computed head by head with plain loops; ``visible`` [n] bool limits the keys
    a row attends to."""
    n = k_all.shape[2]
    out = np.zeros((LAYERS, n))
    group = HEADS // KV_HEADS
    for layer in range(LAYERS):
        for q in rows:
            for h in range(HEADS):
                kv = h // group
                keys = range(q + 1) if visible is None else [j for j in range(q + 1) if visible[j]]
                logits = {j: float(q_all[layer, q, h] @ k_all[layer, kv, j]) * SCALE for j in keys}
                top = max(logits.values())
                z = sum(math.exp(s - top) for s in logits.values())
                for j, s in logits.items():
                    alpha = math.exp(s - top) / z
                    weight = 1.0
                    if mode == "value":
                        weight = float(np.linalg.norm(v_all[layer, kv, j]))
                    elif mode == "output":
                        weight = float(np.linalg.norm(W_O[layer][:, h * D : (h + 1) * D] @ v_all[layer, kv, j]))
                    out[layer, j] += alpha * weight / HEADS
    return out


def drive(capture, q_all, k_all, v_all, feeds):
    """Feed ``(p0, n, key_override)`` forwards the way the backend wrapper does, layer by layer."""
    for p0, n, keys in feeds:
        rows = capture.begin(p0, n)
        for layer in range(LAYERS):
            k = (keys if keys is not None else k_all)[layer, :, p0 : p0 + n].swapaxes(0, 1)
            v = v_all[layer, :, p0 : p0 + n].swapaxes(0, 1)
            capture.write(layer, p0, torch.as_tensor(k), torch.as_tensor(v))
            if rows:
                capture.score(layer, p0, torch.as_tensor(q_all[layer, p0 : p0 + n]), rows, SCALE)


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    n = 20
    q = torch.randn(LAYERS, n, HEADS, D, generator=g).numpy()
    k = torch.randn(LAYERS, KV_HEADS, n, D, generator=g).numpy()
    v = torch.randn(LAYERS, KV_HEADS, n, D, generator=g).numpy()
    return q, k, v


def grams():
    from sparseety.extract.scoring import output_grams

    return [output_grams(torch.as_tensor(W_O[layer]), HEADS, KV_HEADS) for layer in range(LAYERS)]


@pytest.mark.parametrize("mode", ["attention", "value", "output"])
def test_chunked_prefill_and_decode_equal_the_loop(tensors, mode):
    q, k, v = tensors
    prompt, outputs = 11, 6  # rows at query positions 10..15; position 16 (the last output) is never fed
    cap = RequestCapture("r", tier=3, mode=mode, prompt_len=prompt, layers=LAYERS,
                         grams=grams() if mode == "output" else None)
    drive(cap, q, k, v, [(0, 4, None), (4, 4, None), (8, 3, None)] + [(p, 1, None) for p in range(11, 16)])
    seen = prompt + outputs - 1
    sums, att, steps = summed_rows(cap.result(), seen)
    want = reference(q, k, v, range(prompt - 1, seen), mode)[:, :seen]
    np.testing.assert_allclose(sums, want, rtol=1e-5, atol=1e-7)
    if mode != "attention":
        np.testing.assert_allclose(att, reference(q, k, v, range(prompt - 1, seen), "attention")[:, :seen],
                                   rtol=1e-5, atol=1e-7)
    assert [s for s, _ in steps] == list(range(prompt - 1, seen))
    np.testing.assert_allclose(steps[0][1], reference(q, k, v, [prompt - 1], mode)[:, :prompt], rtol=2e-3, atol=1e-4)


def test_rejected_drafts_are_replaced_and_late_rows_dropped(tensors):
    """A verify step feeds drafts at 12..14 with wrong keys; the next step re-feeds from 13 (one accepted):
    the rows of the rejected inputs are replaced, and a pending row past the last fed token is dropped."""
    q, k, v = tensors
    prompt = 11
    cap2 = RequestCapture("r", tier=2, mode="value", prompt_len=prompt, layers=LAYERS)
    bad = k.copy()
    bad[:, :, 13:15] += 5.0
    drive(cap2, q, k, v, [(0, 11, None), (11, 4, bad), (13, 3, None)])  # rows 10..15; 13..15 re-fed right
    outputs = 6  # tokens 11..16 -> rows 10..15
    seen = prompt + outputs - 1
    sums, _, _ = summed_rows(cap2.result(), seen)
    np.testing.assert_allclose(sums, reference(q, k, v, range(prompt - 1, seen), "value")[:, :seen], rtol=1e-5,
                               atol=1e-7)
    fewer, _, _ = summed_rows(cap2.result(), seen - 1)  # one token fewer: the newest pending row is left out
    np.testing.assert_allclose(fewer, reference(q, k, v, range(prompt - 1, seen - 1), "value")[:, : seen - 1],
                               rtol=1e-5, atol=1e-7)


def test_positions_never_computed_are_unscored_and_masked(tensors):
    """A prefix-cache hit: positions 0..7 never pass through this request's forward."""
    q, k, v = tensors
    prompt, outputs = 11, 4
    cap = RequestCapture("r", tier=2, mode="value", prompt_len=prompt, layers=LAYERS)
    drive(cap, q, k, v, [(8, 3, None)] + [(p, 1, None) for p in range(11, 14)])
    result = cap.result()
    assert result.unscored == tuple(range(8))
    seen = prompt + outputs - 1
    sums, _, _ = summed_rows(result, seen)
    visible = np.arange(seen) >= 8
    np.testing.assert_allclose(sums, reference(q, k, v, range(prompt - 1, seen), "value", visible)[:, :seen],
                               rtol=1e-5, atol=1e-7)
    assert not sums[:, :8].any()


def test_recompute_after_preemption_gives_the_same_sums(tensors):
    """Preempted after 3 outputs, then recomputed from position 0 in two chunks: the same sums (the
    newest row, still pending at the preemption, is scored again; folded rows are not)."""
    q, k, v = tensors
    prompt, outputs = 11, 6
    cap = RequestCapture("r", tier=2, mode="attention", prompt_len=prompt, layers=LAYERS)
    drive(cap, q, k, v, [(0, 11, None), (11, 1, None), (12, 1, None)]  # outputs 11, 12, 13 produced
          + [(0, 8, None), (8, 6, None)]  # recompute 0..13 (the last output, 13, fed for the first time)
          + [(14, 1, None), (15, 1, None)])
    seen = prompt + outputs - 1
    sums, _, _ = summed_rows(cap.result(), seen)
    np.testing.assert_allclose(sums, reference(q, k, v, range(prompt - 1, seen), "attention")[:, :seen],
                               rtol=1e-5, atol=1e-7)
    assert cap.rows == outputs + 1


def test_ids_and_channel():
    assert external_id("cmpl-1234-0-a1b2c3d4") == "cmpl-1234-0"
    assert external_id("plain") == "plain"
    assert importance_channel("ipc:///tmp/x.sock") == "ipc:///tmp/x-importance.sock"
    assert importance_channel("ipc:///tmp/x") == "ipc:///tmp/x-importance"
    assert client_channel(0, "ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"
    assert client_channel(2, "ipc:///tmp/x.sock") == "ipc:///tmp/x-c2.sock"


@pytest.mark.parametrize("mode", ["attention", "value"])
def test_shared_blocks_complete_a_prefix_cache_hit(tensors, mode):
    """Request A computes positions 0..10; B (same first 8 tokens, block size 4) is served 0..7 from the
    prefix cache: the two full blocks A saved give B every key, so B's sums equal the full computation."""
    from sparseety.integrations.vllm.observe.attention_capture import SharedBlocks

    q, k, v = tensors
    prompt, outputs, block = 11, 4, 4
    tokens_a = list(range(100, 111))
    tokens_b = tokens_a[:8] + [7, 8, 9]
    shared = SharedBlocks(limit=8)
    a = RequestCapture("a", tier=2, mode=mode, prompt_len=prompt, layers=LAYERS)
    drive(a, q, k, v, [(0, 11, None)])
    shared.save(a, tokens_a, block)
    assert len(shared.blocks) == 2 and a.saved_blocks == 2  # the third block (8..11) is not full
    b = RequestCapture("b", tier=2, mode=mode, prompt_len=prompt, layers=LAYERS)
    b.begin(8, 3)
    shared.fill(b, tokens_b, block, 8)
    assert b.shared == 8
    rows = list(range(10, 11))
    for layer in range(LAYERS):  # the first forward of B (begin already called above)
        b.write(layer, 8, torch.as_tensor(k[layer, :, 8:11].swapaxes(0, 1)), torch.as_tensor(v[layer, :, 8:11].swapaxes(0, 1)))
        b.score(layer, 8, torch.as_tensor(q[layer, 8:11]), rows, SCALE)
    drive(b, q, k, v, [(p, 1, None) for p in range(11, 14)])
    result = b.result()
    assert result.unscored == () and result.shared == 8
    seen = prompt + outputs - 1
    sums, _, _ = summed_rows(result, seen)
    np.testing.assert_allclose(sums, reference(q, k, v, range(prompt - 1, seen), mode)[:, :seen], rtol=1e-5, atol=1e-7)
    # a different first block: nothing shared, the cached positions unscored
    c = RequestCapture("c", tier=2, mode=mode, prompt_len=prompt, layers=LAYERS)
    c.begin(8, 3)
    shared.fill(c, [1] + tokens_b[1:], block, 8)
    assert c.shared == 0


def test_importance_setting():
    from sparseety.integrations.vllm.observe.attention_capture import parse_mode

    assert parse_mode({}) == ("value", None)
    assert parse_mode({"SPARSEETY_IMPORTANCE": " Attention "}) == ("attention", None)
    assert parse_mode({"SPARSEETY_IMPORTANCE": "off"}) == (None, None)
    assert parse_mode({"SPARSEETY_IMPORTANCE": "output"}) == ("output", None)
    mode, problem = parse_mode({"SPARSEETY_IMPORTANCE": "learned"})
    assert mode is None and problem == ("sparseety: SPARSEETY_IMPORTANCE='learned' is not one of value, attention, "
                                        "output, off; important tokens of vLLM requests are off")


@pytest.mark.parametrize(("raw", "seconds", "warned"), [("", 5.0, False), (" 60 ", 60.0, False), ("0.5", 0.5, False),
                                                        ("abc", 5.0, True), ("-1", 5.0, True), ("inf", 5.0, True)])
def test_importance_wait_setting(monkeypatch, caplog, raw, seconds, warned):
    from sparseety.integrations.vllm.observe import importance

    monkeypatch.setenv("SPARSEETY_IMPORTANCE_WAIT_S", raw)
    importance.wait_s.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="sparseety.vllm"):
            assert importance.wait_s() == seconds
    finally:
        importance.wait_s.cache_clear()
    assert (f"SPARSEETY_IMPORTANCE_WAIT_S={raw!r} is not a positive number of seconds" in caplog.text) == warned
