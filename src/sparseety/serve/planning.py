"""Turn a validated request body into a :class:`Plan`: token ids, policy, length and trace tier.

Everything a client can get wrong is found here, before the request is queued or a stream starts,
and raised as :class:`APIError` 400/404 naming the offending field.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from sparseety.engine import EncodedInput, SparseEngine, encode_messages, encode_prompt
from sparseety.engine.scheduler import kv_limit_message
from sparseety.errors import InputError, SparseetyError
from sparseety.options import GenerationOptions
from sparseety.policies import sized_policy
from sparseety.policies.base import Policy
from sparseety.request_json import check_text_size
from sparseety.serve.config import ServeConfig
from sparseety.serve.errors import APIError
from sparseety.serve.schemas import ChatCompletionRequest, CompletionRequest
from sparseety.serve.tracing import TraceDecision, Tracer

REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Plan:
    """One admitted request, ready for a worker."""

    request_id: str
    operation: str  #: ``chat`` or ``text_completion`` (the GenAI operation name)
    request_model: str
    encoded: EncodedInput
    policy: Policy
    max_tokens: int
    decision: TraceDecision
    seed: int
    temperature: float | None
    top_p: float | None
    arrival: float  #: ``time.perf_counter()`` when the request arrived
    arrival_ns: int  #: wall clock of the arrival, for spans


def request_options(defaults: GenerationOptions, plan: Plan) -> GenerationOptions:
    """One request's options: the server's ``defaults`` (:meth:`ServeConfig.generation_options`) with the
    body's ``max_tokens``, the traced tier and the seed. The body's policy is ``plan.policy``, built from the
    same defaults and the body's ``sparsity`` (:func:`plan_request`), and handed to the engine beside them."""
    return defaults.replace(max_new_tokens=plan.max_tokens, tier=plan.decision.tier, seed=plan.seed)


def check_request_id(value: str) -> str:
    """A request id safe to use as a trace key: 1-128 of ``A-Z a-z 0-9 . _ : -``, not starting with a dot."""
    if not REQUEST_ID.fullmatch(value):
        raise APIError(400, "X-Request-Id must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-' "
                       "starting with a letter or digit", param="X-Request-Id", code="invalid_value")
    return value


