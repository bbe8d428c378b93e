"""``Timings``: where a run's wall-clock time went, prefill against decode (the timing part of the run context)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Timings:
    """Seconds spent in the model's forwards, by phase.

    ``prefill_s`` counts every forward that feeds prompt tokens, a reconstructing policy's extra
    passes (kvzip) included; ``decode_s`` and ``decode_forwards`` the forwards after the prompt.
    """

    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_forwards: int = 0
    started: float = 0.0  #: ``time.perf_counter()`` at the start of the forward in progress

    def start(self) -> None:
        """A forward begins."""
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.perf_counter() - self.started

    def add(self, elapsed: float, prefill: bool) -> None:
        """Count a forward's ``elapsed`` seconds as prefill, else as one decode forward."""
        if prefill:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
            self.decode_forwards += 1
