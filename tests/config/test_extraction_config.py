"""ExtractionConfig validation and YAML loading."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sparseety.config import ExtractionConfig
from sparseety.errors import ConfigError


def test_defaults():
    cfg = ExtractionConfig()
    assert (cfg.score_type, cfg.layout, cfg.top_k, cfg.min_score, cfg.experts_k) == ("attention", None, 16, 0.05, 2)
    assert (cfg.head_reduce, cfg.query_reduce, cfg.normalize, cfg.token_offset) == ("mean", "sum", "max", 0)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("score_type", "logits", "'attention', 'route' or 'activation'"),
        ("layout", "bqhk", "'bhqk', 'hqk', 'qk', 'bhkq', 'hkq' or 'kq'"),
        ("head_reduce", "sum", "'mean', 'max' or 'none'"),
        ("query_reduce", "min", "'sum', 'mean', 'max' or 'last'"),
        ("route_input", "softmax", "'probs' or 'logits'"),
        ("activation_reduce", "l1", "'maxabs', 'l2' or 'nonzero_frac'"),
        ("normalize", "softmax", "'l2', 'l1', 'max' or 'none'"),
        ("top_k", 0, "greater than 0"),
        ("top_k", -3, "greater than 0"),
        ("top_k", 2.5, "valid integer"),
        ("top_k", True, "valid integer"),
        ("min_score", 1.0, "less than 1"),
        ("min_score", -0.01, "greater than or equal to 0"),
        ("min_score", "0.1", "valid number"),
        ("min_score", float("nan"), "less than 1"),
        ("experts_k", 0, "greater than 0"),
        ("token_offset", -1, "greater than or equal to 0"),
        ("batch_index", -1, "greater than or equal to 0"),
        ("zero_eps", -1e-3, "greater than or equal to 0"),
        ("exclude_special", "yes", "valid boolean"),
        ("special_ids", [1, "x"], "valid integer"),
    ],
)
def test_invalid_values_name_the_field_and_what_it_accepts(field, value, allowed):
    with pytest.raises(ConfigError) as info:
        ExtractionConfig(**{field: value})
    assert f"{field}" in str(info.value) and allowed in str(info.value)


def test_unknown_keys_are_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown key 'topk' \(known keys: score_type, layout"):
        ExtractionConfig(topk=3)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="applies to attention only"):
        ExtractionConfig(score_type="route", layout="qk")
    with pytest.raises(ConfigError, match="special_ids is empty"):
        ExtractionConfig(exclude_special=True)
    assert ExtractionConfig(exclude_special=True, special_ids=[0, 2]).special_ids == (0, 2)


def test_frozen():
    with pytest.raises(ValidationError, match="frozen"):
        ExtractionConfig().top_k = 3  # type: ignore[misc]


def test_from_yaml(tmp_path):
    path = tmp_path / "extraction.yaml"
    path.write_text("score_type: route\nexperts_k: 3\nmin_score: 0\nspecial_ids: [0, 1]\n")
    cfg = ExtractionConfig.from_yaml(path)
    assert (cfg.score_type, cfg.experts_k, cfg.min_score, cfg.special_ids) == ("route", 3, 0.0, (0, 1))
    assert cfg.model_dump(exclude_unset=True) == {
        "score_type": "route",
        "experts_k": 3,
        "min_score": 0,
        "special_ids": (0, 1),
    }
    (tmp_path / "empty.yaml").write_text("")
    assert ExtractionConfig.from_yaml(tmp_path / "empty.yaml") == ExtractionConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("top_k: 3\nfoo: 1\n", "unknown key 'foo'"),
        ("top_k: [1\n", "cannot read config"),
        ("- 1\n- 2\n", "must be a mapping"),
        ("top_k: 0\n", "top_k must be greater than 0"),
    ],
)
def test_bad_yaml(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        ExtractionConfig.from_yaml(path)
    assert str(path) in str(info.value)


def test_missing_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        ExtractionConfig.from_yaml(tmp_path / "nope.yaml")
