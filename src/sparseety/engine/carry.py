"""What a chunked prefill carries between its chunks, per layer, until the chunk that completes the region.

A prefill may come in chunks (continuous batching). The policy scores once, at the end of the chunk
that completes the prompt (or the context), from what one prefill forward would have given it: the
column sums of every chunk added up, the observation window's rows and the query rows stacked, and
the hidden states of every chunk's tokens. Earlier chunks :meth:`PrefillCarry.keep` theirs; the
completing chunk :meth:`PrefillCarry.join` s them to its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseety.engine.signals import LayerSignals


@dataclass
class PrefillCarry:
    """Per layer, the signals of the prefill chunks fed so far (empty outside a chunked prefill)."""

    colsum: dict[int, torch.Tensor] = field(default_factory=dict)  #: ``[b, heads, n]`` summed over earlier chunks
    window: dict[int, torch.Tensor] = field(default_factory=dict)  #: ``[b, heads, w, n]`` earlier chunks' window rows
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  #: ``[b, heads, w, d]`` earlier chunks' query rows
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  #: ``[b, r, D]`` earlier chunks' hidden states

    def keep(self, layer: int, seen: LayerSignals, hidden: torch.Tensor | None) -> None:
        """An earlier chunk: keep its signals (and hidden states ``[b, q, D]``), joined to what came before."""
        if seen.colsum is not None:
            self.colsum[layer] = joined(self.colsum.get(layer), seen.colsum, rows=False)
        if seen.window is not None:
            self.window[layer] = joined(self.window.get(layer), seen.window, rows=True)
        if seen.queries is not None:
            self.queries[layer] = joined(self.queries.get(layer), seen.queries, rows=True)
        if hidden is not None:
            carried = self.hidden.get(layer)
            self.hidden[layer] = hidden if carried is None else torch.cat([carried, hidden], dim=1)

    def join(self, layer: int, seen: LayerSignals, hidden: torch.Tensor | None) -> None:
        """The chunk that completes the region (or any scoring forward): ``seen`` gets what the earlier chunks
        carried joined to its own signals, and ``seen.hidden`` the hidden states of every chunk (``[b, r, D]``)."""
        if not (self.colsum or self.window or self.queries or self.hidden):  # a decode step: nothing carried
            seen.hidden = hidden
            return
        colsum, window = self.colsum.pop(layer, None), self.window.pop(layer, None)
        if seen.colsum is not None:
            seen.colsum = joined(colsum, seen.colsum, rows=False)
        if seen.window is not None:
            seen.window = joined(window, seen.window, rows=True)
        queries = self.queries.pop(layer, None)
        if seen.queries is not None:
            seen.queries = joined(queries, seen.queries, rows=True)
        carried = self.hidden.pop(layer, None)
        seen.hidden = hidden if carried is None or hidden is None else torch.cat([carried, hidden], dim=1)


def joined(carried: torch.Tensor | None, new: torch.Tensor, *, rows: bool) -> torch.Tensor:
    """Earlier chunks' signal joined to this chunk's: window rows stacked (``rows``), else column sums added.

    The earlier rows never saw this chunk's keys, so their key axis is zero-padded to ``new``'s.
    """
    if carried is None:
        return new
    n = new.shape[-1]
    if carried.shape[-1] != n:
        carried = torch.nn.functional.pad(carried, (0, n - carried.shape[-1]))
    return torch.cat([carried, new], dim=2) if rows else carried + new
