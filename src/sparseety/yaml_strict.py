"""YAML for configuration files: safe loading that refuses a key given twice in one mapping, and the
line of a key path (for error messages)."""

from __future__ import annotations

from typing import Any

import yaml

from sparseety.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises on a duplicate mapping key instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise ConfigError(f"duplicate key {key!r} at line {line} (first given at line {first}): "
                                  "give each key once")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (from ``source``, for messages) safely; a duplicate key is a :class:`ConfigError`.

    Raises
    ------
    ConfigError
        Malformed YAML, or a key given twice in one mapping (both lines named).
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read config {source}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"cannot read config {source}: nested too deeply") from None


def line_of(text: str, loc: list[str]) -> int | None:
    """1-based line of the key at ``loc`` in the YAML ``text`` (None when not found)."""
    try:
        node = yaml.compose(text)
    except (yaml.YAMLError, RecursionError):
        return None
    line = None
    for part in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == part:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            break
    return line
