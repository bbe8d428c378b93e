"""The Python API's result views on a synthetic run (no model): rows with the store's columns, DataFrames
when pandas is there, one clear ImportError when it is not, and the inline report."""

from __future__ import annotations

import sys

import pytest

from sparseety.api import PANDAS_MISSING, Generation
from sparseety.options import GenerationOptions
from sparseety.store.synthetic import synthetic_result
from sparseety.store.tables import TABLES


def generation(tier: int = 2) -> Generation:
    return Generation(synthetic_result(0, tier=tier), GenerationOptions(tier=tier), "prompt")


def test_rows_have_the_store_columns():
    result = generation()
    events = result.events()
    assert events and set(events[0]) == set(TABLES["token_events"].names)
    assert len(result.important_token_rows()) == len(result.important_tokens) > 0
    assert result.tokens == result.run.token_texts[len(result.run.prompt_ids):]


def test_dataframes_and_the_message_without_pandas(monkeypatch):
    pandas = pytest.importorskip("pandas")
    frame = generation().events_df()
    assert isinstance(frame, pandas.DataFrame) and list(frame.columns) == TABLES["token_events"].names
    assert list(generation(tier=0).events_df().columns) == TABLES["token_events"].names  # empty, same columns
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install 'sparseety\\[notebook\\]'") as info:
        generation().important_tokens_df()
    assert str(info.value) == PANDAS_MISSING


def test_inline_report():
    html = generation()._repr_html_()
    assert html.startswith("<!DOCTYPE html>")
    assert "tier 0 records nothing" in generation(tier=0)._repr_html_()
