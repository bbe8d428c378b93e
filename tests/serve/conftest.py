"""The serve tests share the session's default-model engine (``smollm_engine``) across their servers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine(smollm_engine):
    return smollm_engine
