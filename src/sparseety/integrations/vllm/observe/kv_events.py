"""vLLM's KV-cache event stream, decoded without vLLM, and the block index that joins it to prompts.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) publishes on a
ZMQ PUB socket one three-frame message per engine step: topic, an 8-byte big-endian sequence number, and a
msgpack ``KVEventBatch`` (``vllm/distributed/kv_events.py``). The structs below mirror vLLM 0.32.0's
field for field (the batch is an array, each event a map tagged with its class name), so the subscriber
runs in any process with msgspec and pyzmq.

:class:`BlockIndex` keeps what the stream says about each cached block (parent hash, token ids, depth
in its chain) and answers, for a prompt, which cached blocks hold its tokens: block ``i`` of a prompt is
the child of block ``i - 1`` whose token ids equal ``prompt[i*bs:(i+1)*bs]``, the same chain vLLM hashes.

Data parallelism: each DP rank's scheduler publishes its own stream, on the endpoint's tcp port plus the
rank (:func:`rank_endpoint`, as vLLM's ``ZmqEventPublisher.offset_endpoint_port``), with its own sequence
numbers and ``KVEventBatch.data_parallel_rank`` set. One :class:`KVEventSubscriber` listens on every
rank's endpoint, counts sequence gaps per rank, and :class:`RankedBlockIndex` keeps one
:class:`BlockIndex` per rank (two ranks cache the same prefix separately); every change carries its rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

BlockHash = bytes | int
log = logging.getLogger("sparseety.vllm")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name, as vLLM writes it)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload -> its batch (raises ``msgspec.DecodeError`` on a foreign payload)."""
    return _DECODER.decode(payload)


def hash_text(block_hash: BlockHash | None) -> str | None:
    """A block hash as stored in JSON: hex for bytes, decimal for an int."""
    if block_hash is None:
        return None
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


@dataclass
class Block:
    """One cached block as the stream described it."""

    block_hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    depth: int  #: index of the block in its chain (0: the first block of a prompt), -1 when unknown
    stored_seq: int
    stored_ts: float
    requests: list[str] = field(default_factory=list)  #: requests whose prompt used this block

    @property
    def first_position(self) -> int:
        return self.depth * len(self.token_ids) if self.depth >= 0 else -1


@dataclass
class KVChange:
    """One block entering (``stored``) or leaving (``removed``) the cache, as a record of token events."""

    kind: str  #: stored | removed
    block: Block
    seq: int
    ts: float
    rank: int = 0  #: the data-parallel rank whose cache changed (``KVEventBatch.data_parallel_rank``)


class BlockIndex:
    """The blocks currently cached, as far as the stream told (bounded: the oldest are forgotten)."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[BlockHash, Block] = OrderedDict()
        self._children: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}
        self.removed_unknown = 0  #: BlockRemoved for a hash never stored (or forgotten)
        self.forgotten = 0
        self.cleared = 0
        self.stored_total = 0
        self.removed_total = 0
        self.lock = threading.Lock()

    def apply(self, batch: KVEventBatch, seq: int) -> list[KVChange]:
        """Apply one batch; the blocks stored and removed, in stream order."""
        changes: list[KVChange] = []
        with self.lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    changes.extend(self._store(event, seq, batch.ts))
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        block = self.blocks.pop(block_hash, None)
                        self.removed_total += 1
                        if block is None:
                            self.removed_unknown += 1
                            continue
                        self._children.pop((block.parent, block.token_ids), None)
                        changes.append(KVChange("removed", block, seq, batch.ts))
                elif isinstance(event, AllBlocksCleared):
                    self.cleared += 1
                    for block in self.blocks.values():
                        changes.append(KVChange("removed", block, seq, batch.ts))
                    self.blocks.clear()
                    self._children.clear()
        return changes

    def _store(self, event: BlockStored, seq: int, ts: float) -> list[KVChange]:
        out = []
        parent = event.parent_block_hash
        size = event.block_size
        parent_block = self.blocks.get(parent) if parent is not None else None
        depth = 0 if parent is None else (parent_block.depth + 1 if parent_block and parent_block.depth >= 0 else -1)
        for i, block_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            known = self.blocks.get(block_hash)
            if known is not None:  # a reused block reported again: keep the first description
                parent, depth = block_hash, known.depth + 1 if known.depth >= 0 else -1
                continue
            block = Block(block_hash, parent, tokens, depth, seq, ts)
            self.blocks[block_hash] = block
            self._children[(parent, tokens)] = block_hash
            self.stored_total += 1
            out.append(KVChange("stored", block, seq, ts))
            parent, depth = block_hash, depth + 1 if depth >= 0 else -1
        while len(self.blocks) > self.max_blocks:
            _, old = self.blocks.popitem(last=False)
            self._children.pop((old.parent, old.token_ids), None)
            self.forgotten += 1
        return out

    def prompt_blocks(self, token_ids: list[int], block_size: int) -> list[Block]:
        """The cached blocks that hold ``token_ids``'s full blocks, from the first, while the chain holds."""
        found: list[Block] = []
        parent: BlockHash | None = None
        with self.lock:
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                block_hash = self._children.get((parent, tuple(token_ids[start : start + block_size])))
                if block_hash is None:
                    break
                found.append(self.blocks[block_hash])
                parent = block_hash
        return found

    def mark_used(self, blocks: list[Block], request_id: str, keep: int = 64) -> None:
        """Remember that ``request_id``'s prompt used ``blocks`` (the newest ``keep`` per block)."""
        with self.lock:
            remember_use(blocks, request_id, keep)


def remember_use(blocks: list[Block], request_id: str, keep: int) -> None:
    """Append ``request_id`` to each block's users, keeping the newest ``keep`` (the caller holds its lock)."""
    for block in blocks:
        block.requests.append(request_id)
        if len(block.requests) > keep:
            del block.requests[0]


