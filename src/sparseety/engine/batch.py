"""``BatchEngine``: continuous (iteration-level) batching over one :class:`SparseEngine`.

One loop owns the model. Each :meth:`BatchEngine.step` admits waiting requests that fit (the
scheduler reserves each one's worst-case KV bytes), runs one forward for every running sequence (a
decode token each, plus a chunk of prompt for those still prefilling), appends each sequence's next
token, and retires finished or cancelled sequences at once, freeing their cache. Every sequence has
its own policy, cache, run context and trace, so what it computes and records never depends on the
others in the batch.

One request's failure is its own. Everything checkable is checked at :meth:`BatchEngine.add`. What
fails later (building its context at admission, its part of a forward, its reconstruction pass, its
result) retires that request alone with :attr:`RequestStatus.FINISHED_ERROR`: it frees its cache and
reservation, its :class:`RequestFailure` is kept in :attr:`BatchEngine.failures` and returned in its
:class:`StepOutput`, and every other sequence goes on with exactly the tokens and trace it would have
had. Only a failure no sequence can be blamed for (a shared part of a packed forward) fails the
sequences of that forward, and nothing else.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sparseety.engine.context import RunContext
from sparseety.engine.inputs import EncodedInput
from sparseety.engine.request import GenerationOptions, Request, RequestStatus
from sparseety.engine.result import RunResult
from sparseety.engine.runner import run_forward
from sparseety.engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, Chunk, Scheduler, StepPlan
from sparseety.errors import InputError
from sparseety.policies.base import Policy

class BatchHost(Protocol):
    """What the batch engine needs of a model wrapper (:class:`~sparseety.engine.generate.SparseEngine` is one).

    Declared here rather than imported, so this module and ``generate`` do not import each other.
    """

    model: torch.nn.Module
    num_layers: int

    def check_request(self, encoded: EncodedInput, policy: Policy, options: GenerationOptions) -> None: ...

    def reserved_kv_bytes(self, encoded: EncodedInput, policy: Policy, max_new_tokens: int) -> int: ...

    def new_context(self, encoded: EncodedInput, policy: Policy, options: GenerationOptions) -> RunContext: ...

    def reconstruct(self, ctx: RunContext, encoded: EncodedInput) -> None: ...

    def build_result(self, ctx: RunContext, encoded: EncodedInput, sequences: torch.Tensor, policy: Policy,
                     tier: int, top_k: int, request_id: str | None, min_score: float = 0.0) -> RunResult: ...


@dataclass(frozen=True)
class RequestFailure:
    """Why one request left the batch unfinished.

    ``stage``: where it failed: ``admission`` (building its context), ``prefill`` or ``decode`` (its
    part of a forward, or its reconstruction pass), ``result`` (building its result).
    """

    request_id: str
    error: BaseException
    stage: str
    step: int  #: output tokens it had produced

    def message(self) -> str:
        """One line for logs and error bodies."""
        return f"request {self.request_id} failed at {self.stage} (after {self.step} tokens): {self.error}"


@dataclass
class StepOutput:
    """What one step produced for one request: its new token (if any) and, once finished, its result or failure."""

    request: Request
    token_id: int | None
    finished: bool
    result: RunResult | None = None
    failure: RequestFailure | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.request.status.value if self.finished else None


@dataclass
class StepStats:
    """Figures of the last step, for metrics."""

    batch_size: int = 0
    forwards: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0


class BatchEngine:
    """The step-level API: :meth:`add` requests, call :meth:`step` until :meth:`has_work` is False.

    Parameters
    ----------
    engine : the wrapped model.
    max_batch : sequences decoded together.
    prefill_chunk : prompt tokens prefilled per step (a long prompt never stalls running decodes for
        longer than one chunk).
    kv_memory_limit : bytes of KV cache the running requests may reserve (None: unlimited).
    """

    def __init__(self, engine: BatchHost, *, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_memory_limit: int | None = None) -> None:
        self.engine = engine
        self.scheduler = Scheduler(max_batch=max_batch, prefill_chunk=prefill_chunk, kv_memory_limit=kv_memory_limit)
        self.last_step = StepStats()
        self.failures: dict[str, RequestFailure] = {}  #: requests that failed, by id (kept until :meth:`run` returns)
        self._eos = _eos_ids(engine.model)

    # -- requests ------------------------------------------------------------------------------------
    def add(self, encoded: EncodedInput, policy: Policy, options: GenerationOptions | None = None,
            request_id: str | None = None) -> Request:
        """Validate and queue one request; raises :class:`InputError` (or ``KVLimitError``) for bad input."""
        options = options or GenerationOptions()
        self.engine.check_request(encoded, policy, options)
        request_id = request_id or uuid.uuid4().hex
        if self.scheduler.find(request_id) is not None:
            raise InputError(f"request id {request_id!r} is already in the batch")
        request = Request(request_id=request_id, encoded=encoded, policy=policy, options=options,
                          reserved_bytes=self.engine.reserved_kv_bytes(encoded, policy, options.max_new_tokens))
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request: it leaves at once (waiting or running) and its cache is freed."""
        request = self.scheduler.find(request_id)
        if request is not None:
            self._retire(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def reserved_bytes(self) -> int:
        return self.scheduler.reserved_bytes

    # -- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit, run one step's forwards, and return each participating request's output."""
        t0 = time.perf_counter()
        outputs: list[StepOutput] = []
        for request in self.scheduler.admit():
            try:
                request.ctx = self.engine.new_context(request.encoded, request.policy, request.options)
            except Exception as exc:
                outputs.append(self._fail(request, exc, "admission"))
        plan = self.scheduler.schedule()
        outputs += self._execute(plan)
        self.last_step = StepStats(batch_size=plan.batch_size(), forwards=len(plan.forwards),
                                   prefill_tokens=sum(c.length for f in plan.forwards for c in f
                                                      if c.start < c.request.prompt_len),
                                   seconds=time.perf_counter() - t0)
        return outputs

    def _execute(self, plan: StepPlan) -> list[StepOutput]:
        outputs = []
        for chunks in plan.forwards:
            try:
                tokens = run_forward(self.engine.model, self.engine.num_layers, chunks)
            except Exception as exc:  # alone in its forward: its own failure; packed: no sequence to blame
                outputs += [self._fail(c.request, exc, _stage(c)) for c in chunks]
                continue
            for chunk in chunks:  # a region just completed under kvzip: its reconstruction, a forward of its own
                ctx = chunk.request.ctx
                if ctx is not None and ctx.failure is None and ctx.reconstruction.pending:
                    try:
                        self.engine.reconstruct(ctx, chunk.request.encoded)
                    except Exception as exc:
                        ctx.failure = exc
            for chunk, token in zip(chunks, tokens):
                request = chunk.request
                if request.ctx is not None and request.ctx.failure is not None:
                    outputs.append(self._fail(request, request.ctx.failure, _stage(chunk)))
                    continue
                if chunk.start < request.prompt_len:
                    request.fed = chunk.end
                if token is None:
                    continue
                request.output_ids.append(token)
                request.status = RequestStatus.DECODING
                done = self._finish_reason(request, token)
                if done is None:
                    outputs.append(StepOutput(request, token, False))
                    continue
                try:
                    outputs.append(StepOutput(request, token, True, self._retire(request, done)))
                except Exception as exc:  # its result could not be built: its failure only
                    outputs.append(self._fail(request, exc, "result"))
        return outputs

    def _fail(self, request: Request, exc: BaseException, stage: str) -> StepOutput:
        """Retire ``request`` as failed (its cache and reservation freed) and record why."""
        failure = RequestFailure(request.request_id, exc, stage, len(request.output_ids))
        self.failures[request.request_id] = failure
        self._retire(request, RequestStatus.FINISHED_ERROR)
        return StepOutput(request, None, True, failure=failure)

    def _finish_reason(self, request: Request, token: int) -> RequestStatus | None:
        if token in self._eos:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_ids) >= request.options.max_new_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _retire(self, request: Request, status: RequestStatus) -> RunResult | None:
        """Finish ``request``: build its result (not for an aborted or failed one), free its cache, release its
        reservation. The cache and reservation are freed even when building the result raises."""
        request.status = status
        self.scheduler.remove(request)
        ctx, request.ctx = request.ctx, None
        if ctx is None:
            return None
        try:
            if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
                return None
            sequences = torch.cat([request.encoded.input_ids, torch.tensor([request.output_ids], dtype=torch.long)], dim=1)
            o = request.options
            return self.engine.build_result(ctx, request.encoded, sequences, request.policy, o.tier, o.top_k,
                                            request.request_id, o.min_score)
        finally:
            ctx.cache.release()

    def run(self) -> dict[str, RunResult]:
        """Step until every queued request finished; results by request id (failed ones are in :attr:`failures`)."""
        results: dict[str, RunResult] = {}
        while self.has_work():
            for out in self.step():
                if out.result is not None:
                    results[out.request.request_id] = out.result
        return results


