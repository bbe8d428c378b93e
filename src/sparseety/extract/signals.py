"""Axis semantics: from a raw signal tensor to one normalized score per token, aligned with the tokens.

Every function here works on torch tensors (NumPy arrays are wrapped without a copy) and stays
vectorized; nothing is turned into Python lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparseety.config import ExtractionConfig
from sparseety.errors import AlignmentError, ShapeError

Signal = np.ndarray | torch.Tensor
"""A score tensor: NumPy array or torch tensor (any device)."""

DEFAULT_LAYOUTS = {4: "bhqk", 3: "hqk", 2: "qk"}
"""The attention layout assumed for each rank when ``layout`` is not given."""


@dataclass(frozen=True)
class TokenScores:
    """The per-token scores of one signal.

    Attributes
    ----------
    scores : ``[rows, n]`` normalized scores; ``rows`` is the number of heads when ``per_head``,
        else 1. Column ``j`` is the token at position ``j + token_offset``; excluded tokens score ``-inf``.
    per_head : whether row ``i`` is the ranking of head ``i``.
    expert_ids : ``[n, experts_k]`` each token's top experts, best first (route signals only).
    expert_probs : ``[n, experts_k]`` their probabilities (route signals only).
    expert_load : ``[experts]`` how many tokens have each expert among their top ``experts_k``.
    """

    scores: torch.Tensor
    per_head: bool = False
    expert_ids: torch.Tensor | None = None
    expert_probs: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None


def as_tensor(scores: Signal) -> torch.Tensor:
    """Wrap ``scores`` as a floating-point tensor without copying when possible.

    Raises
    ------
    ShapeError
        If ``scores`` is not an array or tensor of real numbers.
    """
    if isinstance(scores, np.ndarray):
        if scores.dtype.kind not in "biuf":
            raise ShapeError(f"scores must hold real numbers, got NumPy dtype {scores.dtype}")
        if not scores.flags.writeable or any(s < 0 for s in scores.strides):
            scores = np.array(scores)  # torch refuses read-only and negatively strided arrays
        scores = torch.from_numpy(scores)
    elif not isinstance(scores, torch.Tensor):
        raise ShapeError(f"scores must be a NumPy array or a torch tensor, got {type(scores).__name__}")
    if scores.is_complex():
        raise ShapeError(f"scores must hold real numbers, got dtype {scores.dtype}")
    return scores if scores.is_floating_point() else scores.float()


def attention_layout(x: torch.Tensor, config: ExtractionConfig) -> str:
    """The attention layout of ``x``: ``config.layout``, or the default for its rank."""
    layout = config.layout or DEFAULT_LAYOUTS.get(x.dim())
    if layout is None or len(layout) != x.dim():
        needs = f"layout {config.layout!r} needs {len(config.layout)}-D" if config.layout else "needs 2-D, 3-D or 4-D"
        raise ShapeError(f"attention scores of shape {tuple(x.shape)} are {x.dim()}-D; {needs} scores")
    return layout


def token_axis(x: torch.Tensor, config: ExtractionConfig) -> int:
    """Index of the token (key) axis of ``x``; checks the rank (and layout) of ``x``."""
    if config.score_type == "attention":
        return attention_layout(x, config).index("k")
    if x.dim() not in (2, 3):
        raise ShapeError(
            f"{config.score_type} scores must be 2-D [tokens, {_features(config)}] or 3-D "
            f"[batch, tokens, {_features(config)}], got shape {tuple(x.shape)}"
        )
    return x.dim() - 2


def check_alignment(x: torch.Tensor, config: ExtractionConfig, total: int, prompt_len: int) -> int:
    """Check that the token axis of ``x`` lines up with the tokens and return its length ``n``.

    Column ``j`` is position ``j + token_offset``; the columns must cover the ``total`` prompt+generated
    tokens, or the first ``prompt_len`` (prompt) tokens alone.

    Raises
    ------
    AlignmentError
        Naming both lengths and the layout.
    """
    n = x.shape[token_axis(x, config)]
    offset = config.token_offset
    if n + offset in (total, prompt_len):
        return n
    expected = f"{total - offset} (prompt+generated tokens {total}"
    expected += f" minus token_offset {offset})" if offset else ")"
    if prompt_len != total:
        expected += f" or {prompt_len - offset} (prompt tokens only)"
    if config.score_type == "attention":
        axis = f"key axis of layout {attention_layout(x, config)!r}"
    else:
        axis = f"token axis of layout [tokens, {_features(config)}]"
    raise AlignmentError(
        f"scores of shape {tuple(x.shape)} have {n} tokens on the {axis}, but the tokens need {expected}"
    )


def check_finite(x: torch.Tensor, probe: torch.Tensor | None = None) -> None:
    """Raise :class:`ShapeError` if ``x`` holds NaN or infinity.

    Parameters
    ----------
    x : the signal.
    probe : optionally, a smaller tensor derived from ``x`` in which every NaN or infinity of ``x``
        shows up as a non-finite value (a sum, a norm); only the probe is scanned then.
    """
    probe = x if probe is None else probe
    if not probe.numel() or math.isfinite(probe.sum().item()):
        return
    bad = ~torch.isfinite(x)  # the sum of finite values can overflow too: find the culprits
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ShapeError(
            f"scores of shape {tuple(x.shape)} hold {int(bad.sum())} NaN or infinite values (first at index {where})"
        )
    if probe is not x and not bool(torch.isfinite(probe).all()):
        raise ShapeError(f"scores of shape {tuple(x.shape)} overflow {probe.dtype} when reduced per token")


def token_scores(
    x: torch.Tensor, config: ExtractionConfig, exclude: torch.Tensor | None = None, *, check: bool = True
) -> TokenScores:
    """Reduce a signal to normalized per-token scores, as ``config.score_type`` says.

    Parameters
    ----------
    x : attention ``[batch, heads, query, key]`` in ``config.layout`` (or fewer axes), route
        ``[tokens, experts]`` or activation ``[tokens, hidden]`` (both optionally with a leading batch).
    config : the extraction settings.
    exclude : ``[n]`` bool, tokens to leave out (special tokens): they count 0 towards the
        normalization and score ``-inf``, so they are never ranked.
    check : refuse NaN and infinity in ``x``; only the norms of the reduced scores are looked at
        when every non-finite input value is sure to reach them.

    Raises
    ------
    ShapeError
        Wrong rank, a batch above 1 without ``batch_index``, NaN or infinite values.
    """
    cheap_check = check and exclude is None and _propagates_non_finite(x, config)
    if check and not cheap_check:
        check_finite(x)
    experts: tuple[torch.Tensor, ...] = ()
    if config.score_type == "attention":
        reduced = _attention(x, config)
    else:
        x = _token_major(x, config)
        if config.score_type == "activation":
            reduced = _activation(x, config)[None]
        else:
            reduced, experts = _route(x, config)
    if exclude is not None:
        reduced = reduced.masked_fill(exclude, 0.0)
    scores, norms = normalize(reduced, config.normalize)
    if cheap_check and (norms is None or not all(map(math.isfinite, norms))):
        check_finite(x, reduced)
    if exclude is not None:
        scores = scores.masked_fill(exclude, -torch.inf)
    return TokenScores(scores, config.score_type == "attention" and config.head_reduce == "none", *experts)


def normalize(scores: torch.Tensor, how: str) -> tuple[torch.Tensor, list[float] | None]:
    """Normalize each row of ``scores`` ``[rows, n]`` by its ``l2``/``l1`` norm or ``max`` |score|.

    Returns
    -------
    (normalized ``[rows, n]``, the ``rows`` norms); a row whose norm is 0 is left as it is.
    ``none`` returns ``(scores, None)``.
    """
    if how == "none" or scores.shape[-1] == 0:
        return scores, None
    if how == "max":
        norm = scores.abs().amax(-1, keepdim=True)
    elif how == "l1":
        norm = scores.abs().sum(-1, keepdim=True)
    else:
        norm = torch.linalg.vector_norm(scores, dim=-1, keepdim=True)
    norms = norm.flatten().tolist()
    if 0.0 in norms:
        norm = torch.where(norm == 0, 1.0, norm)
    return scores / norm, norms


def split_ragged(x: torch.Tensor, cu_seqlens: Sequence[int], config: ExtractionConfig) -> list[torch.Tensor]:
    """Split a flat continuous-batching signal into one signal per request, in the same layout.

    Parameters
    ----------
    x : a signal whose token (key) axis concatenates the requests: ``[total_tokens, experts|hidden]``,
        or attention whose key axis has ``total_tokens`` entries and whose query axis has either
        ``total_tokens`` rows (prefill: the diagonal blocks are kept) or one row per request (decode).
    cu_seqlens : ``[requests + 1]`` cumulative token counts, starting at 0.
    """
    bounds = [int(b) for b in cu_seqlens]
    tok = token_axis(x, config)
    total = x.shape[tok]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ShapeError(
            f"cu_seqlens must rise from 0 to {total}, the length of the token axis of the scores of shape "
            f"{tuple(x.shape)}, got {bounds}"
        )
    requests = len(bounds) - 1
    query = attention_layout(x, config).index("q") if config.score_type == "attention" else None
    if query is not None and x.shape[query] not in (total, requests):
        raise ShapeError(
            f"ragged attention of shape {tuple(x.shape)} has {x.shape[query]} query rows; expected "
            f"{total} (one per token) or {requests} (one per request)"
        )
    pieces = []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        piece = x.narrow(tok, start, end - start)
        if query is not None:
            rows = (start, end - start) if x.shape[query] == total else (i, 1)
            piece = piece.narrow(query, *rows)
        pieces.append(piece)
    return pieces


def _propagates_non_finite(x: torch.Tensor, config: ExtractionConfig) -> bool:
    """Whether every NaN or infinity of ``x`` reaches the reduced per-token scores (and so their norms).

    True for sums, means and identities; false for ``max`` (which can hide ``-inf``), ``last`` (which
    ignores rows), ``nonzero_frac`` and routing.
    """
    if config.score_type == "activation":
        return config.activation_reduce != "nonzero_frac"
    if config.score_type != "attention":
        return False
    layout = attention_layout(x, config)
    single_query = x.shape[layout.index("q")] == 1
    single_head = "h" not in layout or x.shape[layout.index("h")] == 1
    return (single_query or config.query_reduce in ("sum", "mean")) and (single_head or config.head_reduce != "max")


def _attention(x: torch.Tensor, config: ExtractionConfig) -> torch.Tensor:
    """Attention in any layout -> ``[heads, n]`` (``head_reduce`` none) or ``[1, n]``."""
    layout = attention_layout(x, config)
    if layout not in ("bhqk", "hqk", "qk"):
        x = x.transpose(-1, -2)
    if "b" in layout:
        x = _select_batch(x, layout, config.batch_index)
    elif config.batch_index:
        raise ShapeError(f"batch_index {config.batch_index} is set but layout {layout!r} has no batch axis")
    if "h" not in layout:
        x = x[None]  # [heads, query, key]
    heads, queries = x.shape[0], x.shape[1]
    if heads == 0 or queries == 0:
        raise ShapeError(f"attention scores of shape {tuple(x.shape)} (layout {layout!r}) have no heads or queries")
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if queries == 1:
        per_head = x[:, 0]
    elif config.query_reduce in ("sum", "mean"):
        if x.dtype == acc:  # on CPU a matrix product reads the rows about twice as fast as sum()
            per_head = torch.matmul(x.new_ones(1, queries), x)[:, 0]
        else:
            per_head = x.sum(1, dtype=acc)
        if config.query_reduce == "mean":
            per_head = per_head / queries
    elif config.query_reduce == "max":
        per_head = x.amax(1)
    else:
        per_head = x[:, -1]
    per_head = per_head.to(acc)
    if config.head_reduce == "none" or heads == 1:
        return per_head
    if config.head_reduce == "mean":  # a matrix product: mean() opens a thread-parallel region, slow under load
        return torch.matmul(per_head.new_ones(1, heads), per_head) / heads
    return per_head.amax(0, keepdim=True)


def _select_batch(x: torch.Tensor, layout: str, batch_index: int | None) -> torch.Tensor:
    """Drop the leading batch axis of ``x``, picking ``batch_index`` (required when batch > 1)."""
    batch = x.shape[0]
    if batch > 1 and batch_index is None:
        raise ShapeError(
            f"scores of shape {tuple(x.shape)} (layout {layout!r}) hold a batch of {batch}: "
            f"set batch_index to choose one"
        )
    index = batch_index or 0
    if index >= batch:
        raise ShapeError(f"batch_index {index} is out of range for a batch of {batch} (layout {layout!r})")
    return x[index]


def _token_major(x: torch.Tensor, config: ExtractionConfig) -> torch.Tensor:
    """Route or activation signal -> ``[tokens, experts|hidden]`` (picking ``batch_index``)."""
    token_axis(x, config)  # checks the rank
    if x.dim() == 3:
        x = _select_batch(x, f"[batch, tokens, {_features(config)}]", config.batch_index)
    elif config.batch_index:
        raise ShapeError(
            f"batch_index {config.batch_index} is set but the scores of shape {tuple(x.shape)} have no batch axis"
        )
    if x.shape[1] == 0:
        raise ShapeError(f"{config.score_type} scores of shape {tuple(x.shape)} have an empty {_features(config)} axis")
    return x


def _route(x: torch.Tensor, config: ExtractionConfig) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``[tokens, experts]`` -> (``[1, tokens]`` top-expert probability, (top ids, top probs, load))."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    probs = torch.softmax(x, dim=-1) if config.route_input == "logits" else x
    top_probs, top_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_ids, top_probs = top_ids[:, : config.experts_k], top_probs[:, : config.experts_k]
    load = torch.bincount(top_ids.flatten(), minlength=probs.shape[-1])
    return top_probs[None, :, 0], (top_ids, top_probs, load)


def _activation(x: torch.Tensor, config: ExtractionConfig) -> torch.Tensor:
    """``[tokens, hidden]`` -> ``[tokens]`` by ``activation_reduce``."""
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if config.activation_reduce == "maxabs":
        return x.abs().amax(-1).to(acc)
    if config.activation_reduce == "l2":
        return torch.linalg.vector_norm(x, dim=-1, dtype=acc)
    return (x.abs() > config.zero_eps).sum(-1).to(acc) / x.shape[-1]


def _features(config: ExtractionConfig) -> str:
    return "experts" if config.score_type == "route" else "hidden"