class RankedBlockIndex:
    """One :class:`BlockIndex` per data-parallel rank (created on a rank's first batch); each change is
    tagged with its rank. A batch without a rank (a publisher older than DP support) counts as rank 0."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self.ranks: dict[int, BlockIndex] = {}
        self.lock = threading.Lock()

    def rank(self, rank: int) -> BlockIndex:
        with self.lock:
            index = self.ranks.get(rank)
            if index is None:
                index = self.ranks[rank] = BlockIndex(self.max_blocks)
            return index

    def apply(self, batch: KVEventBatch, seq: int) -> list[KVChange]:
        rank = int(batch.data_parallel_rank or 0)
        changes = self.rank(rank).apply(batch, seq)
        for change in changes:
            change.rank = rank
        return changes

    def prompt_blocks(self, token_ids: list[int], block_size: int, rank: int = 0) -> list[Block]:
        """``token_ids``'s cached blocks in rank ``rank``'s cache (see :meth:`BlockIndex.prompt_blocks`)."""
        index = self.ranks.get(rank)
        return index.prompt_blocks(token_ids, block_size) if index is not None else []

    def mark_used(self, blocks: list[Block], request_id: str, keep: int = 64) -> None:
        """As :meth:`BlockIndex.mark_used`, under this index's lock."""
        with self.lock:
            remember_use(blocks, request_id, keep)

    @property
    def removed_unknown(self) -> int:
        return sum(i.removed_unknown for i in list(self.ranks.values()))

    @property
    def cleared(self) -> int:
        return sum(i.cleared for i in list(self.ranks.values()))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where DP rank ``rank`` publishes when the configured endpoint is ``endpoint``: the tcp port plus
    the rank (port 0, the OS's choice, is left alone), ``_dp<rank>`` after an inproc name; what vLLM
    0.32's ``ZmqEventPublisher.offset_endpoint_port`` computes (a test checks them against each other)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint


def subscriber_endpoint(publisher_endpoint: str) -> tuple[str, bool]:
    """Where to put the SUB socket for vLLM's ``endpoint``, and whether to bind it.

    vLLM's publisher binds a wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://`` endpoint and
    *connects* to any other (``tcp://127.0.0.1:5557``), so there the subscriber binds."""
    if "*" in publisher_endpoint or "::" in publisher_endpoint:
        return publisher_endpoint.replace("*", "127.0.0.1"), False
    if publisher_endpoint.startswith(("ipc://", "inproc://")):
        return publisher_endpoint, False
    return publisher_endpoint, True


class KVEventSubscriber:
    """A daemon thread on a ZMQ SUB socket: decodes each batch, applies it to ``index`` and hands the
    changes to ``on_changes``. Nothing here can block vLLM: the socket's receive queue is bounded
    (``hwm``), the changes wait in a bounded deque, and whatever does not fit is dropped and counted.
    """

    def __init__(
        self,
        endpoint: str | list[str],
        index: BlockIndex | RankedBlockIndex,
        on_changes: Callable[[list[KVChange]], None] | None = None,
        *,
        topic: str = "",
        hwm: int = 100_000,
        max_pending: int = 100_000,
        bind: bool = False,
    ) -> None:
        self.endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        self.endpoint = self.endpoints[0]
        self.bind = bind
        self.index = index
        self.on_changes = on_changes
        self.topic = topic
        self.hwm = hwm
        self.pending: deque[KVChange] = deque()
        self.max_pending = max_pending
        self.batches = 0
        self.decode_errors = 0
        self.seq_gaps = 0  #: sequence numbers skipped (messages lost on the wire or before we joined)
        self.dropped_changes = 0
        self.last_seq: int | None = None
        self.last_seq_by_rank: dict[int, int] = {}  #: each DP rank numbers its own stream
        self.batches_by_rank: dict[int, int] = {}
        self.error: str | None = None  #: why the socket could not bind or connect (the thread then ends)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparseety-kv-events", daemon=True)

    def start(self, timeout: float = 5.0) -> KVEventSubscriber:
        self._thread.start()
        self._ready.wait(timeout)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def take(self) -> list[KVChange]:
        """The changes waiting, oldest first (consumes them)."""
        out = []
        for _ in range(len(self.pending)):
            out.append(self.pending.popleft())
        return out

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            for endpoint in self.endpoints:
                if self.bind:
                    sock.bind(endpoint)
                else:
                    sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.error = f"{endpoint}: {e}"
            sock.close(0)
            return
        finally:
            self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3:
                    self.decode_errors += 1
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                try:
                    batch = decode_batch(payload)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.decode_errors += 1
                    continue
                rank = int(batch.data_parallel_rank or 0)
                last = self.last_seq_by_rank.get(rank)
                if last is not None and seq > last + 1:
                    self.seq_gaps += seq - last - 1
                self.last_seq_by_rank[rank] = self.last_seq = seq
                self.batches += 1
                self.batches_by_rank[rank] = self.batches_by_rank.get(rank, 0) + 1
                changes = self.index.apply(batch, seq)
                room = self.max_pending - len(self.pending)
                if len(changes) > room:
                    self.dropped_changes += len(changes) - max(room, 0)
                    changes = changes[: max(room, 0)]
                self.pending.extend(changes)
                if self.on_changes is not None and changes:
                    self.on_changes(changes)
        except Exception as e:  # a thread of vLLM's process: log and stop, never raise
            self.error = f"{type(e).__name__}: {e}"
            log.exception("sparseety: the KV-event subscriber stopped")
        finally:
            sock.close(0)


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass (used by tests and shutdown)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
