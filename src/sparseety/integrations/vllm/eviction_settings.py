"""``SPARSEETY_KV_*`` and the per-request ``sparseety_*`` args: which eviction policy runs inside vLLM's paged KV
cache, parsed and checked once.

Unset ``SPARSEETY_KV_POLICY`` means vLLM runs exactly as without SparSEEty. ``dense`` installs the hooks with
no eviction by default, so single requests can ask for one (``vllm_xargs`` ``sparseety_policy``,
``sparseety_budget`` / ``sparseety_ratio``, ``sparseety_policy_opts``). A set but bad variable is a
:class:`~sparseety.errors.ConfigError` naming it: vLLM's engine core refuses to start with it (a silent dense run
would look like a working eviction). Options are checked by the own engine's policy registry, so
``SPARSEETY_KV_POLICY_OPTS='sinks=8'`` means what ``--policy-opt sinks=8`` means. The registry (and torch) is
imported only when eviction is asked for: the observer's import path stays torch-free.

A policy runs inside vLLM when every layer keeps the same number of slots per KV head (one block table serves
the group) and what it scores is there: positions, keys, values, attention rows and the hidden states entering
the layer's attention (:func:`vllm_refusal` says why not otherwise). A policy's vLLM variant
(:data:`VLLM_DEFAULTS`: ``kvzap`` keeps one count per layer, ``per_head=false``) applies unless its options say
otherwise. A policy that reads the model (``kvzap``'s surrogate) is bound to the served checkpoint
(:func:`checkpoint_model`), so a missing surrogate refuses at start.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseety.errors import ConfigError

POLICY_ARG, BUDGET_ARG, RATIO_ARG, OPTS_ARG = "sparseety_policy", "sparseety_budget", "sparseety_ratio", \
    "sparseety_policy_opts"  #: the per-request ``vllm_xargs``
_SIGNALS_IN_VLLM = ("none", "last_row", "window", "colsum")
#: options a policy takes inside vLLM unless given: one block table per KV-cache group keeps one count per layer
VLLM_DEFAULTS: dict[str, dict[str, Any]] = {"kvzap": {"per_head": False}}


def vllm_refusal(policy: Any, num_layers: int = 32) -> str | None:
    """Why ``policy`` (a built :class:`~sparseety.policies.base.Policy`) cannot evict inside vLLM, or None."""
    name = policy.name
    if not policy.evicts or policy.attends_topk:
        return f"{name} deletes no keys (it is not an eviction policy)"
    if policy.reconstructs:
        return f"{name} scores from a reconstruction pass of its own, which vLLM's scheduler cannot run"
    if policy.needs_token_ids or policy.query_rows() > 0:
        return f"{name} reads token ids or query rows of earlier steps, which are not captured inside vLLM yet"
    if policy.shares_budget or policy.splits_heads:
        return (f"{name} with these options gives layers or KV heads different budgets; a vLLM KV-cache group "
                "keeps one count per layer (kvzap: per_head=false share=false)")
    budgets = {policy.layer_budget(layer, num_layers) for layer in range(num_layers)}
    if len(budgets) > 1:
        return f"{name} gives layers different budgets; a vLLM KV-cache group keeps one count per layer"
    for signal in (policy.prefill_signal, policy.decode_signal):
        if signal.value not in _SIGNALS_IN_VLLM:
            return f"{name} needs the {signal.value} signal, which is not computed inside vLLM"
    return None


@dataclass(frozen=True)
class EvictionSettings:
    """What to evict inside vLLM: ``policy`` with ``budget`` tokens per layer (or ``ratio`` of the prompt
    removed), compacted every ``interval`` tokens (``None``: one KV block)."""

    policy: str
    budget: int | None = None
    ratio: float | None = None
    interval: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def for_request(self, extra: Mapping[str, Any] | None, prompt_tokens: int,
                    model: str | None = None) -> RequestEviction | None:
        """What one request evicts: these settings, or what its ``vllm_xargs`` ask (None: it runs dense).
        Raises :class:`ConfigError` naming the arg when they ask for something that cannot run (``model``:
        the served checkpoint's directory, to bind a policy that reads the model)."""
        extra = extra or {}
        asked = {k for k in (POLICY_ARG, BUDGET_ARG, RATIO_ARG, OPTS_ARG) if extra.get(k) is not None}
        policy = str(extra.get(POLICY_ARG) or self.policy).strip()
        if policy == "dense":
            if asked - {POLICY_ARG}:
                raise ConfigError(f"{', '.join(sorted(asked - {POLICY_ARG}))} without {POLICY_ARG}: this server "
                                  "evicts nothing unless a request names a policy")
            return None
        budget = _positive_int(extra.get(BUDGET_ARG), BUDGET_ARG)
        ratio = _ratio(extra.get(RATIO_ARG), RATIO_ARG)
        if budget is None and ratio is None:  # the server's budget
            budget, ratio = self.budget, self.ratio
        if OPTS_ARG in asked:
            raw = extra[OPTS_ARG]
            options = dict(raw) if isinstance(raw, Mapping) else _options(str(raw), OPTS_ARG)
        else:
            options = self.options if policy == self.policy else {}
        if (budget is None) == (ratio is None):
            raise ConfigError(f"{POLICY_ARG}={policy} needs exactly one of {BUDGET_ARG} or {RATIO_ARG}")
        return checked(policy, budget, ratio, options, prompt_tokens, arg=POLICY_ARG, model=model)


@dataclass(frozen=True)
class RequestEviction:
    """One request's eviction: ``policy`` (its registry name) keeping ``budget`` slots per layer and KV head."""

    policy: str
    budget: int
    options: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple[str, int, str]:
        return self.policy, self.budget, json.dumps(self.options, sort_keys=True, default=str)

    def as_list(self) -> list:
        """How it travels to the worker."""
        return [self.policy, self.budget, self.options]


def checked(policy: str, budget: int | None, ratio: float | None, options: dict[str, Any], prompt_tokens: int,
            arg: str = "SPARSEETY_KV_POLICY", model: str | None = None) -> RequestEviction:
    """The eviction of a request with ``prompt_tokens`` prompt tokens, its policy built and checked for vLLM
    (with its :data:`VLLM_DEFAULTS`), and bound to the checkpoint in ``model`` when given."""
    from sparseety.policies.registry import build_policy, resolve_budget

    options = {**VLLM_DEFAULTS.get(policy, {}), **options}
    try:
        resolved = resolve_budget(budget, ratio, max(prompt_tokens, 1))
        built = build_policy(policy, resolved, options)
    except ConfigError as exc:
        raise ConfigError(f"{arg}: {exc}") from None
    refusal = vllm_refusal(built)
    if refusal is not None:
        raise ConfigError(f"{arg}={policy!r} cannot run inside vLLM: {refusal}")
    if model:
        try:
            built.bind(checkpoint_model(model))
        except ConfigError as exc:
            raise ConfigError(f"{arg}={policy!r}: {exc}") from None
    assert resolved is not None
    return RequestEviction(policy, int(resolved), options)


@functools.cache
def checkpoint_model(path: str) -> Any:
    """The :class:`~sparseety.policies.base.ModelInfo` of the Hugging Face checkpoint vLLM serves from ``path``
    (its ``config.json``; the fingerprint from its files, computed once when a policy asks)."""
    from pathlib import Path

    from transformers import AutoConfig

    from sparseety.fingerprint import checkpoint_fingerprint
    from sparseety.policies.base import ModelInfo

    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    return ModelInfo(name=Path(path).name, num_layers=int(text.num_hidden_layers),
                     kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                     head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                     vocab_size=getattr(text, "vocab_size", None),
                     fingerprint=functools.cache(functools.partial(checkpoint_fingerprint, path)))


def _positive_int(raw: Any, name: str) -> int | None:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 1 or (isinstance(raw, float) and raw != value):
        raise ConfigError(f"{name}={raw!r} is not an integer >= 1")
    return value


def _ratio(raw: Any, name: str) -> float | None:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r} is not a number in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}={raw!r} is not a number in [0, 1)")
    return value


