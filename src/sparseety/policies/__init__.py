"""KV policies: one file each, a registry, and the shared selection rule."""

from sparseety.policies.base import Observation, Policy, Signal, select_keep
from sparseety.policies.registry import (
    build_policy,
    get_policy_class,
    list_policies,
    parse_policy_opts,
    policy_options,
    resolve_budget,
    sized_policy,
)

__all__ = [
    "Observation",
    "Policy",
    "Signal",
    "build_policy",
    "get_policy_class",
    "list_policies",
    "parse_policy_opts",
    "policy_options",
    "resolve_budget",
    "select_keep",
    "sized_policy",
]
