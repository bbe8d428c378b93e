"""A transformers streamer that timestamps each generated token and hands text deltas to the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from transformers.generation.streamers import BaseStreamer


@dataclass
class TokenTimes:
    """Arrival times (``time.perf_counter``) of generated tokens; several per entry under speculation."""

    stamps: list[tuple[float, int]] = field(default_factory=list)

    @property
    def first(self) -> float | None:
        return self.stamps[0][0] if self.stamps else None

    def gaps(self) -> list[float]:
        """Seconds between consecutive tokens (a multi-token step spreads its gap over its tokens)."""
        out: list[float] = []
        for (before, _), (now, count) in zip(self.stamps, self.stamps[1:]):
            out.extend([(now - before) / count] * count)
        return out


class GenerationCancelled(Exception):
    """The caller went away; raised inside ``model.generate`` to stop spending compute on it."""


class TokenStreamer(BaseStreamer):
    """Receives ids from ``model.generate``: the prompt first, then each step's new tokens.

    With a ``loop`` and ``queue`` it decodes the output so far and puts each new piece of text on the
    queue (``None`` marks the end); text that ends inside a multi-byte character is held back until
    the character is complete. Without them it only records :attr:`times`. After :meth:`cancel`, the
    next token raises :class:`GenerationCancelled`, which ends the generation.

    Parameters
    ----------
    tokenizer : decodes the generated ids (special tokens skipped).
    loop, queue : the event loop and its ``asyncio.Queue`` to feed, or None.
    """

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop | None = None,
                 queue: asyncio.Queue[str | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.loop = loop
        self.queue = queue
        self.times = TokenTimes()
        self._prompt_seen = False
        self._ids: list[int] = []
        self._sent = 0
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the generation at its next token (thread-safe)."""
        self._cancelled.set()

    def put(self, value: Any) -> None:
        if self._cancelled.is_set():
            raise GenerationCancelled
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        ids = [int(i) for i in value.reshape(-1).tolist()]
        if not ids:
            return
        self.times.stamps.append((now, len(ids)))
        if self.queue is None:
            return
        self._ids.extend(ids)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self._push(text[self._sent:])
        self._sent = len(text)

    def end(self) -> None:
        if self.queue is None:
            return
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        self._push(text[self._sent:])
        self._push(None)

    def close(self) -> None:
        """Mark the end without flushing (generation failed)."""
        if self.queue is not None:
            self._push(None)

    def _push(self, item: str | None) -> None:
        if item == "":
            return
        assert self.loop is not None and self.queue is not None
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            pass