def parse_eviction(env: Mapping[str, str] | None = None) -> EvictionSettings | None:
    """The eviction asked for in ``env`` (default ``os.environ``), or None: vLLM runs as without SparSEEty.
    Raises :class:`ConfigError` naming the variable and what is allowed."""
    env = os.environ if env is None else env
    policy = (env.get("SPARSEETY_KV_POLICY") or "").strip()
    if policy == "":
        return None
    interval = _positive_int(env.get("SPARSEETY_KV_INTERVAL"), "SPARSEETY_KV_INTERVAL")
    if policy == "dense":
        return EvictionSettings("dense", interval=interval)
    budget = _positive_int(env.get("SPARSEETY_KV_BUDGET"), "SPARSEETY_KV_BUDGET")
    ratio = None
    raw = env.get("SPARSEETY_KV_RATIO")
    if raw is not None and raw.strip():
        ratio = _ratio(raw, "SPARSEETY_KV_RATIO")
    if (budget is None) == (ratio is None):
        raise ConfigError(f"SPARSEETY_KV_POLICY={policy} needs exactly one of SPARSEETY_KV_BUDGET=N or "
                          "SPARSEETY_KV_RATIO=r")
    options = _options(env.get("SPARSEETY_KV_POLICY_OPTS") or "", "SPARSEETY_KV_POLICY_OPTS")
    checked(policy, budget, ratio, options, 1_000_000, arg="SPARSEETY_KV_POLICY")
    return EvictionSettings(policy, budget, ratio, interval, options)


def _options(raw: str, name: str) -> dict[str, Any]:
    """``key=value`` pairs separated by commas or spaces, or a JSON object."""
    raw = raw.strip()
    if not raw:
        return {}
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} is not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a JSON object or key=value pairs")
        return value
    from sparseety.policies.registry import parse_policy_opts

    return dict(parse_policy_opts(raw.replace(",", " ").split(), flag=name))
