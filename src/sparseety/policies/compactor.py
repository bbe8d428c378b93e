"""``compactor``: Compactor (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores", arXiv:2507.08143; kvpress's ``CompactorPress``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparseety.errors import ConfigError
from sparseety.policies.base import Observation, Policy, check_positive_int, protect, recent_mask
from sparseety.policies.expected_attention import ALL_ROWS
from sparseety.policies.parts.rotary import unrotate


def _znorm(x: torch.Tensor) -> torch.Tensor:
    """z-score over every head and slot of each batch row (kvpress normalises the whole tensor; b == 1 there)."""
    flat = x.reshape(x.shape[0], -1)
    mean = flat.mean(dim=-1).view(-1, 1, 1)
    std = (flat.std(dim=-1) if flat.shape[-1] > 1 else torch.zeros(flat.shape[0])).clamp_min(1e-6).view(-1, 1, 1)
    return (x - mean) / std


def sketch(b: int, h: int, d: int, k: int, seed: int, layer: int) -> torch.Tensor:
    """``[b, h, d, k]`` Gaussian right sketch ``N(0, 1/k)`` of layer ``layer``: the ``layer + 1``-th such draw
    from a generator seeded by ``seed``, so layer ``l`` gets exactly what kvpress's ``CompactorPress``
    draws from the global RNG at layer ``l`` of a prefill after ``torch.manual_seed(seed)`` (one draw
    per layer, in layer order)."""
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    for _ in range(layer):
        torch.randn(b, h, d, k, generator=gen)
    return torch.randn(b, h, d, k, generator=gen) * (1 / math.sqrt(k))


def cholesky_with_jitter(G: torch.Tensor, jitter: float = 1e-2, tries: int = 5) -> torch.Tensor:
    """kvpress's ``chol_with_jitter``: add ``jitter * I``, growing it tenfold until every factorisation succeeds."""
    eye = torch.eye(G.shape[-1], dtype=G.dtype)
    cur = float(jitter)
    for _ in range(tries):
        L, info = torch.linalg.cholesky_ex(G + cur * eye, upper=False)
        if bool((info == 0).all()):
            return L
        cur = max(1e-8, 1e-2 if cur == 0.0 else 10.0 * cur)
    # never fails the run: a degenerate sketch (constant keys) gets a large ridge instead
    return torch.linalg.cholesky(G + (cur + float(G.diagonal(dim1=-2, dim2=-1).abs().max()) + 1.0) * eye)


