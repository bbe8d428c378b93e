"""The policy registry: ``list_policies()``, ``get_policy_class()`` and ``build_policy()``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sparseety.errors import ConfigError
from sparseety.policies.base import BudgetTooSmall, Policy, check_finite
from sparseety.policies.compactor import CompactorPolicy
from sparseety.policies.dense import DensePolicy
from sparseety.policies.expected_attention import ExpectedAttentionPolicy
from sparseety.policies.h2o import H2OPolicy
from sparseety.policies.knorm import KnormPolicy
from sparseety.policies.keydiff import KeyDiffPolicy
from sparseety.policies.learned import LearnedPolicy
from sparseety.policies.kvzap import KVzapPolicy
from sparseety.policies.kvzip import KVzipPolicy
from sparseety.policies.pyramid import PyramidPolicy
from sparseety.policies.random_baseline import RandomPolicy
from sparseety.policies.snapkv import SnapKVPolicy
from sparseety.policies.streaming import StreamingPolicy
from sparseety.policies.topk_attention import TopKAttentionPolicy
from sparseety.policies.tova import TOVAPolicy
from sparseety.ratio import check_ratio

_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        DensePolicy, StreamingPolicy, H2OPolicy, SnapKVPolicy, TOVAPolicy, KnormPolicy,
        RandomPolicy, PyramidPolicy, TopKAttentionPolicy, LearnedPolicy,
        KVzipPolicy, KVzapPolicy,
        KeyDiffPolicy, ExpectedAttentionPolicy, CompactorPolicy,
    )
}


def list_policies() -> list[type[Policy]]:
    """Every registered policy class, in a stable order."""
    return list(_POLICIES.values())


def get_policy_class(name: str) -> type[Policy]:
    """Look a policy up by name; unknown names raise :class:`ConfigError` listing the valid ones."""
    try:
        return _POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; valid policies: {', '.join(_POLICIES)}") from None


def policy_options(cls: type[Policy]) -> dict[str, Any]:
    """The option names of a policy (without ``budget``) and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "budget"}


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text (a string)"}


def _coerce(policy: str, key: str, raw: Any, default: Any) -> Any:
    """``raw`` as the option's type (the type of its default): a string is parsed; a value that is already
    typed (a run file's, a request's) must be of that type. A float option is refused as NaN or infinite."""
    kind = type(default)
    if not isinstance(raw, str):
        fits = (default is None or (kind is bool and isinstance(raw, bool))
                or (kind is int and isinstance(raw, int) and not isinstance(raw, bool))
                or (kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool)))
        if not fits:
            raise ConfigError(f"{policy}: option {key} must be {_KIND_WORDS.get(kind, kind.__name__)}, got "
                              f"{type(raw).__name__} {raw!r}")
        value = raw
    else:
        try:
            if kind is bool:
                if raw.lower() not in {"true", "false", "1", "0"}:
                    raise ValueError(raw)
                return raw.lower() in {"true", "1"}
            value = kind(raw) if default is not None else raw
        except ValueError:
            raise ConfigError(f"{policy}: option {key}={raw!r} is not a valid {kind.__name__}") from None
    check_finite(policy, f"option {key}", value)
    return value


def parse_policy_opts(items: list[str], flag: str = "--policy-opt") -> dict[str, str]:
    """Parse repeated ``key=value`` strings given with ``flag``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def resolve_budget(budget: int | None, ratio: float | None, context_len: int) -> int | None:
    """Turn ``--budget`` or ``--ratio`` (fraction removed, kvpress's ``compression_ratio``) into slots per head."""
    if budget is not None and ratio is not None:
        raise ConfigError("give either --budget or --ratio, not both")
    if ratio is not None:
        check_ratio(ratio)
        return max(1, int(context_len * (1 - ratio)))
    if budget is not None and budget <= 0:
        raise ConfigError(f"budget must be a positive integer, got {budget}")
    return budget


def sized_policy(name: str, budget: int | None, ratio: float | None, context_len: int,
                 options: dict[str, Any] | None = None) -> Policy:
    """:func:`build_policy` with the budget :func:`resolve_budget` gives on ``context_len`` tokens; a ratio
    that leaves fewer slots than the policy must hold is refused naming the ratio, not a budget."""
    resolved = resolve_budget(budget, ratio, context_len)
    try:
        return build_policy(name, resolved, options)
    except BudgetTooSmall as exc:
        if ratio is None or resolved is None:
            raise
        if exc.minimum <= context_len:
            advice = f"use a ratio of at most {math.floor((1 - exc.minimum / context_len) * 1000) / 1000}"
        else:
            advice = f"no ratio leaves that many: give a budget of at least {exc.minimum}"
        raise ConfigError(f"ratio {ratio} leaves {resolved} of the prompt's {context_len} tokens per layer and KV "
                          f"head, fewer than the {exc.minimum} {name} must hold ({exc.why}); {advice}") from None


def policy_kwargs(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``options`` checked against the policy's option names and converted to their types (strings are parsed)."""
    known = policy_options(get_policy_class(name))
    kwargs: dict[str, Any] = {}
    for key, raw in (options or {}).items():
        if key not in known:
            valid = ", ".join(known) or "none"
            raise ConfigError(f"{name}: unknown option {key!r}; valid options: {valid}")
        kwargs[key] = _coerce(name, key, raw, known[key])
    return kwargs


def build_policy(name: str, budget: int | None = None, options: dict[str, Any] | None = None) -> Policy:
    """Instantiate a policy with a budget and options (strings are converted to the option's type)."""
    cls = get_policy_class(name)
    kwargs = policy_kwargs(name, options)
    if cls.needs_budget(kwargs):
        if budget is None:
            raise ConfigError(f"policy {name!r} needs --budget N or --ratio R")
    return cls(budget=budget, **kwargs)