def _text_bytes(text: str, param: str) -> int:
    """The UTF-8 size of ``text``; JSON may carry lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode text: {exc.reason} at character {exc.start}",
                       param=param, code="invalid_value") from None


def _check_size(size: int, param: str, context: int | None) -> None:
    """Refuse text far larger than the model's context could hold, by bytes, before tokenizing it."""
    try:
        check_text_size(size, f"the {param} text", context)
    except InputError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def _chat_ids(tokenizer: Any, body: ChatCompletionRequest, context: int | None) -> EncodedInput:
    """The conversation through :func:`encode_messages`, the encoding ``sparseety audit-usage`` checks against."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    _check_size(sum(_text_bytes(m["content"], "messages") for m in messages), "messages", context)
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "every message is empty", param="messages", code="invalid_value")
    try:
        return encode_messages(tokenizer, messages)
    except SparseetyError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from None
    except Exception as exc:  # the template's own checks (e.g. role order) reject the conversation
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None


def _completion_ids(tokenizer: Any, body: CompletionRequest, context: int | None) -> EncodedInput:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt must be one string (batched prompts are not supported), got a list of "
                           f"{len(prompt)}", param="prompt", code="invalid_value")
        prompt = prompt[0]
    _check_size(_text_bytes(prompt, "prompt"), "prompt", context)
    try:
        return encode_prompt(tokenizer, prompt, chat=False)
    except SparseetyError as exc:
        raise APIError(400, str(exc), param="prompt", code="invalid_value") from None


def _max_tokens(body: ChatCompletionRequest | CompletionRequest, prompt_len: int, context: int | None,
                config: ServeConfig, param: str) -> int:
    requested, field = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        requested, field = body.max_completion_tokens, "max_completion_tokens"
    room = None if context is None else context - prompt_len
    if room is not None and room <= 0:
        raise APIError(400, f"the prompt is {prompt_len} tokens, over the model's context window of {context} "
                       "tokens", param=param, code="context_length_exceeded")
    if requested is None:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if isinstance(body, CompletionRequest) else config.max_tokens_limit
        default = min(default, config.max_tokens_limit)
        return default if room is None else min(default, room)
    if not 1 <= requested <= config.max_tokens_limit:
        raise APIError(400, f"{field} must be between 1 and {config.max_tokens_limit} (this server's "
                       f"--max-tokens-limit), got {requested}", param=field, code="invalid_value")
    if room is not None and requested > room:
        raise APIError(400, f"the prompt ({prompt_len} tokens) plus {field} ({requested}) exceeds the model's "
                       f"context window of {context} tokens", param=field, code="context_length_exceeded")
    return requested


def _policy(body: ChatCompletionRequest | CompletionRequest, config: ServeConfig, prompt_len: int) -> Policy:
    sparsity = body.sparsity
    name, budget, ratio, options = config.policy, config.budget, config.ratio, dict(config.policy_opts)
    if sparsity is not None:
        if sparsity.policy is not None and sparsity.policy != config.policy:
            name, options = sparsity.policy, {}
        if sparsity.budget is not None or sparsity.ratio is not None:
            budget, ratio = sparsity.budget, sparsity.ratio
        if sparsity.options is not None:
            options = {key: str(value) for key, value in sparsity.options.items()}
    if sparsity is not None and sparsity.budget is not None and sparsity.ratio is not None:
        raise APIError(400, "give either sparsity.budget or sparsity.ratio, not both", param="sparsity.budget",
                       code="invalid_value")
    param = "sparsity.policy"
    inherited = name == config.policy and (sparsity is None or sparsity.options is None) and bool(options)
    try:
        policy = sized_policy(name, budget, ratio, prompt_len, options)
    except SparseetyError as exc:
        message = _as_request_fields(str(exc))
        if "budget" in message or "ratio" in message:
            param = "sparsity.budget"
        elif "option" in message:
            param = "sparsity.options"
        if inherited:  # the options that clash are the server's: say so, and what the request can send instead
            given = " ".join(f"{key}={value}" for key, value in options.items())
            message = (f"{message} (the options {given} are this server's, set by its --policy-opt; send "
                       "sparsity.options to replace them for this request)")
        raise APIError(400, message, param=param, code="invalid_value") from None
    if config.attention_topk is not None and policy.splits_heads:
        raise APIError(400, f"policy {policy.name!r} keeps a different number of slots in each KV head, and this "
                       f"server attends only to the top {config.attention_topk} slots of every head (its "
                       "--attention-topk), which needs the same number in each; send sparsity.options "
                       '{"per_head": false} or another sparsity.policy', param="sparsity.options",
                       code="invalid_value")
    return policy


def _as_request_fields(message: str) -> str:
    """A policy's message names the command line's flags; a request sets ``sparsity.budget`` / ``ratio``."""
    return message.replace("--budget/--ratio", "sparsity.budget/sparsity.ratio").replace(
        "--budget", "sparsity.budget").replace("--ratio", "sparsity.ratio")


def plan_request(body: ChatCompletionRequest | CompletionRequest, engine: SparseEngine, config: ServeConfig,
                 tracer: Tracer, *, request_id: str, force_trace: bool, arrival: float) -> Plan:
    """Validate and encode a request (runs off the event loop: tokenizing a long prompt takes a while)."""
    chat = isinstance(body, ChatCompletionRequest)
    if body.model not in {config.model, engine.model_name}:
        raise APIError(404, f"the model {body.model!r} does not exist on this server (it serves {config.model!r})",
                       param="model", code="model_not_found")
    if body.n is not None and body.n != 1:
        raise APIError(400, f"n must be 1 (generation is greedy: every choice would be the same), got {body.n}",
                       param="n", code="invalid_value")
    context = engine.max_positions
    encoded = _chat_ids(engine.tokenizer, body, context) if chat else _completion_ids(engine.tokenizer, body, context)
    prompt_param = "messages" if chat else "prompt"
    max_tokens = _max_tokens(body, encoded.input_len, engine.max_positions, config, prompt_param)
    policy = _policy(body, config, encoded.input_len)
    sparsity = body.sparsity
    force = force_trace or bool(sparsity and sparsity.trace)
    if force and not tracer.enabled:
        raise APIError(400, "tracing is off on this server (start it with --trace-dir)", param="sparsity.trace",
                       code="tracing_off")
    if config.kv_memory_limit is not None:
        needed = engine.reserved_kv_bytes(encoded, policy, max_tokens)
        if needed > config.kv_memory_limit:
            raise APIError(400, kv_limit_message(
                "this request", needed, config.kv_memory_limit, prompt_len=encoded.input_len, max_new_tokens=max_tokens,
                policy=policy, limit_name="--kv-memory-limit", tokens_name="max_tokens"),
                param="max_tokens", code="kv_memory_limit_exceeded")
    decision = tracer.decide(request_id, force=force, tier=sparsity.tier if sparsity else None)
    return Plan(
        request_id=request_id, operation="chat" if chat else "text_completion", request_model=body.model,
        encoded=encoded, policy=policy, max_tokens=max_tokens, decision=decision, seed=body.seed or 0,
        temperature=body.temperature, top_p=body.top_p, arrival=arrival, arrival_ns=time.time_ns(),
    )
