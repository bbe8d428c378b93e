"""Inside vLLM's worker: the attention the newest query rows of *sampled* requests give every position.

vLLM never materializes attention weights, and its KV-cache layout depends on the backend and the
instruction set, so this module keeps its own copy of what it needs, for sampled requests only:

- the ``importance-rows`` hook (:mod:`.worker_hooks`) wraps the model runner's ``_model_forward`` (the call that runs one
  forward of the batch, inside vLLM's forward context). It reads which rows belong to which request
  (``input_batch.req_ids``, ``query_start_loc``) and where they stand (``positions``), and plans the
  step: for each sampled request, its rows and the query positions to score. A batch without sampled
  requests costs one dictionary look-up per request.
- the ``importance-attention`` hook wraps ``forward`` of the attention-backend implementation class the
  platform chose (found on the model's own attention layers at the first forward; ``CPUAttentionBackendImpl``
  on CPU, FlashAttention or another on CUDA: whichever it is). ``forward(layer, query [T, heads, d], key
  [T, kv_heads, d], value, kv_cache, attn_metadata, ...)`` receives the post-RoPE keys and values vLLM
  writes into its cache (the very tensors ``do_kv_cache_update`` gets), so the keys and value norms of a
  sampled request's new rows are copied here, by position, and never read back from ``kv_cache``. Then,
  for each query row to score, the probabilities ``softmax(q·Kᵀ · scale)`` over that request's held keys
  (:func:`sparseety.extract.scoring.row_probs`, the function SparSEEty's own hook point uses), one row per
  layer and step, never a matrix, scored by :func:`~sparseety.extract.scoring.score_row` (modes
  ``attention``, ``value`` and ``output``, norms by ``slot_norms`` once at write) exactly as the own engine's run context does: averaged over the query heads.
- the ``importance-finish`` hook wraps ``_on_request_state_removed`` (vLLM's hook for a finished or
  aborted request) and sends the request's result to the observer.

Which rows: the prompt's last row and each decode step's row, as the own engine records them: every
query position ``q >= prompt_len - 1``, once. A position's row is *final* once a later forward of the
request starts at a position above it (the first token a forward feeds is always a confirmed one); it is
then folded into per-layer sums. Rows that may still be replaced (the newest one, and rows of drafted
tokens under speculative decoding, which a rejection re-feeds) stay *pending*, one ``[layers, q + 1]``
vector each, and travel with the result: the observer keeps those below ``prompt_len + outputs - 1``. A
preempted request recomputed later re-scores no folded row. Positions whose keys this request never wrote
(a prefix-cache hit) are taken from :class:`SharedBlocks`, the keys of full prompt blocks earlier sampled
requests computed, by the hash of the tokens up to the block's end; what is not there cannot be scored:
its rows attend over the keys it holds (the softmax renormalized over them) and the positions are sent as
``unscored``, stored and counted by the observer.

Why one message per request, at finish, rather than one per step: a step's rows are a few kB per layer;
sent per step they would cost a ZMQ message per sampled request and forward, and a dropped message would
silently bias a sum. Accumulated here, a request costs ``2 x layers x positions`` floats (plus, at tier 3,
one float16 vector per layer and step) and one message; if the bounded channel is full that message is
dropped whole and counted (``dropped``), and the observer, told at the request's first forward that
importance is coming, records it as lost instead of waiting forever.

Settings (read in the worker): the observer's ``SPARSEETY_TRACE_DIR`` / ``SPARSEETY_SAMPLE_RATE`` /
``SPARSEETY_TIER`` (:func:`.settings.parse_settings`: sampled requests at tier >= 2, by the same request-id
hash as the store), ``SPARSEETY_IMPORTANCE`` (``value``, the default, ``attention`` or ``output``; ``off`` turns the
capture off). Per request, ``vllm_xargs`` ``{"sparseety_tier": 3}`` traces it at tier 3 whatever the
sampling, and ``{"sparseety_importance": "attention"}`` picks its mode (``"off"``: none for this request).

This module holds the capture's own state and math (:class:`RequestCapture`, :class:`SharedBlocks`), on
torch tensors only; :mod:`.worker_hooks` holds the hooks and the worker's state (:class:`.worker_hooks.WorkerCapture`),
and reads vLLM's objects through :mod:`.adapter`. This module imports neither vLLM nor torch at import time
(torch is imported in the worker, on first use).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from sparseety.integrations.vllm.vllm_api.wire_messages import ImportanceResult, PendingRow, StepRow

log = logging.getLogger("sparseety.vllm")
TIER_ARG = "sparseety_tier"
MODE_ARG = "sparseety_importance"
MODES = ("value", "attention", "output")  #: ``learned`` (per-head weights) is not captured inside vLLM yet
IMPORTANCE_ENV = "SPARSEETY_IMPORTANCE"


def parse_mode(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """``(mode, problem)``: the ``SPARSEETY_IMPORTANCE`` mode (None: capture off) and why it is bad, if it is."""
    env = os.environ if env is None else env
    raw = env.get(IMPORTANCE_ENV)
    if raw is None or raw.strip() == "":
        return MODES[0], None
    value = raw.strip().lower()
    if value == "off":
        return None, None
    if value in MODES:
        return value, None
    return None, (f"sparseety: {IMPORTANCE_ENV}={raw!r} is not one of {', '.join((*MODES, 'off'))}; "
                  "important tokens of vLLM requests are off")


# -- one sampled request ---------------------------------------------------------------------------------
class RequestCapture:
    """A sampled request's held keys, value norms, folded sums and pending rows (torch tensors, float32).

    Shapes: ``keys[l]`` ``[kv_heads, capacity, d]``, ``norms[l]`` ``[kv_heads, capacity, 1]`` (``value``),
    ``written`` ``[capacity]`` bool, ``sums`` / ``attention`` ``[layers, capacity]``, a pending row
    ``[layers, q + 1]``.
    """

    def __init__(self, req_id: str, *, tier: int, mode: str, prompt_len: int, layers: int,
                 grams: list[Any] | None = None) -> None:
        import torch

        if mode == "output" and (grams is None or len(grams) != layers):
            raise ValueError("importance 'output' needs each layer's output-projection Gram matrices")
        self.torch = torch
        self.grams = grams  #: ``output``: per layer ``[kv_heads, g, d, d]`` (:func:`~sparseety.extract.scoring.output_grams`)
        self.req_id = req_id
        self.tier = tier
        self.mode = mode
        self.prompt_len = prompt_len
        self.layers = layers
        self.keys: list[Any] = [None] * layers
        self.norms: list[Any] = [None] * layers
        self.written = torch.zeros(0, dtype=torch.bool)
        self.sums = torch.zeros(layers, 0)
        self.attention = torch.zeros(layers, 0) if mode != "attention" else None
        self.folded: set[int] = set()
        self.pending: dict[int, tuple[Any, Any]] = {}
        self.steps: dict[int, Any] = {}  #: tier 3: q -> float16 ``[layers, q + 1]``
        self.unscored: set[int] = set()
        self.rows = 0  #: rows scored (per layer)
        self.shared = 0  #: positions whose keys came from another sampled request (:class:`SharedBlocks`)
        self.saved_blocks = 0  #: prompt blocks offered to :class:`SharedBlocks`
        self.started = False

    def _grow(self, end: int) -> None:
        torch = self.torch
        cap = self.written.shape[0]
        if end <= cap:
            return
        new = max(end, 2 * cap, 64)
        self.written = torch.cat([self.written, torch.zeros(new - cap, dtype=torch.bool)])
        self.sums = torch.nn.functional.pad(self.sums, (0, new - cap))
        if self.attention is not None:
            self.attention = torch.nn.functional.pad(self.attention, (0, new - cap))

    def begin(self, p0: int, n: int) -> list[int]:
        """A forward feeds positions ``[p0, p0 + n)``: fold the rows it confirms, drop the rows it
        re-feeds, and return the query positions to score now."""
        for q in sorted(self.pending):
            score, att = self.pending.pop(q)
            if q < p0:
                self._fold(q, score, att)
        self._grow(p0 + n)
        return [q for q in range(max(p0, self.prompt_len - 1), p0 + n) if q not in self.folded]

    def _fold(self, q: int, score: Any, att: Any) -> None:
        self.sums[:, : q + 1] += score
        if self.attention is not None:
            self.attention[:, : q + 1] += att
        if self.tier >= 3:
            self.steps[q] = score.half()
        self.folded.add(q)

    def write(self, layer: int, p0: int, key: Any, value: Any, norms: Any = None) -> None:
        """Hold the post-RoPE ``key`` ``[n, kv_heads, d]`` (and the norms of ``value``, or ``norms``
        ``[kv_heads, n, 1 or g]``) at positions ``p0..``."""
        from sparseety.extract.scoring import slot_norms

        torch = self.torch
        n = key.shape[0]
        cap = self.written.shape[0]
        held = self.keys[layer]
        if held is None or held.shape[1] < cap:
            grown = torch.zeros(key.shape[1], cap, key.shape[2], dtype=torch.float32, device=key.device)
            if held is not None:
                grown[:, : held.shape[1]] = held
            self.keys[layer] = held = grown
            if self.attention is not None:
                width = self.grams[layer].shape[1] if self.mode == "output" else 1
                grown_norms = torch.zeros(key.shape[1], cap, width, dtype=torch.float32, device=key.device)
                if self.norms[layer] is not None:
                    grown_norms[:, : self.norms[layer].shape[1]] = self.norms[layer]
                self.norms[layer] = grown_norms
        held[:, p0 : p0 + n] = key.transpose(0, 1).float()
        if self.attention is not None:
            self.norms[layer][:, p0 : p0 + n] = norms if norms is not None else slot_norms(
                value.transpose(0, 1), self.mode, None if self.grams is None else self.grams[layer])
        self.written[p0 : p0 + n] = True

    def norms_width(self) -> int:
        """The last axis of the held norms: ``g`` for ``output``, else 1."""
        return int(self.grams[0].shape[1]) if self.mode == "output" and self.grams else 1

    def held(self, layer: int, start: int, end: int) -> tuple[Any, Any]:
        """Copies of layer ``layer``'s keys ``[kv_heads, end - start, d]`` and norms (None: ``attention``)."""
        norms = self.norms[layer]
        return (self.keys[layer][:, start:end].clone(),
                None if norms is None else norms[:, start:end].clone())

    def fill(self, layer: int, start: int, keys: Any, norms: Any) -> None:
        """Hold keys ``[kv_heads, n, d]`` (and norms) another sampled request computed at ``start..``."""
        self.write(layer, start, keys.transpose(0, 1), None, norms=norms)

    def score(self, layer: int, p0: int, queries: Any, rows: list[int], scale: float,
              window: int | None = None) -> None:
        """Score query positions ``rows`` (ascending, within ``[p0, p0 + len(queries))``) of layer ``layer``:
        ``queries`` ``[n, heads, d]`` are the forward's rows of this request. A sliding layer of ``window``
        ``w`` lets the row at ``q`` see keys ``q - w + 1 .. q`` only (vLLM's kernels and the own engine)."""
        from sparseety.extract.scoring import row_probs, score_row

        torch = self.torch
        first, last = rows[0], rows[-1]
        n = last + 1
        keys = self.keys[layer][:, :n].unsqueeze(0)  # [1, kvh, n, d]
        kvh = keys.shape[1]
        q_rows = queries[first - p0 : last - p0 + 1].transpose(0, 1).unsqueeze(0)  # [1, heads, r, d]
        r = q_rows.shape[2]
        hidden = (~self.written[:n]).view(1, n).expand(r, n)  # [r, n]
        if window is not None:  # keys below each row's window edge: masked as vLLM's kernel masks them
            edges = torch.arange(first, last + 1).view(r, 1) - window + 1
            outside = torch.arange(n).view(1, n) < edges
            hidden = hidden & ~outside
            hidden_all = hidden | outside
        else:
            hidden_all = hidden
        if bool(hidden.any()):  # keys a row should see that this request never wrote
            self.unscored.update(hidden.any(dim=0).nonzero().flatten().tolist())
        if bool(hidden_all.any()):
            hidden = hidden_all.to(keys.device).view(1, 1, r, n)
        else:
            hidden = None
        probs = row_probs(q_rows, keys, scale, hidden)[0].transpose(0, 1)  # [r, heads, n]
        norms = None if self.attention is None else self.norms[layer][:, :n]
        scored = score_row(probs, norms, kvh).sum(dim=-2).div_(kvh).cpu()  # [r, n], as the run context adds it
        att = score_row(probs, None, kvh).sum(dim=-2).div_(kvh).cpu() if norms is not None else None
        wanted = set(rows)
        for i, q in enumerate(range(first, last + 1)):
            if q not in wanted:
                continue
            row = self.pending.get(q)
            if row is None or row[0].shape[1] != q + 1:
                row = self.pending[q] = (torch.zeros(self.layers, q + 1),
                                         torch.zeros(self.layers, q + 1) if att is not None else None)
            row[0][layer] = scored[i, : q + 1]
            if att is not None:
                row[1][layer] = att[i, : q + 1]
            if layer == 0:
                self.rows += 1

    def result(self) -> ImportanceResult:
        """The message for the observer (numpy bytes; see :func:`.importance.summed_rows`)."""
        n = max([self.written.shape[0], *[q + 1 for q in self.pending]])
        width = max([q + 1 for q in (*self.folded, *self.pending)], default=0)
        n = min(n, width) if width else 0

        def raw(t: Any) -> bytes:
            return t.contiguous().float().numpy().tobytes()

        return ImportanceResult(
            req_id=self.req_id, tier=self.tier, mode=self.mode, prompt_len=self.prompt_len, layers=self.layers,
            width=n, sums=raw(self.sums[:, :n]),
            attention=raw(self.attention[:, :n]) if self.attention is not None else None,
            folded=tuple(sorted(self.folded)),
            pending=tuple(PendingRow(q, raw(s), raw(a) if a is not None else None)
                          for q, (s, a) in sorted(self.pending.items())),
            steps=tuple(StepRow(q, self.steps[q].numpy().tobytes()) for q in sorted(self.steps)),
            unscored=tuple(sorted(self.unscored)), shared=int(self.shared))


