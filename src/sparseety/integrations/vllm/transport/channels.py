"""The ZMQ channels between vLLM's processes: the scheduler-to-observer channel each API server binds, and the
workers' importance endpoint beside it."""

from __future__ import annotations

import os
import tempfile
import uuid

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
