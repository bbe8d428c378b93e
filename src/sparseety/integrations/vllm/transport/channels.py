"""The ZMQ channels between vLLM's processes: the scheduler-to-observer channel each API server binds, and the
workers' importance endpoint beside it."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable

CHANNEL_ENV = "SPARSEETY_VLLM_CHANNEL"


def channel() -> str:
    """The scheduler-to-observer channel, chosen by the first process that registers."""
    if CHANNEL_ENV not in os.environ:
        name = f"sparseety-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        os.environ[CHANNEL_ENV] = "ipc://" + os.path.join(tempfile.gettempdir(), name)
    return os.environ[CHANNEL_ENV]


def client_channel(client: int, base: str | None = None) -> str:
    """The channel API server ``client`` binds (vLLM's client index): the base channel for 0, else
    ``<base>-c<client>.sock`` beside it."""
    base = base if base is not None else channel()
    if client <= 0:
        return base
    return (base[: -len(".sock")] if base.endswith(".sock") else base) + f"-c{client}.sock"


def importance_channel(channel: str) -> str:
    """The worker-to-observer importance endpoint next to the plugin's scheduler channel ``channel``."""
    return channel[: -len(".sock")] + "-importance.sock" if channel.endswith(".sock") else channel + "-importance"


def routing_channel(channel: str) -> str:
    """The worker-to-observer MoE routing endpoint next to the plugin's scheduler channel ``channel``."""
    return channel[: -len(".sock")] + "-routing.sock" if channel.endswith(".sock") else channel + "-routing"


def client_channel_of(client: int) -> str | None:
    """The scheduler channel API server ``client`` binds (None when the plugin set none)."""
    base = os.environ.get(CHANNEL_ENV)
    return client_channel(client, base) if base else None


def forward_endpoint(beside: Callable[[str], str]) -> Callable[[int], str | None]:
    """API server ``client`` -> its worker channel ``beside`` its scheduler channel (:func:`importance_channel`,
    :func:`routing_channel`), or None without a plugin channel: where API server 0 forwards to."""
    def endpoint(client: int) -> str | None:
        base = client_channel_of(client)
        return beside(base) if base else None
    return endpoint
