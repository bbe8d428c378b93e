"""The observer's ``SPARSEETY_*`` settings, parsed and checked in one place when it loads inside vLLM.

A bad setting never stops vLLM: :func:`parse_settings` never raises. It names each bad variable, its
value and what is allowed in :attr:`Settings.problems`, puts the default in its place and turns tracing
off (nothing is written to the store). The ``sparseety:`` metrics stay on: they depend on none of these
settings, except the KV-block counts, which need a valid ``SPARSEETY_KV_EVENTS`` (a bad one turns the
KV-event subscription off too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.transport.values import decimal_int, decimal_number, shown

TIERS = (1, 2, 3)  #: 3: sampled requests also store per-step importance (``step_importance``)
MAX_QUEUE = 1_000_000
KV_SCHEMES = ("tcp://", "ipc://", "inproc://")
TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """What the observer runs with; ``problems`` lists the bad settings (tracing is then off)."""

    trace_dir: str | None = None
    sample_rate: float = 1.0
    tier: int = 2
    queue_size: int = 4096
    kv_endpoint: str | None = None  #: ``off``, an endpoint, or None: the one vLLM's config names
    redact: bool = False  #: ``SPARSEETY_REDACT``: secrets in stored text become typed placeholders
    ids_only: bool = False  #: ``SPARSEETY_IDS_ONLY``: token ids, no text at all (nothing is decoded)
    problems: tuple[str, ...] = ()

    @property
    def message(self) -> str | None:
        """The one log line that reports the problems (None when there are none)."""
        if not self.problems:
            return None
        return "sparseety: " + "; ".join(self.problems) + "; tracing is off"


def check_trace_dir(path: str) -> str | None:
    """Why ``path`` cannot hold traces (None when it can): the shared output check
    (:func:`sparseety.output_paths.check_output`), then the folder is created."""
    from sparseety.errors import InputError
    from sparseety.output_paths import DIRECTORY, check_output

    name = f"SPARSEETY_TRACE_DIR={path!r}"
    try:
        check_output(path, DIRECTORY, "SPARSEETY_TRACE_DIR", name=name)
        os.makedirs(path, exist_ok=True)
    except InputError as e:
        return str(e)
    except OSError as e:
        return f"{name} cannot be created ({e.strerror or e})"
    return None


def parse_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings in ``env`` (default ``os.environ``); never raises (see :class:`Settings`)."""
    env = os.environ if env is None else env
    problems: list[str] = []
    defaults = Settings()

    def bad(var: str, value: str, allowed: str) -> None:
        problems.append(f"{var}={shown(value)} is not {allowed}")

    sample_rate = defaults.sample_rate
    raw = env.get("SPARSEETY_SAMPLE_RATE")
    if raw is not None:
        try:
            sample_rate = decimal_number(raw, "SPARSEETY_SAMPLE_RATE", 0.0, 1.0)
        except ConfigError:
            bad("SPARSEETY_SAMPLE_RATE", raw, "a number in [0, 1]")
            sample_rate = defaults.sample_rate

    tier = defaults.tier
    raw = env.get("SPARSEETY_TIER")
    if raw is not None:
        if raw.strip() in {str(t) for t in TIERS}:
            tier = int(raw)
        else:
            bad("SPARSEETY_TIER", raw, "one of " + ", ".join(map(str, TIERS)))

    queue_size = defaults.queue_size
    raw = env.get("SPARSEETY_QUEUE_SIZE")
    if raw is not None:
        try:
            queue_size = decimal_int(raw, "SPARSEETY_QUEUE_SIZE", 1, MAX_QUEUE)
        except ConfigError:
            bad("SPARSEETY_QUEUE_SIZE", raw, f"an integer in [1, {MAX_QUEUE}]")
            queue_size = defaults.queue_size

    kv_endpoint = env.get("SPARSEETY_KV_EVENTS") or None
    if kv_endpoint is not None and kv_endpoint != "off" and not kv_endpoint.startswith(KV_SCHEMES):
        bad("SPARSEETY_KV_EVENTS", kv_endpoint, "'off' or a tcp://, ipc:// or inproc:// endpoint")
        kv_endpoint = "off"

    flags = {}
    for var in ("SPARSEETY_REDACT", "SPARSEETY_IDS_ONLY"):
        raw = env.get(var)
        flags[var] = False
        if raw is not None and raw.strip().lower() in TRUE:
            flags[var] = True
        elif raw is not None and raw.strip().lower() not in FALSE:
            bad(var, raw, "one of " + ", ".join(TRUE + FALSE[1:]))

    trace_dir = env.get("SPARSEETY_TRACE_DIR") or None
    if trace_dir is not None:
        problem = check_trace_dir(trace_dir)
        if problem:
            problems.append(problem)
    return Settings(trace_dir=None if problems else trace_dir, sample_rate=sample_rate, tier=tier,
                    queue_size=queue_size, kv_endpoint=kv_endpoint, redact=flags["SPARSEETY_REDACT"],
                    ids_only=flags["SPARSEETY_IDS_ONLY"], problems=tuple(problems))