def leverage_scores(pre_keys: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``[b, h, s]`` approximate leverage ``diag(X (X^T X)^-1 X^T)`` of sequence-centred keys sketched by ``phi``.

    pre_keys ``[b, h, s, d]`` (pre-RoPE), phi ``[b, h, d, k]``; kvpress's ``compute_leverage_scores``.
    """
    X = (pre_keys - pre_keys.mean(dim=-2, keepdim=True)) @ phi  # [b, h, s, k]
    XT = X.transpose(-2, -1)
    G = XT @ X
    L = cholesky_with_jitter(0.5 * (G + G.transpose(-2, -1)))
    inv_xt = torch.cholesky_solve(XT, L, upper=False)
    return (X * inv_xt.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def non_causal_chunked_attention(q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[b, heads, s]`` attention each key gets from the queries of its own ``chunk``-row tile, both ways.

    q ``[b, heads, s, d]``, k ``[b, kv_heads, s, d]`` (post-RoPE; each KV head serves its group's query
    heads, one GEMM per tile without repeating the keys). Exactly kvpress's ``non_causal_chunked_attn``
    (on ``repeat_kv`` keys), padding included: the last tile is zero-padded to ``chunk`` rows, padded
    query rows get logit 0 on real keys and padded key columns ``-1e-9`` (not ``-inf``), and the
    logits are not scaled by ``1/sqrt(d)``.
    """
    b, h, s, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    s_pad = math.ceil(s / chunk) * chunk
    pad = s_pad - s
    if pad > 0:
        q = torch.cat([q, q.new_zeros(b, h, pad, d)], dim=2)
        k = torch.cat([k, k.new_zeros(b, kvh, pad, d)], dim=2)
        last = (s // chunk) * chunk
    else:
        last = ((s - 1) // chunk) * chunk
    invalid = torch.arange(last, s_pad) >= s  # [chunk] rows / columns of the last tile that are padding
    tiles = s_pad // chunk
    q_tiles = q.view(b, kvh, g, tiles, chunk, d).transpose(2, 3).reshape(b, kvh, tiles, g * chunk, d)
    k_tiles = k.view(b, kvh, tiles, chunk, d)
    dots = (q_tiles @ k_tiles.transpose(-2, -1)).view(b, kvh, tiles, g, chunk, chunk)
    dots[:, :, -1].masked_fill_(invalid.view(chunk, 1), 0)
    dots[:, :, -1].masked_fill_(invalid.view(1, chunk), -1e-9)
    col = torch.softmax(dots.float(), dim=-1).sum(dim=-2)  # [b, kvh, tiles, g, chunk]
    return col.transpose(2, 3).reshape(b, h, s_pad)[..., :s]


def compactor_scores(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor,
                     rotary: torch.Tensor | None, phi: torch.Tensor, chunk: int, blending: float) -> torch.Tensor:
    """``blending * z(leverage) + z(non-causal attention * ||v||, pooled by 3)`` over the scored slots.

    keys, values ``[b, kv_heads, s, d]`` (post-RoPE keys), queries ``[b, heads, s, d]`` (post-RoPE),
    positions ``[b, kv_heads, s]``. Returns ``[b, kv_heads, s]`` float32.
    """
    b, kvh, s, d = keys.shape
    k = keys.float()
    pre_keys = k if rotary is None else unrotate(k, positions, rotary)
    lev = _znorm(leverage_scores(pre_keys, phi))
    g = queries.shape[1] // kvh
    attn = non_causal_chunked_attention(queries.float(), k, chunk)
    attn = attn.view(b, kvh, g, s).mean(dim=2) * values.float().norm(dim=-1)
    attn = F.avg_pool1d(attn, kernel_size=3, padding=1, stride=1)
    return blending * lev + _znorm(attn)


@dataclass
class CompactorPolicy(Policy):
    """Approximate key leverage (random sketch) blended with a non-causal attention estimate; sinks kept.

    At the prefill, on the slots between the first ``sink_size_start`` and the last ``sink_size_end``
    positions (kvpress's ``CompactorPress``): (1) leverage scores of the sequence-centred pre-RoPE keys
    (un-rotated from the cached keys) under a ``[d, sketch_dimension]`` Gaussian right sketch drawn
    from a generator seeded by the run seed, one draw per layer in layer order (:func:`sketch`:
    deterministic, and the very draws kvpress makes from the global RNG after
    ``torch.manual_seed(seed)``), via a jittered Cholesky solve, z-scored; (2) non-causal attention
    inside ``chunk_size``-row tiles (each prompt query attends to every key of its tile, unscaled
    logits as kvpress), averaged
    over the KV group, times ``||v||``, average-pooled (width 3), z-scored; score ``blending * (1) +
    (2)``. ``blending`` None means kvpress's default, the compression ratio: here ``1 - budget / n``
    at the prefill of ``n`` tokens (equal to ``--ratio`` up to rounding). The sinks and the last
    ``sink_size_end`` positions are protected (kvpress pads them with the maximum score).

    Shapes: queries ``[b, heads, n, d]`` (every prompt row, :attr:`Observation.queries`), keys and
    values ``[b, kv_heads, n, d]``, scores ``[b, kv_heads, n]``.

    Decode (kvpress supports prefill only): prompt slots keep their prefill score (``state``; the
    last ``sink_size_end`` prompt slots the maximum, as kvpress pads them); the newest
    ``sink_size_end`` positions stay protected; a decoded slot that has left that window scores 0,
    the z-scored average, so a decode step evicts the lowest prompt slot while any is below average,
    otherwise the newest unprotected decoded slot (ties keep the lower position). One slot per step.
    A chunked prefill carries the query rows across chunks, so its scores equal one prefill's.
    """

    name: ClassVar[str] = "compactor"
    summary: ClassVar[str] = "approximate key leverage blended with non-causal attention, sinks kept (Compactor)"

    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "sink_size_start", self.sink_size_start, minimum=0)
        check_positive_int(self.name, "sink_size_end", self.sink_size_end, minimum=0)
        check_positive_int(self.name, "chunk_size", self.chunk_size)
        check_positive_int(self.name, "sketch_dimension", self.sketch_dimension)
        if isinstance(self.blending, str):  # from --policy-opt (the default None has no type to convert to)
            text = self.blending.strip().lower()
            try:
                self.blending = None if text in {"", "none", "auto"} else float(text)
            except ValueError:
                raise ConfigError(f"{self.name}: blending must be a number >= 0 or none, got {self.blending!r}") from None
        if self.blending is not None and (not isinstance(self.blending, (int, float)) or isinstance(self.blending, bool)
                                          or not math.isfinite(self.blending) or self.blending < 0):
            raise ConfigError(f"{self.name}: blending must be a number >= 0 or none, got {self.blending!r}")

    def query_rows(self) -> int:
        return ALL_ROWS

    def _protected(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions < self.sink_size_start) | recent_mask(positions, self.sink_size_end)

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = obs.positions
        if not obs.prefill:
            state = obs.state if obs.state is not None else torch.zeros(positions.shape)
            return protect(state, self._protected(positions)), state
        assert obs.queries is not None and obs.values is not None, "compactor needs queries and values"
        keys, values, queries = obs.keys, obs.values, obs.queries
        b, kvh, n, d = keys.shape
        w = queries.shape[2]
        if w > n:  # a sliding layer holds only its window: the query rows of the (newest) positions it holds
            queries, w = queries[:, :, w - n:], n
        state = torch.zeros(b, kvh, n) if obs.state is None else obs.state.clone()
        first = n - w  # slots without query rows (none in a plain prefill) keep their state
        left = min(self.sink_size_start, w)
        right = min(self.sink_size_end, max(0, w - left))
        lo, hi = first + left, n - right
        if hi > lo:
            blending = self.blending
            if blending is None:
                blending = max(0.0, 1.0 - (self.budget or n) / n)
            phi = sketch(b, kvh, d, self.sketch_dimension, obs.seed, obs.layer)
            core = compactor_scores(keys[:, :, lo:hi], values[:, :, lo:hi], queries[:, :, left:w - right],
                                    positions[:, :, lo:hi], obs.rotary, phi, self.chunk_size, float(blending))
            state[..., lo:hi] = core
            top = core.amax()
            state[..., first:lo] = top
            state[..., hi:] = top
        return protect(state, self._protected(positions)), state
