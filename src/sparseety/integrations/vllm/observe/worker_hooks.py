"""Inside vLLM's worker: the hooks that feed :mod:`.attention_capture` and the worker's capture state.

- ``importance-rows`` wraps the model runner's ``_model_forward``: :meth:`WorkerCapture.plan` reads which
  rows of the batch belong to which sampled request and where they stand;
- ``importance-attention`` wraps ``forward`` of each attention-backend implementation class the model's
  layers use (found at the first forward, checked then: :func:`.adapter.check_class`) and hands each
  sampled request's rows to its :class:`~.attention_capture.RequestCapture`;
- ``importance-finish`` wraps ``_on_request_state_removed`` and sends the request's result.

Every vLLM object is read through :mod:`.adapter`; the three hooks go together (rows captured without
the other two could never be scored or sent). This module imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sparseety.errors import ConfigError
from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.observe.attention_capture import (
    MODE_ARG,
    MODES,
    TIER_ARG,
    RequestCapture,
    SharedBlocks,
    parse_mode,
)
from sparseety.integrations.vllm.transport.channels import importance_channel
from sparseety.integrations.vllm.vllm_api.guards import guarded
from sparseety.integrations.vllm.vllm_api.ids import external_id, layer_number
from sparseety.integrations.vllm.vllm_api.messages import ImplShape
from sparseety.integrations.vllm.transport.values import decimal_int
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api.wire_messages import CaptureStart, Message

log = logging.getLogger("sparseety.vllm")
HOOK_ROWS = "importance-rows"
HOOK_ATTENTION = "importance-attention"
HOOK_FINISH = "importance-finish"
SEND_HWM = 256
SHARED_ENV = "SPARSEETY_IMPORTANCE_SHARED_BLOCKS"


class WorkerCapture:
    """The worker process's capture: sampling decisions, the request captures, the step plan, the sender."""

    def __init__(self) -> None:
        from sparseety.integrations.vllm.transport.settings import parse_settings

        settings = parse_settings()
        mode, problem = parse_mode()
        if problem:
            log.warning(problem)
        self.on = bool(settings.trace_dir) and not settings.problems and mode is not None and settings.tier >= 2
        self.mode = mode or MODES[0]
        self.rate = settings.sample_rate
        self.tier = settings.tier
        self.decisions: dict[str, RequestCapture | None] = {}
        self.shared = SharedBlocks(_shared_limit())
        self.block_size = 0
        self.step: list[tuple[RequestCapture, int, int, int, list[int]]] | None = None
        self.layer_index: dict[str, int] = {}
        self.shapes: dict[str, ImplShape] = {}  #: layer name -> its heads and scale
        self.windows: list[int | None] = []  #: per captured layer, its sliding window (None: full attention)
        self.grams: list[Any] | None = None  #: ``output`` mode's per-layer Gram matrices (None: unavailable)
        self.layers = 0
        self.wrapped = False
        self.channel = os.environ.get("SPARSEETY_VLLM_CHANNEL")
        self._sender: WireSender | None = None

    def send(self, message: Message) -> None:
        """Send ``message`` to API server 0's importance channel (non-blocking; nothing without a channel)."""
        if not self.channel:
            return
        if self._sender is None:
            self._sender = WireSender(lambda _client: importance_channel(self.channel), hwm=SEND_HWM,
                                      linger_ms=2000)
        self._sender.send([message])

    @property
    def dropped(self) -> int:
        return self._sender.dropped if self._sender is not None else 0

    # -- decisions ---------------------------------------------------------------------------------------
    def decide(self, runner: Any, req_id: str) -> RequestCapture | None:
        """Sample ``req_id`` (once): the store's request-id hash at tier >= 2, or ``sparseety_tier: 3``."""
        from sparseety.store.sampling import should_sample

        known = adapter.new_request(runner, req_id)
        extra = known[1] if known is not None else {}
        tier, mode = self.tier, self.mode
        forced = str(extra.get(TIER_ARG, "")).strip() == "3"
        wanted = str(extra.get(MODE_ARG, "")).strip()
        if wanted in MODES:
            mode = wanted
        if mode == "output" and self.grams is None:
            mode = "value"  # no output projection found: the result says which mode it holds
        capture = None
        if wanted != "off" and known is not None and self.layers and (
                forced or should_sample(external_id(req_id), self.rate)):
            capture = RequestCapture(req_id, tier=3 if forced else tier, mode=mode, prompt_len=known[0],
                                     layers=self.layers, grams=self.grams if mode == "output" else None)
            self.send(CaptureStart(req_id))
        self.decisions[req_id] = capture
        return capture

    def plan(self, runner: Any, positions: Any) -> None:
        """Plan this forward: each sampled request's rows ``[s, e)``, first position and rows to score."""
        self.step = None
        found = []
        for index, req_id in enumerate(adapter.batch_requests(runner)):
            capture = self.decisions[req_id] if req_id in self.decisions else self.decide(runner, req_id)
            if capture is not None:
                found.append((index, capture))
        if not found:
            return
        starts = adapter.query_starts(runner)
        flat = positions if positions.dim() == 1 else positions[0]
        step = []
        for index, capture in found:
            s, e = int(starts[index]), int(starts[index + 1])
            if e <= s:
                continue
            p0 = int(flat[s])
            rows = capture.begin(p0, e - s)
            if not capture.started:
                capture.started = True
                if p0 > 0:  # a prefix-cache hit: keys other sampled requests computed, where there are
                    self.block_size = self.block_size or adapter.block_size(runner)
                    self.shared.fill(capture, adapter.prompt_token_ids(runner, capture.req_id) or [],
                                     self.block_size, p0)
            step.append((capture, s, e, p0, rows))
        self.step = step or None

    def after_forward(self, runner: Any) -> None:
        """Offer the prompt blocks this forward completed to :class:`~.attention_capture.SharedBlocks`."""
        if self.step is None or self.shared.limit <= 0:
            return
        self.block_size = self.block_size or adapter.block_size(runner)
        for capture, *_ in self.step:
            if capture.saved_blocks < capture.prompt_len // self.block_size:
                token_ids = adapter.prompt_token_ids(runner, capture.req_id)
                if token_ids is not None:
                    self.shared.save(capture, token_ids, self.block_size)

    def finish(self, req_id: str) -> None:
        capture = self.decisions.pop(req_id, None)
        if capture is not None:
            self.send(capture.result())

    # -- inside the attention backend -------------------------------------------------------------------------
    def layer(self, attn_layer: Any, query: Any, key: Any, value: Any) -> None:
        name = adapter.layer_name(attn_layer)
        index = self.layer_index.get(name)
        if index is None or self.step is None:
            return
        shape = self.shapes[name]
        for capture, s, e, p0, rows in self.step:
            if key is not None and value is not None:
                capture.write(index, p0, key[s:e].view(e - s, shape.num_kv_heads, -1),
                              value[s:e].view(e - s, shape.num_kv_heads, -1))
            if rows:
                capture.score(index, p0, query[s:e].view(e - s, shape.num_heads, -1), rows, shape.scale,
                              self.windows[index])


