"""One vLLM request (or one window of KV-cache events) in the shape the trace store writes.

:class:`VllmRun` carries the attributes :func:`sparseety.store.rows.request_rows` reads from a
``RunResult``, so vLLM traces go through the same writer into the same tables and schema version.
It is its own small class because ``RunResult`` lives in ``sparseety.engine``, whose import needs torch.

Token events a vLLM record holds (``token_events.event``; columns as for every event group:
``step, layer, kv_head, position, token_id, score``; ``layer`` and ``kv_head`` are -1, vLLM shares a
block across all of them):

- ``prefill_chunk``: one row per step that prefilled part of the prompt (``step``: the chunk's index,
  ``position``: its first position, ``token_id``: the token there, ``score``: how many prompt tokens
  it prefilled); a prompt prefilled in one step has one row, a resumed preemption adds rows;
- ``cached``: prompt positions whose prefill vLLM skipped, their KV read from the prefix cache
  (``step`` 0; there are ``num_cached_tokens`` of them);
- ``kv_stored``: prompt positions this request computed whose full block vLLM then kept in the prefix
  cache (``step`` the KV-event sequence number, ``layer`` the block's index in the prompt, ``score`` the
  event's Unix time);
- ``recomputed``: positions whose KV vLLM freed when it preempted the request, to compute again on
  resumption (``step``: output tokens the request had then). vLLM keeps freed full blocks in its prefix
  cache until they are reused, so part of them may be read back rather than recomputed; how many tokens
  resumed requests really prefilled again is ``sparseety:preempted_recomputed_tokens`` (from vLLM's
  prefix-cache stats, which it keeps for all requests together, not per request);
- ``draft_accepted`` / ``draft_rejected``: speculative draft tokens, one row per drafted token (stored
  from the arrays ``drafted.{step,position,token_id,rejected}``, as SparSEEty's own engine stores its
  ``--speculative`` drafts). With the ``drafts`` hook (the engine core's ``Scheduler.update_from_output``)
  each row has the draft's real ``position`` in the request's sequence and its ``token_id``; ``step`` is
  the decode step that verified it (output tokens before that step). Per verify step the accepted drafts
  are a prefix of the step's drafts, and an accepted draft's id is the output token at its position (the
  last verify step's accepted drafts may stand past the output's end: vLLM accepted them, then cut the
  output at ``max_tokens`` or a stop string).
  Without that hook (off, or its messages dropped) the rows come from vLLM's per-request detailed
  spec-decode counts (``step``: the verify step's index), and ``position`` and ``token_id`` are -1.

``kv_cache_bytes_peak`` (and ``kv_cache_bytes_dense``: vLLM evicts nothing from a running request, so the
same figure) is the KV-cache bytes of the blocks the request held when vLLM freed them (the ``kv-blocks``
hook: blocks times page size times layers, per KV-cache group); None ("not reported") without that hook.
``skipped_events`` is None: vLLM skips no attention; prompt tokens served from the prefix cache are
``usage.prompt_tokens_details.cached_tokens`` and the ``cached`` events.

A KV-window record (``policy`` ``vllm-prefix-cache``) holds ``kv_stored`` and ``kv_removed`` events for
every block that entered or left the cache in the window: ``position`` is the token's position in the
prompts that produced the block, ``layer`` the block's index in that chain, ``step`` the event sequence
number. Its ``extra_json`` lists each block's hash and the requests whose prompts used it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparseety.schema import sparsity_json

ENGINE = "vllm"
KV_POLICY = "vllm-prefix-cache"
EVENT_COLUMNS = ("step", "layer", "kv_head", "position", "token_id", "score")


@dataclass
class VllmRun:
    """The attributes of ``RunResult`` the store reads, for a request vLLM served."""

    request_id: str
    model: str
    prompt_ids: list[int]
    output_ids: list[int]
    tier: int
    policy: str = "vllm"
    text: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    evicted_positions: int | None = None
    eviction_events: int | None = None
    skipped_events: int | None = None
    kept_positions_final: dict[str, dict[str, list[int]]] | None = None
    kv_cache_bytes_peak: int | None = None  #: None: vLLM did not report the request's blocks
    kv_cache_bytes_dense: int | None = None
    draft_tokens: int = 0
    draft_rejected: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    important_tokens: list[Any] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    trace_path: str | None = None
    vllm: dict[str, Any] = field(default_factory=dict)  #: what only vLLM has (also in ``extra_json``)

    def to_json(self) -> dict[str, Any]:
        """The ``sparseety run --json`` object's keys, filled from what vLLM reported."""
        n_prompt, n_out = len(self.prompt_ids), len(self.output_ids)
        decode_rate = (n_out - 1) / self.decode_s if n_out > 1 and self.decode_s > 0 else None
        return {
            "request_id": self.request_id,
            "model": self.model,
            "tier": self.tier,
            "text": self.text,
            "output_token_ids": self.output_ids,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": self.vllm.get("num_cached_tokens", 0)},
            },
            "sparsity": sparsity_json(self),
            "extraction": {"layers": "none", "recorded_layers": None},
            "important_tokens": [],
            "timings": {
                "prefill_s": round(self.prefill_s, 6),
                "decode_s": round(self.decode_s, 6),
                "decode_tokens_per_s": decode_rate,
            },
            "trace_path": self.trace_path,
        }


