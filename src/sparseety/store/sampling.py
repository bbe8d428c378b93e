"""Which requests get traced at which tier: a stable hash of the request id, the same in every process.

Tier 1 (counts and timings) for every request, tier 2 (tokens, events, importance) for a sample,
tier 3 (per-step vectors) for requests marked by hand (``sparseety run --force-trace`` or a request
field of the server).
"""

from __future__ import annotations

import hashlib

from sparseety.errors import ConfigError

_SCALE = float(1 << 64)


def check_rate(rate: float) -> float:
    """``rate`` as a float in ``[0, 1]``, else :class:`ConfigError`."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        raise ConfigError(f"sample rate must be a number in [0, 1], got {rate!r}")
    return float(rate)


def sample_point(request_id: str) -> float:
    """The request's point in ``[0, 1)``: the first 8 bytes of SHA-256 of its UTF-8 id, over 2**64."""
    digest = hashlib.sha256(str(request_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def should_sample(request_id: str, rate: float) -> bool:
    """True when ``request_id`` falls in the sampled fraction ``rate`` (stable across processes and machines)."""
    rate = check_rate(rate)
    if rate >= 1.0:
        return True
    return sample_point(request_id) < rate


def trace_tier(request_id: str, rate: float, *, tier: int = 2, force: bool = False) -> int:
    """The tier to run ``request_id`` at: 3 when forced, ``tier`` when sampled, else at most 1.

    Parameters
    ----------
    request_id : the request's id (decide it before generating).
    rate : sampled fraction in ``[0, 1]``.
    tier : the tier a sampled request gets (0..3).
    force : the request was marked for full tracing.
    """
    if tier not in (0, 1, 2, 3):
        raise ConfigError(f"tier must be 0, 1, 2 or 3, got {tier!r}")
    if force:
        return 3
    return tier if should_sample(request_id, rate) else min(tier, 1)
