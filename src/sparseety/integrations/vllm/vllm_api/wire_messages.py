"""The messages that cross vLLM's processes to the observer: one frozen dataclass per kind, each versioned.

The engine core's scheduler sends :class:`Chunk`, :class:`Owner`, :class:`Draft`, :class:`KVHeld`,
:class:`WindowPeak`, :class:`Groups` and :class:`EvictionRecord` on an API server's scheduler channel; the
worker sends :class:`CaptureStart` and :class:`ImportanceResult` on the importance channel, :class:`MoeShape`
and :class:`RouteResult` on the routing channel (:mod:`..transport.channels`). :mod:`..transport.wire` frames,
sends and receives them. ``KIND`` names a message on the wire and ``VERSION`` its layout: a change a reader of
the old layout would misread bumps it, and a receiver counts and drops a kind or version it does not know. A
field added with a default needs no bump (a reader ignores fields it does not know). No vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sparseety.integrations.vllm.vllm_api.messages import KVGroup


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk the scheduler scheduled: ``tokens`` prompt tokens from position ``start``."""

    KIND: ClassVar[str] = "chunk"
    VERSION: ClassVar[int] = 1
    req_id: str  #: vLLM's internal request id (the engine core's key), as in every message below
    start: int
    tokens: int


@dataclass(frozen=True)
class Owner:
    """A request another API server (``client``, vLLM's client index) owns; sent to API server 0, which forwards
    the worker's messages for it."""

    KIND: ClassVar[str] = "owner"
    VERSION: ClassVar[int] = 1
    req_id: str
    client: int


@dataclass(frozen=True)
class Draft:
    """One verify step's speculative drafts: ``draft_ids`` proposed at ``position`` onward, ``accepted`` of them
    kept; ``step`` is the request's output-token count before the step."""

    KIND: ClassVar[str] = "draft"
    VERSION: ClassVar[int] = 1
    req_id: str
    step: int
    position: int
    draft_ids: tuple[int, ...]
    accepted: int


@dataclass(frozen=True)
class KVHeld:
    """The KV bytes and blocks a request held when vLLM freed its blocks."""

    KIND: ClassVar[str] = "kv"
    VERSION: ClassVar[int] = 1
    req_id: str
    bytes: int
    blocks: int


@dataclass(frozen=True)
class WindowFree:
    """``blocks`` blocks a sliding-window KV-cache ``group`` freed once the request had ``computed`` tokens."""

    computed: int
    group: int
    blocks: int


@dataclass(frozen=True)
class WindowPeak:
    """A request's peak KV (bytes, blocks) over the coordinator's checks, and what its window groups freed."""

    KIND: ClassVar[str] = "window"
    VERSION: ClassVar[int] = 1
    req_id: str
    peak_bytes: int
    peak_blocks: int
    frees: tuple[WindowFree, ...] = ()


@dataclass(frozen=True)
class Groups:
    """The engine core's KV-cache groups (once per API server, before its first :class:`WindowPeak`)."""

    KIND: ClassVar[str] = "groups"
    VERSION: ClassVar[int] = 1
    groups: tuple[KVGroup, ...]


@dataclass(frozen=True)
class EvictedSlots:
    """Slots a policy evicted inside vLLM's cache, one column per field (``n`` rows): the request's output-token
    count at the compaction (``step``), the decoder layer, the KV head, the position and its score."""

    step: tuple[int, ...] = ()
    layer: tuple[int, ...] = ()
    kv_head: tuple[int, ...] = ()
    position: tuple[int, ...] = ()
    score: tuple[float, ...] = ()

    @classmethod
    def of_rows(cls, rows: list[list[float]] | list[tuple[float, ...]]) -> EvictedSlots:
        """From the worker's rows of ``(step, layer, kv head, position, score)``."""
        if not rows:
            return cls()
        step, layer, head, position, score = zip(*rows, strict=True)
        return cls(tuple(int(x) for x in step), tuple(int(x) for x in layer), tuple(int(x) for x in head),
                   tuple(int(x) for x in position), tuple(float(x) for x in score))

    @classmethod
    def joined(cls, parts: list[EvictedSlots]) -> EvictedSlots:
        """One table of ``parts``, in their order."""
        return cls(*(tuple(x for p in parts for x in getattr(p, name)) for name in _SLOT_COLUMNS))

    def __post_init__(self) -> None:
        if len({len(getattr(self, name)) for name in _SLOT_COLUMNS}) > 1:
            raise ValueError("evicted-slot columns of different lengths")

    def __len__(self) -> int:
        return len(self.position)


_SLOT_COLUMNS = ("step", "layer", "kv_head", "position", "score")


