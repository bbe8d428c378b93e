"""The bench tests may use the tiny models of ``tests/engine/tiny_models.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
