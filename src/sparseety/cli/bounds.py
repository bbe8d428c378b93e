"""The range of every numeric command-line flag, checked before a command runs.

One table for every command, keyed by parameter name: a value outside its range (or a float that is
NaN or infinite) is one ``error:`` line and exit code 2, never an ``OverflowError`` deep inside.
Where a command already checks a side of a range with its own message (``--budget must be a positive
integer``, ``--tier`` against the server's tiers) the table leaves that side to it; a test checks
both sides of every numeric flag of every command.
"""

from __future__ import annotations

import math
from typing import Any

from sparseety.config import MAX_TOKENS
from sparseety.errors import InputError
from sparseety.ratio import check_ratio

MAX_LENGTH = 1 << 17
"""The longest passkey context (``--lengths``)."""

#: parameter name -> (smallest, largest) accepted value, both inclusive; None: that side is checked by
#: the command itself, with a message of its own (``--budget must be a positive integer``)
BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "ablations": (0, 10_000),
    "attention_topk": (None, MAX_TOKENS),
    "budget": (None, MAX_TOKENS),
    "cases": (None, 10_000),
    "epochs": (1, 10_000),
    "experts_k": (None, 4096),
    "hidden": (0, 1024),
    "holdout": (0.0, 0.95),
    "label_top": (None, None),
    "layer": (0, 4095),
    "limit": (None, 100_000),
    "lr": (None, 1.0),
    "max_examples": (100, 100_000_000),
    "max_body_bytes": (None, 1 << 30),
    "max_budget": (None, MAX_TOKENS),
    "max_concurrency": (1, 256),
    "max_new_tokens": (1, MAX_TOKENS),
    "max_queue": (0, 100_000),
    "max_tokens_limit": (None, MAX_TOKENS),
    "min_budget": (None, MAX_TOKENS),
    "min_score": (None, None),
    "port": (0, 65535),
    "prefill_chunk": (1, MAX_TOKENS),
    "ratio": (None, None),
    "sample_rate": (None, None),
    "seed": (0, 2**32 - 1),
    "speculative": (1, 1024),
    "sql_threads": (1, 256),  # sparseety.store.sandbox.MAX_THREADS
    "sql_timeout": (None, 86_400.0),  # more than 0: checked by sparseety.store.sandbox.check_limits
    "step": (None, MAX_TOKENS),
    "steps": (1, 100_000),
    "threads": (1, 1024),
    "threshold": (None, 1e6),
    "tier": (None, None),
    "timeout": (0.001, 86_400.0),
    "tokens": (8, MAX_TOKENS),  # a passage of bench faithfulness / learn-importance
    "top_k": (None, MAX_TOKENS),
}


def check_bounds(params: dict[str, Any]) -> None:
    """Refuse any numeric value in ``params`` outside :data:`BOUNDS`, or a float that is NaN or
    infinite (None means the flag was not given).

    Raises
    ------
    InputError
        Naming the flag, its range and the value.
    """
    for name, value in params.items():
        if name not in BOUNDS or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low, high = BOUNDS[name]
        flag = "--" + name.replace("_", "-")
        if name == "ratio":
            check_ratio(value, flag)
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{flag} must be a finite number, got {value}")
        if low is not None and value < low:
            raise InputError(f"{flag} must be at least {_short(low)}, got {_short(value)}")
        if high is not None and value > high:
            raise InputError(f"{flag} must be at most {_short(high)}, got {_short(value)}")


def _short(value: float) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"
