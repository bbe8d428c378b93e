"""``prune``: token pruning between decoder layers (dynamic token pruning, as in LazyLLM), composable with any KV policy.

A schedule ``"8:0.3,16:0.5"`` means: after layer 8, drop 30% of the prompt tokens still present; after
layer 16, another 50% of those left. Pruned tokens are absent from the hidden states of every later
layer, so those layers neither compute nor cache them. Only the prompt forward is pruned (in the
long-document protocol, the context forward); decode steps never are.

This module is the schedule only (its text, parsing, checks and the ``default``), on the ground floor
beside :mod:`sparseety.options` and the run files that read it; :mod:`sparseety.engine.prune` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparseety.errors import ConfigError, InputError

#: Options of ``--prune-opt key=value`` and their defaults.
PRUNE_OPTIONS: dict[str, int] = {"keep_recent": 8, "sinks": 4, "window": 1}


def prune_count(fraction: float, remaining: int) -> int:
    """Tokens one pruning point removes from ``remaining``: ``fraction * remaining`` rounded half up."""
    return int(fraction * remaining + 0.5)


@dataclass(frozen=True)
class PruneSchedule:
    """Where and how much to prune.

    Attributes
    ----------
    points : ``((layer, fraction), ...)`` with strictly increasing layers and fractions in ``[0, 1)``;
        after layer ``layer`` the lowest-scored ``fraction`` of the remaining prompt tokens is dropped.
    keep_recent : the last ``keep_recent`` prompt tokens are never pruned (the very last one never is).
    sinks : the first ``sinks`` positions are never pruned (attention sinks).
    window : last prompt rows whose attention scores the tokens (mean over rows and query heads).
    """

    points: tuple[tuple[int, float], ...]
    keep_recent: int = PRUNE_OPTIONS["keep_recent"]
    sinks: int = PRUNE_OPTIONS["sinks"]
    window: int = PRUNE_OPTIONS["window"]

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("prune schedule is empty; expected layer:fraction pairs such as 8:0.3,16:0.5")
        previous = -1
        for layer, fraction in self.points:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ConfigError(f"prune schedule: layer must be a non-negative integer, got {layer!r}")
            if layer <= previous:
                raise ConfigError(f"prune schedule: layers must be strictly increasing, got {layer} after {previous}")
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
                raise ConfigError(f"prune schedule: fraction after layer {layer} must be in [0, 1), got {fraction!r}")
            previous = layer
        for name, minimum in (("keep_recent", 0), ("sinks", 0), ("window", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"prune: {name} must be an integer >= {minimum}, got {value!r}")

    @property
    def layers(self) -> tuple[int, ...]:
        """The pruning layers, ascending."""
        return tuple(layer for layer, _ in self.points)

    def fraction_after(self, layer: int) -> float | None:
        """The fraction pruned after ``layer``, or None when ``layer`` is not a pruning point."""
        return dict(self.points).get(layer)

    def params(self) -> dict[str, Any]:
        """The schedule as plain data, for provenance and ``--json``."""
        return {"schedule": self.text(), "keep_recent": self.keep_recent, "sinks": self.sinks, "window": self.window}

    def text(self) -> str:
        """The schedule in ``--prune-schedule`` form."""
        return ",".join(f"{layer}:{fraction:g}" for layer, fraction in self.points)

    def check_layers(self, num_layers: int) -> None:
        """Raise :class:`ConfigError` unless every pruning layer is in ``0 .. num_layers - 2`` (a later layer must exist)."""
        for layer in self.layers:
            if layer > num_layers - 2:
                raise ConfigError(f"prune schedule: layer {layer} is outside 0..{num_layers - 2} "
                                  f"(the model has {num_layers} layers; pruning needs a later layer)")

    def check_prompt(self, prompt_len: int) -> list[int]:
        """Tokens left after each pruning point of a ``prompt_len``-token prompt (protected tokens aside).

        Raises :class:`InputError` when the schedule would leave no token.
        """
        remaining, left = prompt_len, []
        for layer, fraction in self.points:
            remaining -= prune_count(fraction, remaining)
            if remaining <= 0:
                raise InputError(f"prune schedule {self.text()!r} would leave no token of the {prompt_len}-token "
                                 f"prompt after layer {layer}")
            left.append(remaining)
        return left


def parse_prune_opts(items: list[str]) -> dict[str, str]:
    """Parse repeated ``--prune-opt key=value`` strings."""
    from sparseety.policies.registry import parse_policy_opts

    return parse_policy_opts(items, flag="--prune-opt")


#: The ``default`` schedule, in fractions of the model's depth: 0.3 at a quarter, 0.5 at half.
DEFAULT_PRUNE_DEPTHS = ((0.25, 0.3), (0.5, 0.5))


def default_prune_schedule(num_layers: int) -> str:
    """The ``default`` schedule for a model of ``num_layers`` layers, as schedule text."""
    return ",".join(f"{max(0, int(num_layers * depth) - 1)}:{fraction}" for depth, fraction in DEFAULT_PRUNE_DEPTHS)


def parse_prune_schedule(text: str, options: dict[str, Any] | None = None, num_layers: int = 30) -> PruneSchedule:
    """Parse ``"8:0.3,16:0.5"`` (or ``default``, resolved against ``num_layers``) plus options
    (``keep_recent``, ``sinks``, ``window``; strings are converted).

    Raises :class:`ConfigError` naming the malformed part.
    """
    if str(text).strip().lower() == "default":
        text = default_prune_schedule(num_layers)
    points: list[tuple[int, float]] = []
    for part in (p.strip() for p in str(text).split(",")):
        layer_text, sep, fraction_text = part.partition(":")
        if not sep:
            raise ConfigError(f"prune schedule: {part!r} is not layer:fraction (example: 8:0.3,16:0.5)")
        try:
            layer = int(layer_text.strip())
        except ValueError:
            raise ConfigError(f"prune schedule: layer {layer_text.strip()!r} in {part!r} is not an integer") from None
        try:
            fraction = float(fraction_text.strip())
        except ValueError:
            raise ConfigError(f"prune schedule: fraction {fraction_text.strip()!r} in {part!r} is not a number") from None
        points.append((layer, fraction))
    kwargs: dict[str, int] = {}
    for key, raw in (options or {}).items():
        if key not in PRUNE_OPTIONS:
            raise ConfigError(f"prune: unknown option {key!r}; valid options: {', '.join(PRUNE_OPTIONS)}")
        try:
            kwargs[key] = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"prune: option {key}={raw!r} is not a valid int") from None
    return PruneSchedule(tuple(points), **kwargs)
