"""``expected_attention``: Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution", arXiv:2510.00636; kvpress's ``ExpectedAttentionPress``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import Observation, Policy, check_positive_int, protect
from sparseety.policies.parts.rotary import mean_rotate, mean_rotation, mean_rotation_coefficients, unrotate

ALL_ROWS = 1 << 40  #: :meth:`Policy.query_rows` for "every row of the prompt"


_COEFFICIENTS: dict[tuple[int, int, bytes], tuple[torch.Tensor, torch.Tensor]] = {}


def _coefficients(start: int, count: int, rotary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mean_rotation_coefficients`, memoised (a pure function of its arguments; decode asks for one offset)."""
    key = (start, count, rotary.detach().cpu().numpy().tobytes())
    found = _COEFFICIENTS.get(key)  # one lookup: safe beside another thread's insert or clear
    if found is None:
        if len(_COEFFICIENTS) > 256:
            _COEFFICIENTS.clear()
        found = _COEFFICIENTS[key] = mean_rotation_coefficients(start, count, rotary)
    return found


def query_statistics(queries: torch.Tensor, positions: torch.Tensor, rotary: torch.Tensor | None, n_sink: int,
                     future: int, n_future: int, covariance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean (and covariance) of the pre-RoPE queries, rotated ahead by the average RoPE of the next positions.

    Parameters
    ----------
    queries : ``[b, heads, w, d]`` post-RoPE query rows.
    positions : ``[b, w]`` their token positions (rows at positions ``< n_sink`` are left out, as
        kvpress leaves out the first ``n_sink`` hidden states; if that leaves none, all are used).
    rotary : ``[rotary_dim // 2]`` inverse frequencies (None: no RoPE, nothing rotated).
    future : the first future position (kvpress: the prompt length); ``n_future`` positions averaged.

    Returns
    -------
    mu : ``[b, heads, d]`` and cov : ``[b, heads, d, d]`` (None without ``covariance``), float32.
    """
    b, h, w, d = queries.shape
    pre = queries.float() if rotary is None else unrotate(queries, positions.unsqueeze(1), rotary)
    used = (positions >= n_sink).to(torch.float32)  # [b, w]
    used = torch.where(used.sum(dim=-1, keepdim=True) > 0, used, torch.ones_like(used))
    weight = (used / used.sum(dim=-1, keepdim=True)).view(b, 1, w, 1)
    mu = (pre * weight).sum(dim=2)  # [b, h, d]
    cov = None
    if covariance and w > 1:
        centred = (pre - mu.unsqueeze(2)) * weight.sqrt()
        cov = centred.transpose(-1, -2) @ centred  # [b, h, d, d], divided by the row count (kvpress)
    if rotary is None:
        return mu, cov
    if cov is None:  # R @ mu without forming R (every decode step comes here)
        return mean_rotate(mu, *mean_rotation_coefficients(future, n_future, rotary)), None
    R = mean_rotation(future, n_future, rotary, d).to(mu.device)
    return mu @ R.T, R @ cov @ R.T


def expected_scores(keys: torch.Tensor, values: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor | None,
                    scored: torch.Tensor, use_vnorm: bool, epsilon: float, only_last: int = 0) -> torch.Tensor:
    """``[b, kv_heads, n]`` expected attention of every ``scored`` slot (others: 0), averaged over the KV group.

    ``softmax_n(mu·k / sqrt(d) + k^T cov k / (2d))`` over the scored slots of each query head, the mean
    over the query heads of the KV group, then ``(p + epsilon) * ||v||`` with ``use_vnorm``.
    keys, values : ``[b, kv_heads, n, d]``; mu ``[b, heads, d]``; cov ``[b, heads, d, d]`` or None;
    scored ``[b, kv_heads, n]`` bool. ``only_last > 0``: return only the last ``only_last`` slots'
    scores ``[b, kv_heads, only_last]`` (still normalised over every scored slot; a decode step).
    """
    b, kvh, n, d = keys.shape
    g = mu.shape[1] // kvh
    k = keys.float()
    # one GEMM per KV head: [g, d] @ [d, n] (measured faster on CPU than [n, d] @ [d, g] for g of 1-8)
    logits = (mu.view(b, kvh, g, d) @ k.transpose(-1, -2)).div_(math.sqrt(d))  # [b, kvh, g, n]
    if cov is not None:  # k^T S_g k for every query head g of the group: [n, d] @ [d, g * d]
        kc = (k @ cov.view(b, kvh, g, d, d).permute(0, 1, 3, 2, 4).reshape(b, kvh, d, g * d)).view(b, kvh, n, g, d)
        logits = logits + ((kc * k.unsqueeze(3)).sum(dim=-1) / d / 2).transpose(-1, -2)
    logits.masked_fill_(~scored.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if only_last:  # a decode step: normalised over every scored slot, only the newest kept
        probs = probs[..., n - only_last:]
        values, scored = values[:, :, n - only_last:], scored[..., n - only_last:]
    probs = torch.nan_to_num(probs.mean(dim=2), nan=0.0)  # [b, kvh, n or only_last]
    if use_vnorm:
        probs = (probs + epsilon) * values.float().norm(dim=-1)
    return probs.masked_fill(~scored, 0.0)


@dataclass
class ExpectedAttentionPolicy(Policy):
    """Score keys by the attention future queries are expected to pay them; value norm weighted; sinks kept.

    At the prefill (kvpress's ``ExpectedAttentionPress``): the prompt's query rows after the first
    ``n_sink`` positions (or only the last ``query_window`` rows) give a mean ``mu`` and covariance
    ``S`` of the *pre-RoPE* queries (each row un-rotated from its own position); both are rotated by
    the RoPE rotation averaged over the ``n_future_positions`` positions after the prompt. A key ``k``
    then scores ``softmax(mu·k/sqrt(d) + k^T S k/(2d))`` over the non-sink slots of each query head,
    averaged over its KV group, times ``||v||`` (``(p + epsilon) * ||v||``, ``use_vnorm``). The first
    ``n_sink`` positions are protected (``+inf``; kvpress pads them with ``max + 1``).

    Shapes: queries ``[b, heads, w, d]`` (post-RoPE, from :attr:`Observation.queries`), keys and
    values ``[b, kv_heads, n, d]``, scores ``[b, kv_heads, n]``. ``d`` here is the head dim, as in
    kvpress (not the module's attention scaling).

    Decode (kvpress compresses at prefill only): every slot keeps the score it got when it arrived
    (kept in ``state``). A decoded slot is scored by the same rule with the statistics of the step
    that fed it: the mean of that step's own query row(s), rotated ahead over the next
    ``n_future_positions`` (a single row has no covariance), normalised over every held slot, so
    its score is on the prefill's scale. One slot is evicted per step once over budget.

    A chunked prefill carries the query rows across chunks (like the observation window), so the
    statistics are the same as one prefill's; this holds ``heads x prompt x d`` floats per layer
    until the completing chunk (``query_window`` bounds it).
    """

    name: ClassVar[str] = "expected_attention"
    summary: ClassVar[str] = "attention expected from future queries (RoPE-averaged statistics) x value norm"

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    query_window: int = 0  #: 0: every prompt row after the sinks (kvpress); k: the last k rows

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "n_future_positions", self.n_future_positions)
        check_positive_int(self.name, "n_sink", self.n_sink, minimum=0)
        check_positive_int(self.name, "query_window", self.query_window, minimum=0)
        for field in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"{self.name}: {field} must be true or false, got {getattr(self, field)!r}")
        if (not isinstance(self.epsilon, (int, float)) or isinstance(self.epsilon, bool)
                or not math.isfinite(self.epsilon) or self.epsilon < 0):
            raise ConfigError(f"{self.name}: epsilon must be a finite number >= 0, got {self.epsilon!r}")

    def query_rows(self) -> int:
        return self.query_window or ALL_ROWS

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.queries is not None and obs.values is not None, "expected_attention needs queries and values"
        keys, positions = obs.keys, obs.positions
        n, w = keys.shape[2], obs.queries.shape[2]
        if w == 1 and obs.rotary is not None and keys.shape[0] == 1:
            # one row (a decode step), the newest position p: R(p + 1 ..) R(-p) = R(1 ..), one averaged rotation
            mu, cov = mean_rotate(obs.queries[:, :, 0].float(), *_coefficients(1, self.n_future_positions, obs.rotary)), None
        else:
            future = int(positions.amax()) + 1
            # [b, w] positions of the query rows: the newest w tokens fed (a sliding layer may no longer hold them all)
            rows = torch.arange(future - w, future, device=positions.device).expand(positions.shape[0], w)
            mu, cov = query_statistics(obs.queries, rows, obs.rotary, self.n_sink, future, self.n_future_positions,
                                       self.use_covariance)
        sinks = positions < self.n_sink
        if not obs.prefill and obs.state is not None:  # older slots keep the score they arrived with
            fresh = expected_scores(keys, obs.values, mu, cov, ~sinks, self.use_vnorm, float(self.epsilon),
                                    only_last=w)
            scores = torch.cat([obs.state[..., : n - w], fresh], dim=-1)
        else:
            scores = expected_scores(keys, obs.values, mu, cov, ~sinks, self.use_vnorm, float(self.epsilon))
        scores = protect(scores, sinks)
        return scores, scores
