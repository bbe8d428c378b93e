"""What the fuzz tests share: bounded, reproducible hypothesis settings and the check of a command-line result.

Each test bounds its examples (``FUZZ_EXAMPLES`` scales them all, default 1) so the suite stays fast;
the examples are derandomized, so a run in CI is reproducible.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1"))


def examples(n: int) -> settings:
    """Hypothesis settings for ``n`` examples (times ``FUZZ_EXAMPLES``), no deadline, reproducible."""
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def assert_clean(result: Any) -> None:
    """Exit 0, 1 (some records failed) or 2 (bad input); no traceback; a failure ends in one ``error:`` line."""
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"exception escaped: {result.exception!r}\n{result.output}")
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("error: "), result.stderr
        assert sum(line.startswith("error: ") for line in lines) >= 1
