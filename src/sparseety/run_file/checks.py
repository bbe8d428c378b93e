"""Checks of a run configuration file's values that the command-line parsers would otherwise make,
so a bad value is reported with its key path and line, never under a flag's name."""

from __future__ import annotations

import re
from pathlib import Path

from sparseety.errors import ConfigError
from sparseety.run_file.sections import ExtractionSection, LoggingSection, SparsitySection

_FLAG_PREFIX = re.compile(r"^(--[a-z-]+|prune schedule|prune):\s*")


def check_values(sparsity: SparsitySection, extraction: ExtractionSection,
                 logging: LoggingSection) -> tuple[str, str] | None:
    """The first bad value as ``(key path, message)``; None when every value parses."""
    checks = (("extraction.layers", _layers, extraction), ("sparsity.token_pruning", _pruning, sparsity),
              ("sparsity.policy_opts", _policy_opts, sparsity), ("logging.output_file", _output_file, logging))
    for key, check, section in checks:
        try:
            check(section)  # type: ignore[operator]
        except ConfigError as exc:
            return key, _FLAG_PREFIX.sub("", str(exc))
    return None


def _layers(extraction: ExtractionSection) -> None:
    from sparseety.engine.layers import parse_layers

    layers = extraction.layers
    if layers is not None:
        parse_layers(layers)


def _pruning(sparsity: SparsitySection) -> None:
    from sparseety.prune_schedule import parse_prune_schedule

    if isinstance(sparsity.token_pruning, str):
        parse_prune_schedule(sparsity.token_pruning)


def _policy_opts(sparsity: SparsitySection) -> None:
    from sparseety.policies.registry import build_policy, get_policy_class, policy_options

    if not sparsity.policy_opts or sparsity.policy is None:
        return
    known = policy_options(get_policy_class(sparsity.policy))
    for key in sparsity.policy_opts:
        if key not in known:
            raise ConfigError(f"policy {sparsity.policy} has no option {key!r}; valid options: "
                              f"{', '.join(known) or 'none'}")
    try:
        build_policy(sparsity.policy, sparsity.kv_cache_limit or 1, dict(sparsity.policy_opts))
    except (ConfigError, ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def _output_file(logging: LoggingSection) -> None:
    name = logging.output_file
    if name is None:
        return
    if not name.strip():
        raise ConfigError("is empty; give a file name")
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give a file name")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{parent} is a file, not a folder")
