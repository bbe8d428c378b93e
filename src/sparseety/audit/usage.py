"""Usage audit: do a remote server's ``usage`` counts agree with the model's own tokenizer and chat template?

For each request the server's ``prompt_tokens`` and ``completion_tokens`` are set against local
counts: the prompt as the tokenizer's chat template renders it (chat) or as the tokenizer encodes it
(completion), the completion as its text re-encodes plus the end-of-sequence token when the server
says it stopped. A disagreement gets the likeliest cause, found by recounting under the variants that
usually explain one (no template, no assistant prefix, special tokens, each turn templated again, a
different vocabulary). A server that reports ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``, OpenAI) gets that count checked and explained too: prompt tokens
read from the prefix cache are part of ``prompt_tokens``, their prefill skipped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from sparseety.errors import InputError


@dataclass(frozen=True)
class AuditRequest:
    """One request from the requests file: a chat (``messages``) or a completion (``prompt``)."""

    line: int
    kind: Literal["chat", "completion"]
    body: dict[str, Any]


@dataclass
class UsageCheck:
    """Server counts against local counts for one request, with the likely cause of any difference."""

    line: int
    kind: str
    server_prompt: int
    local_prompt: int
    server_completion: int
    local_completion: int
    finish_reason: str | None
    prompt_cause: str | None
    completion_cause: str | None
    server_cached: int | None = None  #: ``usage.prompt_tokens_details.cached_tokens``, when the server sends it
    cached_note: str | None = None  #: what the cached count means, or why it cannot be right

    @property
    def agrees(self) -> bool:
        return self.server_prompt == self.local_prompt and self.server_completion == self.local_completion

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "agrees": self.agrees}


def read_requests(path: str | Path) -> list[AuditRequest]:
    """Parse a JSONL file of request bodies; each line has ``messages`` (chat) or ``prompt`` (completion)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read --requests {path}: {exc}") from None
    requests = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(body, dict):
            raise InputError(f"{path}:{number}: each line must be a JSON object, got {type(body).__name__}")
        if ("messages" in body) == ("prompt" in body):
            raise InputError(f"{path}:{number}: give exactly one of 'messages' (chat) or 'prompt' (completion)")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise InputError(f"{path}:{number}: 'messages' must be a non-empty list of {{role, content}} strings")
            requests.append(AuditRequest(number, "chat", body))
        else:
            if not isinstance(body["prompt"], str) or not body["prompt"]:
                raise InputError(f"{path}:{number}: 'prompt' must be a non-empty string")
            requests.append(AuditRequest(number, "completion", body))
    if not requests:
        raise InputError(f"{path} holds no requests")
    return requests


def _template(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = True) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _plain(tokenizer: Any, text: str, special: bool) -> int:
    return len(tokenizer(text, add_special_tokens=special)["input_ids"])


def local_prompt_tokens(tokenizer: Any, request: AuditRequest) -> int:
    """Prompt tokens as the model's own tokenizer and chat template count them."""
    if request.kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(f"line {request.line}: a chat request, but the local tokenizer has no chat template")
        return _template(tokenizer, request.body["messages"])
    return _plain(tokenizer, request.body["prompt"], special=True)


def local_completion_tokens(tokenizer: Any, text: str, finish_reason: str | None) -> int:
    """Completion tokens: the text re-encoded, plus the end-of-sequence token when generation stopped on it."""
    return _plain(tokenizer, text, special=False) + (1 if finish_reason == "stop" else 0)


def explain_prompt(tokenizer: Any, request: AuditRequest, server: int, vocabulary_agrees: bool = False) -> str | None:
    """The likeliest reason the server's prompt count differs from the local one (None when they agree).

    ``vocabulary_agrees``: some plain (completion) prompt of the same audit counted the same on both
    sides, so a chat disagreement no variant explains lies in the template, not the vocabulary.
    """
    local = local_prompt_tokens(tokenizer, request)
    if server == local:
        return None
    variants: list[tuple[str, int]] = []
    if request.kind == "chat":
        messages = request.body["messages"]
        joined = "\n".join(m["content"] for m in messages)
        variants += [
            ("chat template differs: the server's count is the messages without any template", _plain(tokenizer, joined, False)),
            ("chat template differs: the server's count is the messages without a template, plus special tokens",
             _plain(tokenizer, joined, True)),
            ("chat template differs: the server adds no assistant prefix (add_generation_prompt)",
             _template(tokenizer, messages, generation_prompt=False)),
            ("multi-turn duplication: the server counts every earlier turn again with each message",
             sum(_template(tokenizer, messages[: i + 1]) for i in range(len(messages)))),
            ("multi-turn duplication: the server templates each message on its own",
             sum(_template(tokenizer, [m]) for m in messages)),
        ]
    else:
        prompt = request.body["prompt"]
        variants.append(("special tokens: the server adds none of the tokenizer's special tokens", _plain(tokenizer, prompt, False)))
    variants += [
        ("special tokens: the server adds a beginning-of-sequence token", local + 1),
        ("special tokens: the server counts one special token fewer", local - 1),
    ]
    for cause, count in variants:
        if count == server:
            return cause
    if request.kind == "chat" and vocabulary_agrees:
        return (f"chat template differs: plain prompts count the same on both sides, but the server's template "
                f"gives {server} tokens where the local one gives {local}")
    return (f"tokenizer vocabulary differs: no template or special-token variant of the local tokenizer "
            f"(vocabulary {len(tokenizer)}) gives the server's {server} (local {local})")


