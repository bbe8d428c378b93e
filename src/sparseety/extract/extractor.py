"""Signals -> ranked :class:`TokenRecord` lists. Stateless and thread-safe.

Reductions and the top-k selection run vectorized in torch (on the signal's device); only the
selected records are materialized as Python objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparseety.config import ExtractionConfig
from sparseety.errors import AlignmentError, ConfigError, ShapeError
from sparseety.extract.signals import (
    Signal,
    TokenScores,
    as_tensor,
    check_alignment,
    check_finite,
    split_ragged,
    token_scores,
)
from sparseety.schema import TokenRecord

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""Prompt+generated token ids, 1-D: a list or tuple of ints, an integer array or an integer tensor."""

Decoder = Callable[[int], str]
"""Turns one token id into its text."""


@dataclass(frozen=True)
class ExtractionResult:
    """What one extraction found.

    Attributes
    ----------
    records : the ranked records; with per-head rankings, head 0's records first, then head 1's, ...
    token_scores : ``[rows, n]`` every scored token's normalized score (rows: heads, or 1); column
        ``j`` is position ``j + token_offset``; tokens left out by ``exclude_special`` score ``-inf``.
    expert_load : route signals: for each expert, how many tokens have it among their top
        ``experts_k``; otherwise None.
    decode_failures : how many records got ``text`` None because the decoder raised (or returned
        something else than a string).
    """

    records: list[TokenRecord]
    token_scores: torch.Tensor
    expert_load: tuple[int, ...] | None
    decode_failures: int


def extract(
    token_ids: TokenIds,
    scores: Signal,
    config: ExtractionConfig,
    decode: Decoder | None = None,
    *,
    prompt_len: int | None = None,
    layer: int | None = None,
    step: int | None = None,
) -> list[TokenRecord]:
    """Rank the tokens a signal says were important.

    Parameters
    ----------
    token_ids : ``[total]`` prompt+generated token ids.
    scores : attention ``[batch, heads, query, key]`` (or another ``config.layout``), route
        ``[tokens, experts]`` or activation ``[tokens, hidden]``; NumPy or torch, any device. Its token
        axis covers ``token_ids[token_offset:]``, or the prompt part of it.
    config : the extraction settings.
    decode : token id -> text; a decoder that raises leaves that record's text None.
    prompt_len : how many of ``token_ids`` are prompt tokens (default: all).
    layer, step : copied into the records.

    Returns
    -------
    list[TokenRecord]
        At most ``top_k`` records per ranking, scores non-increasing, ties to the lower position.

    Raises
    ------
    ShapeError
        Wrong rank or layout, a batch above 1 without ``batch_index``, NaN or infinite scores.
    AlignmentError
        The token axis does not match the tokens.
    """
    return extract_detailed(token_ids, scores, config, decode, prompt_len=prompt_len, layer=layer, step=step).records


def extract_detailed(
    token_ids: TokenIds,
    scores: Signal,
    config: ExtractionConfig,
    decode: Decoder | None = None,
    *,
    prompt_len: int | None = None,
    layer: int | None = None,
    step: int | None = None,
) -> ExtractionResult:
    """Like :func:`extract`, also returning every token's score, the expert load and decode failures."""
    _check_config(config)
    return _extract(_Tokens(token_ids), as_tensor(scores), config, decode, prompt_len, layer, step)


def extract_ragged(
    token_ids: Sequence[TokenIds],
    scores: Signal,
    cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor,
    config: ExtractionConfig,
    decode: Decoder | None = None,
    *,
    prompt_lens: Sequence[int] | None = None,
    layer: int | None = None,
    step: int | None = None,
) -> list[list[TokenRecord]]:
    """Rank tokens per request of a continuous batch.

    Parameters
    ----------
    token_ids : one ``[total_i]`` prompt+generated token sequence per request.
    scores : a flat signal whose token axis concatenates the requests (see
        :func:`sparseety.extract.signals.split_ragged`): ``[total_tokens, experts|hidden]``, or
        attention with ``total_tokens`` keys and either ``total_tokens`` or one query row per request.
    cu_seqlens : ``[requests + 1]`` cumulative token counts, starting at 0.
    config, decode, layer, step : as in :func:`extract`.
    prompt_lens : per request, how many of its tokens are prompt tokens (default: all).

    Returns
    -------
    list[list[TokenRecord]]
        One ranked list per request, in request order.
    """
    results = extract_ragged_detailed(
        token_ids, scores, cu_seqlens, config, decode, prompt_lens=prompt_lens, layer=layer, step=step
    )
    return [result.records for result in results]


