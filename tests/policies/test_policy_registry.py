"""``build_policy`` / ``resolve_budget``: clear errors for bad configuration, working defaults otherwise."""

from __future__ import annotations

import pytest

from sparseety.errors import ConfigError, SparseetyError
from sparseety.policies import (
    build_policy,
    list_policies,
    policy_options,
    resolve_budget,
)

EXPECTED = {"dense", "streaming", "h2o", "snapkv", "tova", "knorm", "random", "pyramid", "topk_attention", "kvzip", "learned"}
EXPECTED |= {"keydiff", "expected_attention", "compactor", "kvzap"}
BUDGETED = sorted(EXPECTED - {"dense"})


def test_registry_lists_every_policy_once():
    names = [cls.name for cls in list_policies()]
    assert sorted(names) == sorted(EXPECTED)
    assert all(cls.summary for cls in list_policies())


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        build_policy("h3o", 8)
    message = str(err.value)
    assert "h3o" in message
    assert all(name in message for name in EXPECTED)
    assert isinstance(err.value, SparseetyError)


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("budget", [0, -3])
def test_non_positive_budget_is_rejected(name, budget):
    with pytest.raises(ConfigError, match="budget"):
        build_policy(name, budget)


@pytest.mark.parametrize("name", BUDGETED)
def test_budgeted_policies_need_a_budget(name):
    with pytest.raises(ConfigError, match="budget"):
        build_policy(name, None)


def test_non_integer_budget_is_rejected():
    with pytest.raises(ConfigError):
        build_policy("h2o", 2.5)


def test_dense_needs_no_budget():
    assert build_policy("dense").budget is None


def test_streaming_budget_below_sinks_is_rejected():
    with pytest.raises(ConfigError, match="sinks"):
        build_policy("streaming", 3)  # default sinks 4
    with pytest.raises(ConfigError, match="sinks"):
        build_policy("streaming", 6, {"sinks": "8"})
    assert build_policy("streaming", 4).budget == 4
    assert build_policy("streaming", 1, {"sinks": "0"}).sinks == 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unknown_option_names_the_valid_keys(name):
    with pytest.raises(ConfigError) as err:
        build_policy(name, 8, {"windw": "4"})
    message = str(err.value)
    assert "windw" in message
    for key in policy_options(type(build_policy(name, 8))):
        assert key in message


def test_options_are_converted_from_strings_and_validated():
    policy = build_policy("snapkv", 16, {"window": "8", "kernel": "3"})
    assert (policy.window, policy.kernel) == (8, 3)
    assert build_policy("h2o", 16, {"recent_ratio": "0.25"}).recent_ratio == 0.25
    assert build_policy("pyramid", 16, {"beta": "10"}).params()["beta"] == 10
    for name, opts in (("snapkv", {"window": "eight"}), ("snapkv", {"window": "0"}), ("snapkv", {"kernel": "0"}),
                       ("h2o", {"recent_ratio": "1.0"}), ("h2o", {"recent_ratio": "-0.1"}),
                       ("pyramid", {"beta": "0"}), ("streaming", {"sinks": "-1"})):
        with pytest.raises(ConfigError):
            build_policy(name, 16, opts)


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.1, -1.0])
def test_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(ConfigError, match="ratio"):
        resolve_budget(None, ratio, 100)


def test_resolve_budget():
    assert resolve_budget(None, 0.0, 100) == 100
    assert resolve_budget(None, 0.75, 100) == 25
    assert resolve_budget(None, 0.5, 7) == 3  # int(n * (1 - r)), as kvpress's compression_ratio
    assert resolve_budget(None, 0.99, 10) == 1  # never zero
    assert resolve_budget(64, None, 100) == 64
    assert resolve_budget(None, None, 100) is None
    with pytest.raises(ConfigError):
        resolve_budget(64, 0.5, 100)
    with pytest.raises(ConfigError, match="budget"):
        resolve_budget(0, None, 100)
