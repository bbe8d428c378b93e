"""``SPARSEETY_KV_*``: which eviction policy runs inside vLLM's paged KV cache, parsed and checked once.

Unset ``SPARSEETY_KV_POLICY`` (or ``dense``) means vLLM runs exactly as without SparSEEty. A set but bad value
is a :class:`~sparseety.errors.ConfigError` naming the variable: vLLM's engine core refuses to start with it
(a silent dense run would look like a working eviction). Options are checked by the own engine's policy
registry, so ``SPARSEETY_KV_POLICY_OPTS='sinks=8'`` means what ``--policy-opt sinks=8`` means. The registry
(and torch) is imported only when eviction is asked for: the observer's import path stays torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseety.errors import ConfigError

#: policies that run inside vLLM today, and why the others do not yet
IN_VLLM = ("streaming",)
NOT_YET = ("needs scores from vLLM's attention (snapkv, tova, h2o) or the hidden states (kvzap) at the "
           "compaction; only position-based policies run inside vLLM so far")


@dataclass(frozen=True)
class EvictionSettings:
    """What to evict inside vLLM: ``policy`` with ``budget`` tokens per layer (or ``ratio`` of the prompt
    removed), compacted every ``interval`` tokens (``None``: one KV block)."""

    policy: str
    budget: int | None = None
    ratio: float | None = None
    interval: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def budget_for(self, prompt_tokens: int) -> int:
        """Tokens per layer kept for a request with ``prompt_tokens`` prompt tokens."""
        from sparseety.policies.registry import resolve_budget

        resolved = resolve_budget(self.budget, self.ratio, prompt_tokens)
        assert resolved is not None
        return resolved

    @property
    def sinks(self) -> int:
        """The first positions ``streaming`` never evicts."""
        from sparseety.policies.registry import build_policy

        return int(build_policy(self.policy, self.budget or 1_000_000, self.options).sinks)  # type: ignore[attr-defined]


def _int(env: Mapping[str, str], var: str, minimum: int) -> int | None:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{var}={raw!r} is not an integer >= {minimum}")
    return value


def parse_eviction(env: Mapping[str, str] | None = None) -> EvictionSettings | None:
    """The eviction asked for in ``env`` (default ``os.environ``), or None: vLLM runs dense.
    Raises :class:`ConfigError` naming the variable and what is allowed."""
    env = os.environ if env is None else env
    policy = (env.get("SPARSEETY_KV_POLICY") or "").strip()
    if policy in ("", "dense"):
        return None
    from sparseety.policies.registry import build_policy, resolve_budget

    if policy not in IN_VLLM:
        raise ConfigError(f"SPARSEETY_KV_POLICY={policy!r} cannot run inside vLLM; allowed: dense, "
                          f"{', '.join(IN_VLLM)} ({NOT_YET})")
    budget = _int(env, "SPARSEETY_KV_BUDGET", 1)
    interval = _int(env, "SPARSEETY_KV_INTERVAL", 1)
    ratio = None
    raw = env.get("SPARSEETY_KV_RATIO")
    if raw is not None and raw.strip():
        try:
            ratio = float(raw)
        except ValueError:
            raise ConfigError(f"SPARSEETY_KV_RATIO={raw!r} is not a number in [0, 1)") from None
    if (budget is None) == (ratio is None):
        raise ConfigError(f"SPARSEETY_KV_POLICY={policy} needs exactly one of SPARSEETY_KV_BUDGET=N or "
                          "SPARSEETY_KV_RATIO=r")
    options = _options(env.get("SPARSEETY_KV_POLICY_OPTS") or "")
    settings = EvictionSettings(policy, budget, ratio, interval, options)
    try:
        resolve_budget(budget, ratio, 1_000_000)
        build_policy(policy, budget or 1_000_000, options)
    except ConfigError as exc:
        raise ConfigError(f"SPARSEETY_KV_*: {exc}") from None
    return settings


def _options(raw: str) -> dict[str, Any]:
    """``key=value`` pairs separated by commas or spaces, or a JSON object."""
    raw = raw.strip()
    if not raw:
        return {}
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"SPARSEETY_KV_POLICY_OPTS is not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("SPARSEETY_KV_POLICY_OPTS must be a JSON object or key=value pairs")
        return value
    from sparseety.policies.registry import parse_policy_opts

    return dict(parse_policy_opts(raw.replace(",", " ").split(), flag="SPARSEETY_KV_POLICY_OPTS"))