def extract_ragged_detailed(
    token_ids: Sequence[TokenIds],
    scores: Signal,
    cu_seqlens: Sequence[int] | np.ndarray | torch.Tensor,
    config: ExtractionConfig,
    decode: Decoder | None = None,
    *,
    prompt_lens: Sequence[int] | None = None,
    layer: int | None = None,
    step: int | None = None,
) -> list[ExtractionResult]:
    """Like :func:`extract_ragged`, with one :class:`ExtractionResult` per request."""
    x = as_tensor(scores)
    _check_config(config)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, (np.ndarray, torch.Tensor)) else list(cu_seqlens)
    pieces = split_ragged(x, bounds, config)
    if len(token_ids) != len(pieces):
        raise AlignmentError(
            f"cu_seqlens {bounds} describe {len(pieces)} requests but token_ids holds {len(token_ids)} sequences"
        )
    if prompt_lens is not None and len(prompt_lens) != len(pieces):
        raise AlignmentError(f"prompt_lens holds {len(prompt_lens)} lengths for {len(pieces)} requests")
    check_finite(x)
    return [
        _extract(
            _Tokens(ids), piece, config, decode, None if prompt_lens is None else prompt_lens[i], layer, step, False
        )
        for i, (ids, piece) in enumerate(zip(token_ids, pieces))
    ]


def _check_config(config: ExtractionConfig) -> None:
    if not isinstance(config, ExtractionConfig):
        raise ConfigError(f"config must be an ExtractionConfig, got {type(config).__name__}")


def _extract(
    tokens: _Tokens,
    x: torch.Tensor,
    config: ExtractionConfig,
    decode: Decoder | None,
    prompt_len: int | None,
    layer: int | None,
    step: int | None,
    check: bool = True,
) -> ExtractionResult:
    """The extraction of one signal; ``check`` False when it is already known to be finite."""
    total = len(tokens)
    if prompt_len is None:
        prompt_len = total
    elif isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 0 <= prompt_len <= total:
        raise AlignmentError(f"prompt_len must be an int in [0, {total}] (the token count), got {prompt_len!r}")
    n = check_alignment(x, config, total, prompt_len)
    offset = config.token_offset
    exclude = tokens.special_mask(offset, n, config.special_ids, x.device) if config.exclude_special else None
    if config.exclude_positions:
        at = torch.zeros(n, dtype=torch.bool, device=x.device)
        columns = [p - offset for p in config.exclude_positions if 0 <= p - offset < n]
        at[torch.tensor(columns, dtype=torch.long, device=x.device)] = True
        exclude = at if exclude is None else exclude | at
    scored = token_scores(x, config, exclude, check=check)
    rows = _top(scored.scores, min(config.top_k, n), config.min_score) if n else [[]] * scored.scores.shape[0]

    columns = [col for row in rows for _, col in row]
    ids = tokens.gather([col + offset for col in columns])
    experts = _experts(scored, columns)
    special = frozenset(config.special_ids)
    records: list[TokenRecord] = []
    for head, row in enumerate(rows):
        head_label = head if scored.per_head else None
        for rank, (score, col) in enumerate(row):
            i = len(records)
            token_id, position = ids[i], col + offset
            token_type = "special" if token_id in special else "prompt" if position < prompt_len else "generated"
            text = None if decode is None else _decode(decode, token_id)
            records.append(
                TokenRecord(
                    token_id=token_id,
                    position=position,
                    score=score,
                    layer=layer,
                    step=step,
                    head=head_label,
                    rank=rank,
                    token_type=token_type,
                    text=text,
                    experts=experts[i] if experts else None,
                )
            )
    failures = 0 if decode is None else sum(record.text is None for record in records)
    load = None if scored.expert_load is None else tuple(scored.expert_load.tolist())
    return ExtractionResult(records, scored.scores, load, failures)