def generate_batch(engine: BatchHost, inputs: Sequence[EncodedInput], policies: Policy | Sequence[Policy],
                   options: GenerationOptions | Sequence[GenerationOptions] | None = None, *,
                   request_ids: Sequence[str] | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_memory_limit: int | None = None) -> list[RunResult]:
    """Run ``inputs`` as one continuous batch; one :class:`RunResult` per input, in order."""
    count = len(inputs)
    policy_list = [policies] * count if isinstance(policies, Policy) else list(policies)
    option_list = [options or GenerationOptions()] * count if options is None or isinstance(options, GenerationOptions) \
        else list(options)
    ids = list(request_ids) if request_ids is not None else [uuid.uuid4().hex for _ in range(count)]
    for name, values in (("policies", policy_list), ("options", option_list), ("request_ids", ids)):
        if len(values) != count:
            raise InputError(f"generate_batch: {count} inputs but {len(values)} {name}")
    batch = BatchEngine(engine, max_batch=max_batch, prefill_chunk=prefill_chunk, kv_memory_limit=kv_memory_limit)
    for encoded, policy, opts, request_id in zip(inputs, policy_list, option_list, ids):
        batch.add(encoded, policy, opts, request_id)
    results = batch.run()
    for request_id in ids:  # this all-or-nothing API raises the first failure (BatchEngine reports each one)
        if request_id in batch.failures:
            raise batch.failures[request_id].error
    return [results[request_id] for request_id in ids]


def _stage(chunk: Chunk) -> str:
    return "prefill" if chunk.start < chunk.request.prompt_len else "decode"


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """End-of-sequence ids ``model.generate`` stops at (generation config, else model config)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
