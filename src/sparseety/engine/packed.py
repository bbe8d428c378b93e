"""A packed forward: the new tokens of many sequences side by side in one model call (continuous batching).

The batch is flattened as vLLM does: ``input_ids [1, T]`` holds every sequence's new tokens one
segment after another, ``position_ids [1, T]`` their own positions. Everything per token (embeddings,
projections, MLPs, routers) runs once for the whole batch; everything per sequence goes to that
sequence's own :class:`RunContext`: :class:`PackedCache` appends each segment's keys and values to
the sequence's own ``SparseCache``, the attention function attends each segment to its own cache
(no padding, no mask between sequences), and probes split their rows by segment. A sequence's
cache, policy and events therefore never see its neighbours.

A failure is one sequence's too: whatever a sequence's own code raises inside the forward (its cache,
policy, probes) is caught by :func:`isolated`, recorded on its context (``ctx.failure``), and the
sequence is left out of the rest of the forward (its rows get zeros, which nothing else reads); the
batched engine then retires it alone. Its neighbours' computation does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparseety.engine.context import RunContext, scoped
from sparseety.engine.probe import ModuleProbes


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a packed forward: ``length`` tokens from row ``start``."""

    ctx: RunContext
    start: int
    length: int


@dataclass(frozen=True)
class PackedForward:
    """The segments of the packed forward in progress."""

    segments: tuple[Segment, ...]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor ``[T, ...]`` (or ``[1, T, ...]``, flattened) into one piece per segment."""
        rows = x.reshape(-1, x.shape[-1])
        return [rows[s.start : s.start + s.length] for s in self.segments]


T = TypeVar("T")


def isolated(ctx: RunContext, fn: Callable[..., T], *args: object) -> T | None:
    """Run one sequence's part of a packed forward; if it raises, mark that sequence failed and return None.

    A sequence that already failed is skipped (None). Only ``Exception`` is caught: an interrupt still
    stops the whole forward.
    """
    if ctx.failure is not None:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # one sequence's fault: it leaves the batch, the forward goes on
        ctx.failure = exc
        return None


_PACKED: ContextVar[PackedForward | None] = ContextVar("sparseety_packed", default=None)


def active_packed() -> PackedForward | None:
    """The packed forward in progress on this thread, if any."""
    return _PACKED.get()


def activate_packed(packed: PackedForward) -> contextlib.AbstractContextManager[PackedForward]:
    """Make ``packed`` the packed forward in progress inside the ``with`` block."""
    return scoped(_PACKED, packed)


class _PackedLayer(CacheLayerMixin):
    """Routes one decoder layer's new keys/values ``[1, kv_heads, T, d]`` to each sequence's own cache layer."""

    is_sliding = False
    is_compileable = False

    def __init__(self, index: int, packed: PackedForward) -> None:
        super().__init__()
        self.index, self.packed = index, packed

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        for s in self.packed.segments:
            isolated(s.ctx, s.ctx.cache.layers[self.index].update, key_states[:, :, s.start : s.start + s.length],
                     value_states[:, :, s.start : s.start + s.length])
        return key_states, value_states  # the attention function reads each sequence's own cache

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The ``past_key_values`` of a packed forward: one routing layer per decoder layer."""

    def __init__(self, num_layers: int, packed: PackedForward) -> None:
        super().__init__(layers=[_PackedLayer(i, packed) for i in range(num_layers)])


class SplitProbes:
    """A probe collector for a packed forward: splits each recorded ``[T, ...]`` tensor by segment."""

    def __init__(self, packed: PackedForward) -> None:
        self.packed = packed

    def _each(self, x: torch.Tensor) -> Iterator[tuple[RunContext, ModuleProbes, torch.Tensor]]:
        for segment, rows in zip(self.packed.segments, self.packed.split(x)):
            if segment.ctx.probes is not None and segment.ctx.failure is None:
                yield segment.ctx, segment.ctx.probes, rows

    def record_router(self, layer: int, logits: torch.Tensor) -> None:
        for ctx, probes, rows in self._each(logits):
            isolated(ctx, probes.record_router, layer, rows)

    def record_activation(self, layer: int, x: torch.Tensor) -> None:
        for ctx, probes, rows in self._each(x):
            isolated(ctx, probes.record_activation, layer, rows)
