"""The fuzz suite: property-based tests (hypothesis) that no input reaches the user as a traceback.
Its tests may use the tiny models of ``tests/engine/tiny_models.py`` and the live servers of ``tests/serve/serve_helpers.py``; shared checks are in ``fuzz_helpers``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))  # serve_helpers: real servers on loopback