_CAPTURE: WorkerCapture | None = None


def _shared_limit() -> int:
    """``SPARSEETY_IMPORTANCE_SHARED_BLOCKS``: prompt blocks of keys kept for prefix-cache hits (default 64;
    0 keeps none, and cached positions are then always ``unscored``)."""
    raw = os.environ.get(SHARED_ENV, "64")
    try:
        return decimal_int(raw, SHARED_ENV, 0, 10**6)
    except ConfigError as exc:
        log.warning("sparseety: %s; 64 blocks kept", exc)
        return 64


def capture() -> WorkerCapture:
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = WorkerCapture()
    return _CAPTURE


# -- hooks -------------------------------------------------------------------------------------------------
def install(loud: bool) -> None:
    """Install the worker hooks on vLLM's model runner (the backend is wrapped at the first forward)."""
    mode, problem = parse_mode()
    if mode is None and problem is None:
        return  # SPARSEETY_IMPORTANCE=off
    on = adapter.check((HOOK_ROWS, HOOK_FINISH, HOOK_ATTENTION), loud=loud)
    if not all(on.values()):  # one without the others would capture what is never scored or sent
        return
    runner = adapter.resolve(adapter.RUNNER)

    def make_forward(forward):
        def _model_forward(self, *args, **kwargs):
            state = capture()
            if state.on:
                guarded(HOOK_ROWS, _plan, state, self, adapter.arg(args, kwargs, 1, "positions"))
            try:
                return forward(self, *args, **kwargs)
            finally:
                if state.step is not None:
                    guarded(HOOK_ROWS, state.after_forward, self)
                state.step = None
        return _model_forward

    def make_removed(removed):
        def _on_request_state_removed(self, *args, **kwargs):
            result = removed(self, *args, **kwargs)
            state = _CAPTURE
            if state is not None and state.decisions:
                req_id = adapter.arg(args, kwargs, 0, "req_id")
                if req_id in state.decisions:
                    guarded(HOOK_FINISH, state.finish, req_id)
            return result
        return _on_request_state_removed

    adapter.patch(runner, "_model_forward", HOOK_ROWS, make_forward)
    adapter.patch(runner, "_on_request_state_removed", HOOK_FINISH, make_removed)


