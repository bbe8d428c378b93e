"""vLLM's ``vllm.general_plugins`` entry point: hooks the frontend's output loop and the scheduler (vLLM 0.32).

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may call
them more than once; :func:`register` patches vLLM's ``OutputProcessor`` and ``Scheduler`` classes once
per process. Only the API-server process runs an ``OutputProcessor`` and only the engine core schedules,
so each hook fires where it belongs. Each hook calls vLLM's own method first and then hands on what it
needs; an observer error is logged, never raised (:func:`.hooks.guarded`). Every vLLM method it wraps and
every attribute it reads is declared in :mod:`.adapter` and checked there at load (:func:`.adapter.check`);
a hook whose need is missing is off, with one warning, and the others stay on. The wrappers read vLLM's
objects only through the adapter's readers.

The scheduler hooks see what the frontend never does, and send it on the one wire
(:mod:`.transport.wire`: typed, versioned messages of :mod:`.vllm_api.wire_messages`; PUSH, non-blocking,
bounded; what does not fit is dropped and counted) to the observer's inbox in the API server:

- ``prefill-chunks``: a ``Chunk`` per prefill chunk (a prompt prefilled over several steps,
  ``--max-num-batched-tokens``);
- ``drafts``: a ``Draft`` per request and verify step of speculative decoding: the drafts vLLM verified,
  where they stand in the sequence, and how many of them (a prefix) the target model accepted;
- ``kv-blocks``: a ``KVHeld`` when vLLM frees a request's KV blocks (it finished, or was preempted), and with
  ``window-frees`` a ``WindowPeak`` (after the engine core's ``Groups``, once per API server);
- ``kv-eviction``: an ``EvictionRecord`` when a request that evicted (or was refused) finishes;
- ``owners`` (to API server 0 only, only with ``--api-server-count > 1``): an ``Owner`` for each new request
  another API server owns. The worker's importance results go to API server 0's importance channel (the
  worker cannot see a request's client); API server 0 forwards those of other API servers' requests to them
  (:class:`.importance_consumer.ImportanceConsumer`).

The first process to register picks the channel (``$SPARSEETY_VLLM_CHANNEL``, an ``ipc://`` path) and
the processes it spawns inherit it. With ``--api-server-count N`` each API server (vLLM's client index
``k``, ``ParallelConfig._api_process_rank``) binds its own channel, :func:`.channels.client_channel` (``k = 0``: the
channel itself), and the engine core sends each record to the channel of the API server that owns the
request (``Request.client_index``, the index vLLM routes the request's outputs by), so every request's
records reach the one process that records it. With ``--data-parallel-size N`` every engine core's
scheduler sends on these channels (PUSH sockets from many processes into one PULL).
"""


from __future__ import annotations

import logging
import os

from sparseety.errors import ConfigError
from sparseety.integrations.vllm import request_guard
from sparseety.integrations.vllm.evict import hooks as eviction_hooks
from sparseety.integrations.vllm.evict.settings import EvictionSettings, parse_eviction
from sparseety.integrations.vllm.observe import engine_core_hooks, frontend_hooks
from sparseety.integrations.vllm.transport.channels import CHANNEL_ENV, channel
from sparseety.integrations.vllm.transport.env_names import unknown_variables
from sparseety.integrations.vllm.vllm_api import adapter

log = logging.getLogger("sparseety.vllm")


def register() -> None:
    """Install the hooks (idempotent, never raising). A hook whose vLLM internal is missing or changed
    is off, with one warning (in the first process that registers; the processes it starts stay quiet)."""
    loud = CHANNEL_ENV not in os.environ
    eviction = _eviction_or_exit()
    try:
        if loud:
            for line in unknown_variables(os.environ):
                log.warning(line)
        channel()
        on = adapter.check(("ranks", *engine_core_hooks.HOOKS, *frontend_hooks.HOOKS), loud=loud)
        engine_core_hooks.install(on)
        frontend_hooks.install(on)
        _patch_attention(loud)
        evicting = eviction_hooks.install(loud, eviction, send=engine_core_hooks.send)
        request_guard.install(loud, eviction if evicting else None)
    except Exception:
        log.exception("sparseety: installing the vLLM hooks failed; vLLM is unaffected")


def _eviction_or_exit() -> EvictionSettings | None:
    """The ``SPARSEETY_KV_*`` settings, or SystemExit with one line naming the bad one: in ``vllm serve``'s first
    process this runs while vLLM reads its arguments, before any model loads."""
    try:
        return parse_eviction()
    except ConfigError as exc:
        raise SystemExit(f"sparseety: {exc}; vLLM not started (unset SPARSEETY_KV_POLICY to serve without "
                         "SparSEEty's eviction)") from None


def _patch_attention(loud: bool) -> None:
    """``importance-rows``, ``importance-finish`` and ``importance-attention``: the worker's model runner
    and the attention backend it chose, for the important tokens of sampled requests (:mod:`.worker_hooks`)."""
    from sparseety.integrations.vllm.observe.worker_hooks import install

    install(loud)
    from sparseety.integrations.vllm.observe import routing_capture

    routing_capture.install(loud)  # ``moe-routing``: the MoE routing of every request (:mod:`.routing_capture`)