@dataclass(frozen=True)
class EvictionRecord:
    """A finished request that evicted inside vLLM's KV cache, or asked to and was refused (``refused``: why; it
    was served dense). ``failure``: why the worker stopped following the policy (it then kept what it held)."""

    KIND: ClassVar[str] = "evict"
    VERSION: ClassVar[int] = 1
    req_id: str
    policy: str
    budget: int = 0
    evicted_tokens_per_layer: int = 0
    freed_blocks: int = 0
    compactions: int = 0
    peak_tokens: int = 0
    slots: EvictedSlots = field(default_factory=EvictedSlots)
    failure: str | None = None
    refused: str | None = None


@dataclass(frozen=True)
class CaptureStart:
    """The worker began capturing a sampled request's attention (its :class:`ImportanceResult` will follow)."""

    KIND: ClassVar[str] = "start"
    VERSION: ClassVar[int] = 1
    req_id: str


@dataclass(frozen=True)
class PendingRow:
    """A decode row the worker scored but could not fold yet: query position ``q``, its ``[layers, q + 1]``
    float32 scores (and the plain attention in ``value``/``output`` modes)."""

    q: int
    scores: bytes
    plain: bytes | None = None


@dataclass(frozen=True)
class StepRow:
    """Tier 3: query position ``q``'s ``[layers, q + 1]`` float16 scores."""

    q: int
    row: bytes


@dataclass(frozen=True)
class ImportanceResult:
    """A sampled request's captured attention when vLLM removed it: ``sums`` (and the plain ``attention``) float32
    bytes ``[layers, width]`` over the rows it folded, the rows it has not, tier-3 steps;
    :func:`..observe.importance.attach` turns it into important tokens."""

    KIND: ClassVar[str] = "done"
    VERSION: ClassVar[int] = 1
    req_id: str
    tier: int
    mode: str
    prompt_len: int
    layers: int
    width: int
    sums: bytes
    attention: bytes | None = None
    folded: tuple[int, ...] = ()
    pending: tuple[PendingRow, ...] = ()
    steps: tuple[StepRow, ...] = ()
    unscored: tuple[int, ...] = ()
    shared: int = 0  #: positions read from the prefix cache whose keys an earlier sampled request computed

    def __post_init__(self) -> None:
        floats = self.layers * self.width * 4
        if self.layers < 0 or self.width < 0 or len(self.sums) != floats or (
                self.attention is not None and len(self.attention) != floats):
            raise ValueError(f"sums of {len(self.sums)} bytes for {self.layers} layers x {self.width} positions")


@dataclass(frozen=True)
class MoeShape:
    """The served model's MoE layers (decoder-layer numbers), experts per layer and top-k, at the first routing."""

    KIND: ClassVar[str] = "moe"
    VERSION: ClassVar[int] = 1
    layers: tuple[int, ...]
    experts: int
    top_k: int


@dataclass(frozen=True)
class RouteResult:
    """A request's MoE routing when vLLM removed it: ``counts`` int64 ``[layers, experts]`` tokens routed; for a
    sampled request (``tier`` set) its rows ``[layers, width, ...]``: router ``probs`` float32 (experts), the
    top-k ``ids`` int32 and ``weights`` float32, and ``written`` uint8 per position. ``counted``: API server 0
    already counted it in the metrics and forwarded it."""

    KIND: ClassVar[str] = "route"
    VERSION: ClassVar[int] = 1
    req_id: str
    layers: tuple[int, ...]
    experts: int
    top_k: int
    counts: bytes
    tier: int | None = None
    width: int = 0
    probs: bytes = b""
    ids: bytes = b""
    weights: bytes = b""
    written: bytes = b""
    counted: bool = False

    def __post_init__(self) -> None:
        layers, width = len(self.layers), self.width
        sizes = {"counts": (self.counts, 8 * layers * self.experts)}
        if self.tier is not None:
            sizes.update(probs=(self.probs, 4 * layers * width * self.experts), ids=(self.ids, 4 * layers * width * self.top_k),
                         weights=(self.weights, 4 * layers * width * self.top_k), written=(self.written, width))
        for name, (raw, size) in sizes.items():
            if len(raw) != size:
                raise ValueError(f"{name} of {len(raw)} bytes, {size} expected for its shape")


Message = (Chunk | Owner | Draft | KVHeld | WindowPeak | Groups | EvictionRecord | CaptureStart | ImportanceResult
           | MoeShape | RouteResult)
KINDS: dict[str, type] = {cls.KIND: cls for cls in (Chunk, Owner, Draft, KVHeld, WindowPeak, Groups, EvictionRecord,
                                                    CaptureStart, ImportanceResult, MoeShape, RouteResult)}
