"""Sampling by a stable hash of the request id, and the tier a request runs at."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid

import pytest

from sparseety.errors import ConfigError
from sparseety.store import should_sample, trace_tier

IDS = [uuid.UUID(int=i * 7919 + 13).hex for i in range(200)] + ["req-1", "Ünïcode-id", ""]


def test_same_decision_in_another_process():
    """A fresh interpreter (another PYTHONHASHSEED) decides every id the same way."""
    code = (
        "import json, sys; from sparseety.store import should_sample; "
        "ids = json.load(sys.stdin); print(json.dumps([should_sample(i, 0.3) for i in ids]))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(IDS), capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, check=True)
    assert json.loads(out.stdout) == [should_sample(i, 0.3) for i in IDS]


def test_decision_is_the_sha256_prefix_rule():
    """Independent computation: the first 8 bytes of SHA-256, big-endian, over 2**64, below the rate."""
    for request_id in IDS:
        point = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") / 2**64
        for rate in (0.0, 0.1, 0.5, 0.9):
            assert should_sample(request_id, rate) == (point < rate)
        assert should_sample(request_id, 1.0)


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.25, 0.5, 0.9])
def test_sampled_fraction_is_close_to_the_rate(rate):
    ids = [uuid.UUID(int=(i * 2654435761) % 2**128).hex for i in range(10_000)]
    fraction = sum(should_sample(i, rate) for i in ids) / len(ids)
    # Binomial standard deviation at n=10k is at most 0.005; 4 sigma.
    assert abs(fraction - rate) < 4 * (rate * (1 - rate) / len(ids)) ** 0.5 + 1e-9


def test_samples_nest_as_the_rate_grows():
    """An id sampled at 10% is sampled at 50%: raising the rate only adds requests."""
    ids = [f"r{i}" for i in range(2000)]
    low = {i for i in ids if should_sample(i, 0.1)}
    high = {i for i in ids if should_sample(i, 0.5)}
    assert low and low < high


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_rate(rate):
    with pytest.raises(ConfigError, match="sample rate"):
        should_sample("x", rate)


def test_trace_tier():
    sampled = next(i for i in IDS if should_sample(i, 0.5))
    unsampled = next(i for i in IDS if not should_sample(i, 0.5))
    assert trace_tier(sampled, 0.5) == 2
    assert trace_tier(unsampled, 0.5) == 1
    assert trace_tier(unsampled, 0.5, force=True) == 3
    assert trace_tier(sampled, 0.5, tier=3) == 3
    assert trace_tier(unsampled, 0.5, tier=0) == 0
    with pytest.raises(ConfigError, match="tier"):
        trace_tier(sampled, 0.5, tier=4)
