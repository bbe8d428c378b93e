"""In the API server: receive the worker's captured attention rows and turn them into important tokens.

:mod:`.attention_capture` (in vLLM's worker) sends a :class:`.wire_messages.CaptureStart` at a sampled request's
first forward and its :class:`.wire_messages.ImportanceResult` when vLLM removes it, over its own bounded channel
(next to the scheduler channel). :class:`ImportanceInbox` receives them (:class:`..transport.wire.WireInbox`) and
keeps the results (bounded: the oldest are dropped and counted). The observer's worker thread waits for a started request's result at most
:func:`wait_s` after the frontend saw it finish, then calls :func:`attach`.

:func:`attach` turns a result into what an own-engine trace holds, through the same code: the rows of
query positions ``prompt_len - 1 .. prompt_len + outputs - 2`` (the prompt's last row and each decode
step's, the rows that produced the output tokens) summed per layer (``importance`` ``[layers, seen]``,
float16 in the store), sinks by :func:`sparseety.extract.scoring.find_sinks` (``value`` mode), the
rankings by :func:`sparseety.engine.importance.important_tokens` (all layers, then each layer; the
tokenizer's special ids and the sinks left out), and at tier 3 ``step_importance``
``[steps, layers, positions]``. Positions whose keys the request never computed (read from vLLM's prefix
cache) and that no earlier sampled request computed either (:class:`.attention_capture.SharedBlocks`;
those are counted in ``shared_positions``) are ``unscored``: stored as ``unscored.position`` and
``unscored`` token events, counted in ``extra_json.vllm.importance.unscored_positions``, and left out of
the rankings; the rows then attended over the positions the request held (the softmax renormalized
over them).

torch, and :mod:`sparseety.engine` (transformers), are imported on the first sampled request only.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.transport.channels import importance_channel
from sparseety.integrations.vllm.transport.wire import WireInbox
from sparseety.integrations.vllm.transport.values import decimal_number, shown
from sparseety.integrations.vllm.vllm_api.wire_messages import CaptureStart, ImportanceResult

log = logging.getLogger("sparseety.vllm")
WAIT_ENV = "SPARSEETY_IMPORTANCE_WAIT_S"
WAIT_S = 5.0  #: default of :func:`wait_s`
TOP_K = 16  #: records per ranking (SparSEEty's own default)


@functools.cache
def wait_s() -> float:
    """Seconds a finished request that the worker captured waits for its result before it is recorded
    without it (``importance.status`` ``lost``): ``SPARSEETY_IMPORTANCE_WAIT_S``, default 5. Raise it where
    engine cores run behind (several DP ranks or API servers on few cores); a bad value warns once."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return WAIT_S
    try:
        value = decimal_number(raw, WAIT_ENV, 0.0, 86_400.0)
    except ConfigError:
        value = 0.0
    if value <= 0:
        log.warning("sparseety: %s=%s is not a positive number of seconds; %.0f s", WAIT_ENV, shown(raw), WAIT_S)
        return WAIT_S
    return value


class ImportanceInbox:
    """The importance channel's inbox: started requests and their results, bounded (the oldest go, counted)."""

    def __init__(self, channel: str, limit: int = 4096, *, start: bool = True) -> None:
        self.endpoint = importance_channel(channel)
        self.limit = limit
        self.started: OrderedDict[str, float] = OrderedDict()
        self.results: OrderedDict[str, ImportanceResult] = OrderedDict()
        self.dropped = 0  #: results dropped because too many waited
        self._lock = threading.Lock()
        self.inbox = WireInbox(self.endpoint, {CaptureStart: self.on_start, ImportanceResult: self.on_result},
                               name="importance", hwm=1000, start=start)

    def on_start(self, messages: list[CaptureStart]) -> None:
        for m in messages:
            self._put(self.started, m.req_id, time.monotonic())

    def on_result(self, messages: list[ImportanceResult]) -> None:
        for m in messages:
            self._put(self.results, m.req_id, m)

    def waiting(self, internal_id: str) -> bool:
        """True when the worker started capturing ``internal_id`` and its result has not come yet."""
        with self._lock:
            return internal_id in self.started and internal_id not in self.results

    def has_result(self, internal_id: str) -> bool:
        """True when the worker's result for ``internal_id`` has come."""
        with self._lock:
            return internal_id in self.results

    def take(self, internal_id: str) -> tuple[bool, ImportanceResult | None]:
        """``(started, result)`` for ``internal_id``, forgetting both."""
        with self._lock:
            return self.started.pop(internal_id, None) is not None, self.results.pop(internal_id, None)

    def _put(self, table: OrderedDict, key: str, value: Any) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self.limit:
                table.popitem(last=False)
                self.dropped += 1

    def close(self) -> None:
        self.inbox.close()


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_for(path: str | None) -> Any:
    """The served model's tokenizer (cached), or None when it cannot load (rankings then keep special ids)."""
    if not path:
        return None
    try:
        return _tokenizer(path)
    except Exception as e:
        log.warning("sparseety: cannot load the tokenizer at %r for important tokens (%s: %s)", path,
                    type(e).__name__, e)
        return None


