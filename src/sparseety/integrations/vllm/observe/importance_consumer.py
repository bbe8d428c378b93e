"""In the API server: the worker's important tokens, waited for, forwarded to their API server, attached.

The worker's capture (:mod:`.worker_hooks`) sends a :class:`.wire_messages.CaptureStart` and an
:class:`.wire_messages.ImportanceResult` per sampled request to API server 0's importance channel (the worker cannot see which API server owns a request).
:class:`ImportanceConsumer` owns that channel's receiver (:class:`.importance.ImportanceInbox`) and:

- tells the finisher whether a finished request's result may still come (:meth:`pending`, at most
  :func:`.importance.wait_s` after the frontend saw it finish);
- on API server 0, forwards the messages of requests another API server owns (the scheduler names the
  owner: :attr:`.scheduler_consumer.RequestTable.owners`) to that server's importance channel;
- puts a result into the request's record (:meth:`attach`, through :func:`.importance.attach`).
"""

from __future__ import annotations

import logging
from typing import Any

from sparseety.integrations.vllm.transport.channels import forward_endpoint, importance_channel
from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest
from sparseety.integrations.vllm.transport.record import VllmRun
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api.wire_messages import CaptureStart, Message
from sparseety.integrations.vllm.observe.scheduler_consumer import RequestTable

log = logging.getLogger("sparseety.vllm")


class ImportanceConsumer:
    """The worker's importance results for this API server's requests (None inbox: importance is off)."""

    def __init__(self, channel: str | None, table: RequestTable, client: int) -> None:
        self.table = table
        self.client = client
        self.inbox = _inbox(channel)
        self._forward = WireSender(forward_endpoint(importance_channel))
        self.forwarded = 0  #: importance results forwarded to the API server that owns the request

    def pending(self, c: FinishedRequest, now: float, *, sampled: bool) -> bool:
        """True while the worker captured ``c`` and its result may still come (at most :func:`.importance.wait_s`).
        ``sampled``: whether the store keeps ``c`` above tier 1 (the worker's sampling)."""
        from sparseety.integrations.vllm.observe.importance import wait_s

        inbox = self.inbox
        if inbox is None or now - c.finished_at >= wait_s():
            return False
        if inbox.waiting(c.internal_id):
            return True
        # Another API server's request: API server 0 forwards the worker's "start" once the scheduler has
        # named the owner, which can be after a short request finished here; one the hash samples waits for
        # its result too (at most wait_s()), instead of reading as not sampled.
        return self.client > 0 and sampled and not inbox.has_result(c.internal_id)

    def forward(self) -> None:
        """API server 0: hand the worker's importance messages for requests another API server owns to
        that server's importance channel (``start`` as soon as it came, ``done`` with the result)."""
        inbox, owners = self.inbox, self.table.owners
        if inbox is None or not owners:
            return
        for req_id, entry in list(owners.items()):
            client, sent = entry
            if req_id in inbox.results:
                _, result = inbox.take(req_id)
                self._send(client, ([] if sent else [CaptureStart(req_id)]) + ([result] if result else []))
                owners.pop(req_id, None)
                self.forwarded += 1
            elif not sent and inbox.waiting(req_id):
                self._send(client, [CaptureStart(req_id)])
                entry[1] = 1

    def _send(self, client: int, messages: list[Message]) -> None:
        """Forward ``messages`` to API server ``client``; what its queue cannot take counts in the table's drops."""
        before = self._forward.dropped
        self._forward.send(messages, client)
        self.table.dropped += self._forward.dropped - before

    def attach(self, run: VllmRun, c: FinishedRequest, *, decode: bool, tokenizer_path: str | None) -> dict[str, Any]:
        """Put ``c``'s important tokens into ``run``; the ``importance`` section of its ``vllm`` info."""
        if self.inbox is None:
            return {"status": "off"}
        from sparseety.integrations.vllm.observe.importance import attach

        started, result = self.inbox.take(c.internal_id)
        try:
            return attach(run, result, started=started, decode=decode, tokenizer_path=tokenizer_path)
        except Exception as e:  # a bad result costs its own ranking, never the record
            log.exception("sparseety: important tokens of %s failed", c.request_id)
            return {"status": "failed", "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()


def _inbox(channel: str | None) -> Any:
    """The importance channel's receiver (None without a channel, or when it cannot start)."""
    if not channel:
        return None
    try:
        from sparseety.integrations.vllm.observe.importance import ImportanceInbox

        return ImportanceInbox(channel)
    except Exception:
        log.exception("sparseety: cannot start the importance receiver; important tokens are off")
        return None