# -- the worker's state ----------------------------------------------------------------------------------
class SharedBlocks:
    """Keys of full prompt blocks that sampled requests computed, by the hash of the tokens up to the
    block's end (the same prefix means the same post-RoPE keys), so a sampled request whose prompt vLLM
    partly served from its prefix cache still scores every position when a sampled request computed them
    before (or alongside) it. Bounded (least recently used out): ``limit`` blocks of ``layers x kv_heads x
    block_size x d`` float32 keys each."""

    def __init__(self, limit: int = 64) -> None:
        from collections import OrderedDict

        self.limit = limit
        self.blocks: OrderedDict[bytes, list[tuple[Any, Any]]] = OrderedDict()

    @staticmethod
    def hashes(token_ids: list[int], block_size: int, count: int) -> list[bytes]:
        import hashlib

        out, parent = [], b""
        for i in range(count):
            block = token_ids[i * block_size : (i + 1) * block_size]
            parent = hashlib.sha256(parent + b"|" + ",".join(map(str, block)).encode()).digest()
            out.append(parent)
        return out

    def save(self, capture: RequestCapture, token_ids: list[int], block_size: int) -> None:
        """Offer ``capture``'s full prompt blocks it now holds completely."""
        if self.limit <= 0 or not block_size:
            return
        full = min(capture.prompt_len, int(capture.written.shape[0])) // block_size
        if full <= capture.saved_blocks:
            return
        hashes = self.hashes(token_ids, block_size, full)
        for i in range(capture.saved_blocks, full):
            start, end = i * block_size, (i + 1) * block_size
            if not bool(capture.written[start:end].all()):
                break
            if hashes[i] not in self.blocks:
                self.blocks[hashes[i]] = [capture.held(layer, start, end) for layer in range(capture.layers)]
            self.blocks.move_to_end(hashes[i])
            capture.saved_blocks = i + 1
        while len(self.blocks) > self.limit:
            self.blocks.popitem(last=False)

    def fill(self, capture: RequestCapture, token_ids: list[int], block_size: int, upto: int) -> None:
        """Hold, for ``capture``, the keys of its positions below ``upto`` that a saved block has."""
        if not block_size:
            return
        count = min(upto + block_size - 1, len(token_ids)) // block_size
        for i, h in enumerate(self.hashes(token_ids, block_size, count)):
            layers = self.blocks.get(h)
            if layers is None:
                break
            start, end = i * block_size, min((i + 1) * block_size, upto)
            if end <= start:
                break
            if capture.attention is not None and (layers[0][1] is None or layers[0][1].shape[-1] != (
                    capture.norms_width())):
                break  # saved by a request of another mode: not these norms
            for layer, (keys, norms) in enumerate(layers):
                capture.fill(layer, start, keys[:, : end - start], None if norms is None else norms[:, : end - start])
            self.blocks.move_to_end(h)
            capture.shared += end - start