def _plan(state: WorkerCapture, runner: Any, positions: Any) -> None:
    if not state.wrapped:
        state.wrapped = True
        wrap_backends(state)
        if state.layers:
            state.grams = output_projection_grams(runner, state)
    if state.layers:
        state.plan(runner, positions)


def output_projection_grams(runner: Any, state: WorkerCapture) -> list[Any] | None:
    """Per captured layer, :func:`~sparseety.extract.scoring.output_grams` of the ``o_proj`` weight beside its
    attention (``model.layers.N.self_attn.o_proj`` next to ``...self_attn.attn``). vLLM's CPU build may
    repack a linear layer's weight and leave an empty one in its place; the weight is then read from the
    checkpoint's safetensors under the same name. None (``output`` falls back to ``value``) when one is
    missing."""
    from sparseety.extract.scoring import output_grams

    modules = adapter.named_modules(runner)
    checkpoint: dict[str, Any] | None = None
    layers: list[Any] = []
    for name in sorted(state.layer_index, key=state.layer_index.__getitem__):
        prefix = name.rsplit(".", 1)[0] + ".o_proj"
        shape = state.shapes[name]
        width = shape.num_heads * shape.head_size
        weight = adapter.module_weight(modules, prefix)
        if weight is None or weight.dim() != 2 or weight.shape[1] != width:
            if checkpoint is None:
                checkpoint = _checkpoint_tensors(adapter.model_path(runner), "o_proj.weight")
            weight = checkpoint.get(prefix + ".weight")
        if weight is None or weight.dim() != 2 or weight.shape[1] != width:
            log.warning("sparseety: importance 'output' is off (requests get 'value'): no output projection "
                        "weight %s.weight of shape [hidden, %d]", prefix, width)
            return None
        layers.append(output_grams(weight, shape.num_heads, shape.num_kv_heads))
    return layers


def _checkpoint_tensors(path: str, suffix: str) -> dict[str, Any]:
    """The tensors named ``*suffix`` in the safetensors files of the model directory ``path``."""
    import glob

    from safetensors import safe_open

    out: dict[str, Any] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.endswith(suffix):
                    out[key] = f.get_tensor(key)
    return out


def wrap_backends(state: WorkerCapture) -> None:
    """Wrap ``forward`` of each attention-implementation class the model's layers use (whichever backend
    the platform chose), and number the layers. Runs inside vLLM's forward context, at the first forward."""
    split = adapter.model_split()
    if split:
        log.warning("sparseety: important tokens of vLLM requests are off: the model is split over %s, and each "
                    "worker would see only its share of the heads or layers", split)
        return
    named: list[tuple[int, str]] = []
    skipped: list[str] = []
    classes: dict[type, None] = {}
    impls: dict[str, Any] = {}
    windows: dict[str, int | None] = {}
    for layer in adapter.attention_layers():
        number = layer_number(layer.name)
        if number is None:
            continue
        if layer.variant is not None:
            skipped.append(layer.name)  # not the causal (windowed) softmax row_probs computes
            continue
        named.append((number, layer.name))
        windows[layer.name] = layer.window
        impls[layer.name] = layer.impl
        classes[type(layer.impl)] = None
    if skipped:
        log.warning("sparseety: important tokens of vLLM requests are off: %d attention layers use a logit "
                    "soft cap, ALiBi or sinks (%s, ...), which the capture does not score (SparSEEty's own engine "
                    "has no reference for them to be compared with)", len(skipped), skipped[0])
        return
    ok = [cls for cls in classes if _wrap_impl(cls)]
    if not ok:
        return
    keep = sorted(named)
    state.shapes = {name: adapter.impl_shape(impls[name]) for _, name in keep}
    state.layer_index = {name: i for i, (_, name) in enumerate(keep)}
    state.windows = [windows[name] for _, name in keep]
    state.layers = len(keep)
    log.info("sparseety: important tokens of sampled vLLM requests from %s over %d layers",
             ", ".join(c.__name__ for c in ok), state.layers)


def _wrap_impl(cls: type) -> bool:
    """Wrap ``cls.forward`` after :func:`.adapter.check_class` (``forward(layer, query, key, value,
    kv_cache, attn_metadata, ...)`` and the attributes the capture reads)."""
    if adapter.installed(cls, "forward", HOOK_ATTENTION):
        return True
    if not adapter.check_class(cls):
        return False

    def make(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            state = _CAPTURE
            if state is not None and state.step is not None and attn_metadata is not None:
                guarded(HOOK_ATTENTION, state.layer, layer, query, key, value)
            return result
        return forward

    adapter.patch(cls, "forward", HOOK_ATTENTION, make)
    return True