def _decode(decode: Decoder, token_id: int) -> str | None:
    """``decode(token_id)``, or None when the decoder raises or returns something else than text."""
    try:
        text = decode(token_id)
    except Exception:  # a broken decoder must never break extraction
        return None
    return text if isinstance(text, str) else None


def _top(scores: torch.Tensor, k: int, min_score: float) -> list[list[tuple[float, int]]]:
    """Per row of ``scores`` ``[rows, n]``: the ``(score, column)`` pairs of the ``k`` best columns with
    ``score >= min_score``, best first; equal scores go to the lower column, exactly."""
    n = scores.shape[-1]
    values, columns = torch.topk(scores, min(k + 1, n), dim=-1)  # one extra: does topk cut a tie?
    out = []
    for row, (vals, cols) in enumerate(zip(values.tolist(), columns.tolist())):
        if k < n and vals[k] == vals[k - 1] and vals[k - 1] >= min_score:
            above = (scores[row] > vals[k - 1]).nonzero().flatten()
            tied = (scores[row] == vals[k - 1]).nonzero().flatten()[: k - above.numel()]
            chosen = torch.cat([above, tied])
            vals, cols = scores[row, chosen].tolist(), chosen.tolist()
        ordered = sorted((-v, c) for v, c in zip(vals[:k], cols[:k]) if v >= min_score)
        out.append([(-v, c) for v, c in ordered])
    return out


def _experts(scored: TokenScores, columns: list[int]) -> list[list[list[int | float]]]:
    """The ``[expert_id, prob]`` lists of the chosen columns (route signals), else an empty list."""
    if scored.expert_ids is None or scored.expert_probs is None or not columns:
        return []
    index = torch.tensor(columns, device=scored.expert_ids.device)
    ids, probs = scored.expert_ids[index].tolist(), scored.expert_probs[index].tolist()
    return [[[e, p] for e, p in zip(row_ids, row_probs)] for row_ids, row_probs in zip(ids, probs)]


class _Tokens:
    """Read access to token ids held as a sequence, an array or a tensor, without listing them all."""

    def __init__(self, token_ids: TokenIds) -> None:
        if isinstance(token_ids, (np.ndarray, torch.Tensor)):
            if isinstance(token_ids, np.ndarray):
                integer = token_ids.dtype.kind in "iu"
            else:
                integer = not (token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool)
            if token_ids.ndim != 1 or not integer:
                raise ShapeError(
                    f"token_ids must be 1-D integers, got shape {tuple(token_ids.shape)} dtype {token_ids.dtype}"
                )
        elif not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
            raise ShapeError(f"token_ids must be a sequence, array or tensor of ints, got {type(token_ids).__name__}")
        self._ids = token_ids

    def __len__(self) -> int:
        return len(self._ids)

    def gather(self, positions: list[int]) -> list[int]:
        """The ids at ``positions``, as Python ints."""
        if not positions:
            return []
        if isinstance(self._ids, (np.ndarray, torch.Tensor)):
            return self._ids[positions].tolist()
        ids = [self._ids[p] for p in positions]
        if all(type(token_id) is int for token_id in ids):
            return ids
        for position, token_id in zip(positions, ids):
            if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
                raise ShapeError(f"token_ids must be ints, got {token_id!r} at position {position}")
        return [int(token_id) for token_id in ids]

    def special_mask(self, offset: int, n: int, special_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """``[n]`` whether the token at position ``offset + j`` is a special token."""
        ids = self._ids[offset : offset + n]
        try:
            ids = torch.as_tensor(np.ascontiguousarray(ids) if isinstance(ids, np.ndarray) else ids, device=device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ShapeError(f"token_ids must be ints: {exc}") from None
        return torch.isin(ids, torch.tensor(special_ids, dtype=ids.dtype, device=device))