class EventGroup:
    """Accumulates one token-event group (``<kind>.{step,layer,kv_head,position,token_id,score}``)."""

    def __init__(self) -> None:
        self.columns: dict[str, list[float]] = {c: [] for c in EVENT_COLUMNS}

    def add(self, step: int, layer: int, position: int, token_id: int, score: float = 0.0,
            kv_head: int = -1) -> None:
        for name, value in zip(EVENT_COLUMNS, (step, layer, kv_head, position, token_id, score), strict=True):
            self.columns[name].append(value)

    def extend_positions(self, step: int, layer: int, start: int, token_ids: list[int] | tuple[int, ...],
                         score: float = 0.0) -> None:
        """One event per token from position ``start`` on (all at -1 when ``start`` is -1: unknown)."""
        for offset, token in enumerate(token_ids):
            self.add(step, layer, start + offset if start >= 0 else -1, int(token), score)

    def __len__(self) -> int:
        return len(self.columns["step"])

    def arrays(self, kind: str) -> dict[str, np.ndarray]:
        out = {}
        for name, values in self.columns.items():
            dtype = np.float32 if name == "score" else np.int64
            out[f"{kind}.{name}"] = np.asarray(values, dtype=dtype)
        return out


def draft_arrays(per_step_drafted: list[int], per_step_accepted: list[int]) -> dict[str, np.ndarray]:
    """``drafted.{step,position,token_id,rejected}``: per verify step, its accepted drafts then its rejected."""
    step, rejected = [], []
    for index, (drafted, accepted) in enumerate(zip(per_step_drafted, per_step_accepted, strict=True)):
        step += [index] * drafted
        rejected += [0] * accepted + [1] * (drafted - accepted)
    n = len(step)
    return {
        "drafted.step": np.asarray(step, dtype=np.int64),
        "drafted.position": np.full(n, -1, dtype=np.int64),
        "drafted.token_id": np.full(n, -1, dtype=np.int64),
        "drafted.rejected": np.asarray(rejected, dtype=np.int64),
    }


def draft_identity_arrays(steps: list[tuple[int, int, list[int], int]]) -> dict[str, np.ndarray]:
    """``drafted.{step,position,token_id,rejected}`` from verify steps ``(step, first position, draft ids,
    accepted)``: the drafts of one step stand at consecutive positions, the first ``accepted`` accepted."""
    rows = [(step, position + offset, token, int(offset >= accepted))
            for step, position, draft_ids, accepted in steps for offset, token in enumerate(draft_ids)]
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    return {f"drafted.{name}": table[:, i] for i, name in enumerate(("step", "position", "token_id", "rejected"))}


def kept_after(slots: np.ndarray, shape: tuple[int, int], fed: int) -> dict[str, dict[str, list[int]]]:
    """Per layer and KV head (``shape``), the positions ``[0, fed)`` still held once the ``slots`` (rows of step,
    layer, KV head, position, score) were evicted, ascending: the last token was sampled, never fed."""
    held = np.ones((*shape, fed), dtype=bool)
    rows = slots[(slots[:, 3] < fed) & (slots[:, 1] < shape[0]) & (slots[:, 2] < shape[1])].astype(np.int64)
    held[rows[:, 1], rows[:, 2], rows[:, 3]] = False
    return {str(layer): {str(head): np.flatnonzero(held[layer, head]).tolist() for head in range(shape[1])}
            for layer in range(shape[0])}