def explain_completion(tokenizer: Any, text: str, finish_reason: str | None, server: int) -> str | None:
    """The likeliest reason the server's completion count differs (None when they agree)."""
    local = local_completion_tokens(tokenizer, text, finish_reason)
    if server == local:
        return None
    eos = 1 if finish_reason == "stop" else 0
    if server == local - eos:
        return "special tokens: the server does not count the end-of-sequence token"
    if server == local + 1:
        return "special tokens: the server counts one more special token (end-of-sequence or end of turn)"
    if abs(server - local) <= max(2, local // 10):
        return (f"re-encoding the text gives a different split ({local} local vs {server}): the vocabulary "
                "differs, or the server's tokens do not re-encode to themselves")
    return f"tokenizer vocabulary differs: the text re-encodes to {local} tokens locally, the server counted {server}"


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (an object or a dict), None when absent."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else getattr(usage, "prompt_tokens_details", None)
    if details is None:
        return None
    value = details.get("cached_tokens") if isinstance(details, dict) else getattr(details, "cached_tokens", None)
    return None if value is None else int(value)


def explain_cached(server_prompt: int, cached: int | None) -> str | None:
    """What ``cached_tokens`` says about the prompt count (vLLM: ``--enable-prompt-tokens-details``)."""
    if cached is None:
        return None
    if cached < 0 or cached > server_prompt:
        return f"inconsistent: cached_tokens {cached} is outside 0..prompt_tokens ({server_prompt})"
    if cached == 0:
        return "no prompt token came from the prefix cache: all were prefilled"
    if cached == server_prompt:
        return (f"all {cached} prompt tokens came from the prefix cache (vLLM recomputes at least the last "
                "prompt token, so this count is unusual for it)")
    return (f"{cached} of the {server_prompt} prompt tokens came from the server's prefix cache: their "
            f"prefill was skipped, their KV reused, and they are still counted in prompt_tokens; "
            f"{server_prompt - cached} were prefilled")


def audit(client: Any, model: str, requests: list[AuditRequest], tokenizer: Any) -> list[UsageCheck]:
    """Send each request through an ``openai.OpenAI`` client and check its usage block."""
    import openai

    answers = []
    for request in requests:
        body = dict(request.body)
        body.setdefault("max_tokens", 16)
        try:
            if request.kind == "chat":
                response = client.chat.completions.create(model=model, **body)
                choice = response.choices[0]
                text, finish = choice.message.content or "", choice.finish_reason
            else:
                response = client.completions.create(model=model, **body)
                choice = response.choices[0]
                text, finish = choice.text or "", choice.finish_reason
        except openai.APIConnectionError as exc:
            raise InputError(f"cannot reach the server at {client.base_url}: {exc}") from None
        except openai.APIStatusError as exc:
            raise InputError(f"line {request.line}: the server answered {exc.status_code}: {exc.message}") from None
        if response.usage is None:
            raise InputError(f"line {request.line}: the server's response has no usage block")
        answers.append((request, response.usage, text, finish))
    local = [local_prompt_tokens(tokenizer, request) for request, _, _, _ in answers]
    vocabulary_agrees = any(request.kind == "completion" and usage.prompt_tokens == count
                            for (request, usage, _, _), count in zip(answers, local))
    checks = []
    for (request, usage, text, finish), count in zip(answers, local):
        checks.append(UsageCheck(
            line=request.line, kind=request.kind,
            server_prompt=usage.prompt_tokens, local_prompt=count,
            server_completion=usage.completion_tokens,
            local_completion=local_completion_tokens(tokenizer, text, finish),
            finish_reason=finish,
            prompt_cause=explain_prompt(tokenizer, request, usage.prompt_tokens, vocabulary_agrees),
            completion_cause=explain_completion(tokenizer, text, finish, usage.completion_tokens),
            server_cached=cached_tokens(usage),
            cached_note=explain_cached(usage.prompt_tokens, cached_tokens(usage)),
        ))
    return checks
