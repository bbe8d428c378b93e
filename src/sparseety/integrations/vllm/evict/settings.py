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

import difflib
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.transport.values import BadValue, clipped, decimal_int, decimal_number, is_blank, shown

POLICY_ARG, BUDGET_ARG, RATIO_ARG, OPTS_ARG = "sparseety_policy", "sparseety_budget", "sparseety_ratio", \
    "sparseety_policy_opts"  #: the per-request ``vllm_xargs``
EVICTION_ARGS = (POLICY_ARG, BUDGET_ARG, RATIO_ARG, OPTS_ARG)
MAX_BUDGET = 10**9  #: the largest budget or interval accepted (a larger one is a typo, and would not serialise)
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
        Raises :class:`~.strict_values.BadValue` naming the arg when they ask for something that cannot run
        (``model``: the served checkpoint's directory, to bind a policy that reads the model)."""
        extra = extra or {}
        asked = [k for k in EVICTION_ARGS if not is_blank(extra.get(k))]
        raw_policy = extra.get(POLICY_ARG)
        policy = self.policy if is_blank(raw_policy) else policy_name(raw_policy, POLICY_ARG)
        if policy == "dense":
            given = [k for k in asked if k != POLICY_ARG]
            if given:
                why = ("dense keeps every token" if POLICY_ARG in asked else
                       f"this server evicts only for requests that name {POLICY_ARG}")
                raise BadValue(given[0], f"{given[0]}={shown(extra[given[0]])} is not used without an evicting "
                               f"{POLICY_ARG} ({why})")
            return None
        budget = None if is_blank(extra.get(BUDGET_ARG)) else decimal_int(extra[BUDGET_ARG], BUDGET_ARG, 1, MAX_BUDGET)
        ratio = None if is_blank(extra.get(RATIO_ARG)) else _ratio(extra[RATIO_ARG], RATIO_ARG)
        if budget is not None and ratio is not None:
            raise BadValue(RATIO_ARG, f"{BUDGET_ARG} and {RATIO_ARG} were both given: give one of them")
        if budget is None and ratio is None:  # the server's budget
            budget, ratio = self.budget, self.ratio
        if OPTS_ARG in asked:
            options = options_of(extra[OPTS_ARG], OPTS_ARG)
        else:
            options = self.options if policy == self.policy else {}
        if budget is None and ratio is None:
            raise BadValue(BUDGET_ARG, f"{POLICY_ARG}={policy} needs {BUDGET_ARG} or {RATIO_ARG} (this server has "
                           "no SPARSEETY_KV_BUDGET or SPARSEETY_KV_RATIO to fall back on)")
        return checked(policy, budget, ratio, options, prompt_tokens, arg=POLICY_ARG, model=model)


@dataclass(frozen=True)
class RequestEviction:
    """One request's eviction: ``policy`` (its registry name) keeping ``budget`` slots per layer and KV head."""

    policy: str
    budget: int
    options: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple[str, int, str]:
        return self.policy, self.budget, json.dumps(self.options, sort_keys=True, default=str)


def checked(policy: str, budget: int | None, ratio: float | None, options: dict[str, Any], prompt_tokens: int,
            arg: str = "SPARSEETY_KV_POLICY", model: str | None = None) -> RequestEviction:
    """The eviction of a request with ``prompt_tokens`` prompt tokens, its policy built and checked for vLLM
    (with its :data:`VLLM_DEFAULTS`), and bound to the checkpoint in ``model`` when given. Raises
    :class:`~.strict_values.BadValue` naming ``arg``."""
    from sparseety.policies.registry import build_policy, resolve_budget

    options = {**VLLM_DEFAULTS.get(policy, {}), **options}
    try:
        resolved = resolve_budget(budget, ratio, max(prompt_tokens, 1))
        built = build_policy(policy, resolved, options)
    except ConfigError as exc:
        raise BadValue(arg, f"{arg}={policy}: {clipped(str(exc), 400)}") from None
    refusal = vllm_refusal(built)
    if refusal is not None:
        raise BadValue(arg, f"{arg}={policy!r} cannot run inside vLLM: {refusal}")
    if model:
        try:
            built.bind(checkpoint_model(model))
        except ConfigError as exc:
            raise BadValue(arg, f"{arg}={policy!r}: {exc}") from None
    assert resolved is not None
    return RequestEviction(policy, int(resolved), options)


def policy_name(raw: Any, arg: str) -> str:
    """``raw`` as a registered policy's name, or :class:`~.strict_values.BadValue` listing those that run inside
    vLLM (``dense`` among them)."""
    from sparseety.policies.registry import list_policies

    name = raw.strip() if isinstance(raw, str) else None
    if name is None or name not in {cls.name for cls in list_policies()} | {"dense"}:
        near = difflib.get_close_matches(name or "", vllm_policies(), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise BadValue(arg, f"{arg}={shown(raw)} is not a policy that runs inside vLLM{hint}: one of "
                       f"{', '.join(vllm_policies())}")
    return name


@functools.cache
def vllm_policies() -> tuple[str, ...]:
    """The registered policies that can evict inside vLLM (with their vLLM variant and a budget of 64), and dense."""
    from sparseety.policies.registry import build_policy, list_policies

    names = []
    for cls in list_policies():
        try:
            if vllm_refusal(build_policy(cls.name, 64, VLLM_DEFAULTS.get(cls.name, {}))) is None:
                names.append(cls.name)
        except Exception:  # a policy that cannot be built with a budget alone does not run here
            continue
    return ("dense", *names)


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


def _ratio(raw: Any, name: str) -> float:
    return decimal_number(raw, name, 0.0, 1.0, high_open=True)


def parse_eviction(env: Mapping[str, str] | None = None) -> EvictionSettings | None:
    """The eviction asked for in ``env`` (default ``os.environ``), or None: vLLM runs as without SparSEEty.
    Raises :class:`~.strict_values.BadValue` naming the variable and what is allowed. With ``dense``,
    ``SPARSEETY_KV_BUDGET`` / ``SPARSEETY_KV_RATIO`` are the default of requests that name a policy."""
    env = os.environ if env is None else env
    raw_policy = env.get("SPARSEETY_KV_POLICY")
    if is_blank(raw_policy):
        return None
    policy = policy_name(raw_policy, "SPARSEETY_KV_POLICY")
    raw = env.get("SPARSEETY_KV_INTERVAL")
    interval = None if is_blank(raw) else decimal_int(raw, "SPARSEETY_KV_INTERVAL", 1, MAX_BUDGET)
    raw = env.get("SPARSEETY_KV_BUDGET")
    budget = None if is_blank(raw) else decimal_int(raw, "SPARSEETY_KV_BUDGET", 1, MAX_BUDGET)
    raw = env.get("SPARSEETY_KV_RATIO")
    ratio = None if is_blank(raw) else _ratio(raw, "SPARSEETY_KV_RATIO")
    if budget is not None and ratio is not None:
        raise BadValue("SPARSEETY_KV_RATIO", "SPARSEETY_KV_BUDGET and SPARSEETY_KV_RATIO are both set: set one of them")
    options = options_of(env.get("SPARSEETY_KV_POLICY_OPTS") or "", "SPARSEETY_KV_POLICY_OPTS")
    if policy == "dense":
        if options:
            raise BadValue("SPARSEETY_KV_POLICY_OPTS", "SPARSEETY_KV_POLICY_OPTS is not used with "
                           "SPARSEETY_KV_POLICY=dense (a request gives its policy's options in sparseety_policy_opts)")
        return EvictionSettings("dense", budget, ratio, interval)
    if budget is None and ratio is None:
        raise BadValue("SPARSEETY_KV_BUDGET", f"SPARSEETY_KV_POLICY={policy} needs SPARSEETY_KV_BUDGET=N or "
                       "SPARSEETY_KV_RATIO=r")
    checked(policy, budget, ratio, options, 1_000_000, arg="SPARSEETY_KV_POLICY")
    return EvictionSettings(policy, budget, ratio, interval, options)


def options_of(raw: Any, name: str) -> dict[str, Any]:
    """A policy's options: ``key=value`` pairs separated by commas or spaces, a JSON object in a text, or (from
    Python) a mapping; :class:`~.strict_values.BadValue` naming ``name`` otherwise."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str):
        raise BadValue(name, f"{name}={shown(raw)} is not key=value pairs or a JSON object in a string")
    text = raw.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadValue(name, f"{name}={shown(raw)} is not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise BadValue(name, f"{name}={shown(raw)} is not a JSON object")
        return value
    from sparseety.policies.registry import parse_policy_opts

    try:
        return dict(parse_policy_opts(text.replace(",", " ").split(), flag=name))
    except ConfigError as exc:
        raise BadValue(name, clipped(str(exc), 200)) from None