def summed_rows(result: ImportanceResult, seen: int) -> tuple[np.ndarray, np.ndarray | None, list[tuple[int, np.ndarray]]]:
    """The result's per-layer sums over the rows of query positions below ``seen`` (``[layers, seen]``
    float32, score and plain attention), and its per-step score vectors ``(q, [layers, q + 1])``."""
    layers, width = result.layers, result.width

    def mat(raw: bytes, cols: int) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.float32).reshape(layers, cols)

    sums = np.zeros((layers, seen), dtype=np.float32)
    att = np.zeros((layers, seen), dtype=np.float32) if result.attention is not None else None
    k = min(width, seen)
    sums[:, :k] = mat(result.sums, width)[:, :k]
    if att is not None and result.attention is not None:
        att[:, :k] = mat(result.attention, width)[:, :k]
    steps = [(s.q, np.frombuffer(s.row, dtype=np.float16).reshape(layers, s.q + 1).astype(np.float32))
             for s in result.steps if s.q < seen]
    for pending in result.pending:
        q, score, plain = pending.q, pending.scores, pending.plain
        if q >= seen:  # a drafted position that was rejected, or past the last token fed back
            continue
        row = mat(score, q + 1)
        sums[:, : q + 1] += row
        if att is not None and plain is not None:
            att[:, : q + 1] += mat(plain, q + 1)
        if result.tier >= 3:
            steps.append((q, row.astype(np.float16).astype(np.float32)))
    steps.sort(key=lambda item: item[0])
    return sums, att, steps


def attach(run: Any, result: ImportanceResult | None, *, started: bool, tokenizer_path: str | None,
           decode: bool = True) -> dict[str, Any]:
    """Put the important tokens of ``result`` into ``run`` (a :class:`~.record.VllmRun`); returns the
    ``importance`` section of the record's ``vllm`` info (``status``: ``recorded``, ``lost`` when the
    worker started but its result never came, ``not_sampled`` otherwise)."""
    if result is None:
        return {"status": "lost" if started else "not_sampled"}
    import torch

    from sparseety.engine.importance import important_tokens
    from sparseety.extract.scoring import find_sinks
    from sparseety.integrations.vllm.transport.record import EventGroup

    prompt_len, n_out = len(run.prompt_ids), len(run.output_ids)
    seen = prompt_len + max(n_out, 1) - 1
    token_ids = np.asarray(run.prompt_ids + run.output_ids, dtype=np.int64)[:seen]
    sums, att, steps = summed_rows(result, seen)
    mode = result.mode
    unscored = [p for p in result.unscored if p < seen]
    tokenizer = tokenizer_for(tokenizer_path)
    special = tuple(getattr(tokenizer, "all_special_ids", ()) or ()) if tokenizer is not None else ()
    sinks: list[int] = []
    importance = torch.from_numpy(sums)
    if att is not None:
        sinks = find_sinks(torch.from_numpy(att), importance)
        run.arrays["sink.position"] = np.asarray(sinks, dtype=np.int64)
    text = None
    if decode and tokenizer is not None:
        text = functools.partial(_decode, tokenizer)
    run.important_tokens = important_tokens(token_ids, importance, prompt_len, TOP_K, text, special,
                                            sinks=sorted(set(sinks) | set(unscored)))
    run.arrays["importance"] = sums.astype(np.float16)
    if unscored:
        run.arrays["unscored.position"] = np.asarray(unscored, dtype=np.int64)
        group = EventGroup()
        for p in unscored:
            group.add(0, -1, p, int(token_ids[p]))
        run.arrays.update(group.arrays("unscored"))
    tier = max(int(run.tier), result.tier)
    if tier >= 3 and steps:
        stacked = np.full((len(steps), sums.shape[0], seen), np.nan, dtype=np.float16)
        for i, (q, row) in enumerate(steps):
            stacked[i, :, : q + 1] = row
        run.arrays["step_importance"] = stacked
    run.tier = tier
    rows = len(result.folded) + sum(1 for p in result.pending if p.q < seen)
    layers = result.layers
    run.provenance["extraction"] = {
        "score_type": "attention", "top_k": TOP_K, "normalize": "max", "min_score": 0.0,
        "exclude_special": bool(special), "layers": "all", "recorded_layers": list(range(layers)),
        **({"importance": mode} if mode != "attention" else {}),
        "signal": (f"{mode}-weighted attention" if mode != "attention" else "attention")
        + " received while generating, captured inside vLLM (newest query row per layer and step)",
        "unscored": "left out; rows renormalized over the positions the request computed" if unscored else None,
    }
    # fewer rows than outputs: forwards the wrapper never saw (e.g. attention inside a full CUDA graph)
    return {"status": "recorded" if rows == n_out else "partial", "mode": mode, "rows": rows, "expected_rows": n_out,
            "layers": layers, "sinks": sinks, "unscored_positions": len(unscored),
            "shared_positions": result.shared,
            "tier": tier}


def _decode(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])
