"""TokenRecord round trips and its typed refusal of malformed dicts."""

from __future__ import annotations

import json

import pytest

from sparseety.errors import RecordError
from sparseety.schema import SCHEMA_VERSION, TOKEN_TYPES, TokenRecord

ATTENTION = TokenRecord(
    token_id=42, position=3, score=0.5, layer=2, step=None, head=1, rank=0, token_type="prompt", text=" the"
)
ROUTE = TokenRecord(
    token_id=7,
    position=9,
    score=1.0,
    layer=0,
    step=4,
    head=None,
    rank=2,
    token_type="generated",
    text=None,
    experts=[[3, 0.75], [0, 0.125]],
)


def test_schema_version_is_a_dotted_string():
    assert [int(part) for part in SCHEMA_VERSION.split(".")] == [1, 0]


@pytest.mark.parametrize("record", [ATTENTION, ROUTE])
def test_round_trip_through_json(record):
    data = json.loads(json.dumps(record.to_dict()))
    assert TokenRecord.from_dict(data) == record


def test_to_dict_keys_and_experts_only_for_route():
    assert list(ATTENTION.to_dict()) == [
        "token_id",
        "position",
        "score",
        "layer",
        "step",
        "head",
        "rank",
        "token_type",
        "text",
    ]
    assert ROUTE.to_dict()["experts"] == [[3, 0.75], [0, 0.125]]


def test_optional_keys_may_be_absent():
    minimal = {"token_id": 1, "position": 0, "score": 1, "rank": 0, "token_type": "special"}
    record = TokenRecord.from_dict(minimal)
    assert (record.layer, record.step, record.head, record.text, record.experts) == (None,) * 5
    assert isinstance(record.score, float) and record.token_type in TOKEN_TYPES


@pytest.mark.parametrize("key", ["token_id", "position", "score", "rank", "token_type"])
def test_missing_required_key_is_named(key):
    data = ATTENTION.to_dict()
    del data[key]
    with pytest.raises(RecordError, match=f"missing the key '{key}'"):
        TokenRecord.from_dict(data)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("token_id", "42", "'token_id' must be int, got str"),
        ("position", True, "'position' must be int, got bool"),
        ("score", "0.5", "'score' must be float, got str"),
        ("layer", 1.5, "'layer' must be int, got float"),
        ("text", 3, "'text' must be str, got int"),
        ("token_type", "input", "'token_type' must be one of"),
        ("experts", [[1]], "'experts' must be a list of"),
        ("experts", [["a", 0.1]], "'experts' must be a list of"),
        ("experts", {"1": 0.1}, "'experts' must be a list of"),
    ],
)
def test_mistyped_key_is_named(key, value, expected):
    with pytest.raises(RecordError, match=expected):
        TokenRecord.from_dict({**ATTENTION.to_dict(), key: value})


def test_not_a_mapping():
    with pytest.raises(RecordError, match="JSON object"):
        TokenRecord.from_dict([1, 2])  # type: ignore[arg-type]


def test_both_engines_write_the_same_sparsity_block():
    """One function writes the ``sparsity`` block: the own engine's and vLLM's records have the same keys."""
    import dataclasses

    from sparseety.engine.result import RunResult
    from sparseety.integrations.vllm.transport.record import VllmRun
    from sparseety.schema import SPARSITY_FIELDS, sparsity_json

    own = {f.name for f in dataclasses.fields(RunResult)}
    vllm = {f.name for f in dataclasses.fields(VllmRun)}
    assert set(SPARSITY_FIELDS) <= own  # the own engine has every field
    assert set(SPARSITY_FIELDS) - vllm == {"pruned_tokens", "prune"}  # vLLM prunes nothing: None

    class Run:
        policy, budget = "tova", 8

    block = sparsity_json(Run())
    assert tuple(block) == SPARSITY_FIELDS and block["budget"] == 8 and block["prune"] is None
