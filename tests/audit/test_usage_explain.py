"""Usage audit without a server: request parsing, local counts and the causes of disagreements."""

from __future__ import annotations

import json

import pytest

from sparseety.audit.usage import (
    AuditRequest,
    explain_completion,
    explain_prompt,
    local_completion_tokens,
    local_prompt_tokens,
    read_requests,
)
from sparseety.errors import InputError
from sparseety.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


CHAT = AuditRequest(1, "chat", {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another one?"},
]})


@pytest.mark.model  # runs the real default model (through the command line)
def test_local_prompt_count_is_the_templated_conversation(tokenizer):
    ids = tokenizer.apply_chat_template(CHAT.body["messages"], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert local_prompt_tokens(tokenizer, CHAT) == len(ids)
    assert explain_prompt(tokenizer, CHAT, len(ids)) is None


def test_each_known_cause_is_named(tokenizer):
    messages = CHAT.body["messages"]
    raw = len(tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"])
    assert explain_prompt(tokenizer, CHAT, raw).startswith("chat template differs: the server's count is the messages without any template")
    no_prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    count = len(tokenizer(no_prefix, add_special_tokens=False)["input_ids"])
    assert "no assistant prefix" in explain_prompt(tokenizer, CHAT, count)
    again = sum(local_prompt_tokens(tokenizer, AuditRequest(1, "chat", {"messages": messages[: i + 1]}))
                for i in range(len(messages)))
    assert explain_prompt(tokenizer, CHAT, again).startswith("multi-turn duplication")
    local = local_prompt_tokens(tokenizer, CHAT)
    assert "beginning-of-sequence" in explain_prompt(tokenizer, CHAT, local + 1)
    assert explain_prompt(tokenizer, CHAT, local * 3 + 17).startswith("tokenizer vocabulary differs")


def test_completion_counts_include_the_end_of_sequence_token_when_stopped(tokenizer):
    text = "Seven is prime."
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert local_completion_tokens(tokenizer, text, "stop") == n + 1
    assert local_completion_tokens(tokenizer, text, "length") == n
    assert explain_completion(tokenizer, text, "stop", n + 1) is None
    assert "does not count the end-of-sequence" in explain_completion(tokenizer, text, "stop", n)
    assert "vocabulary differs" in explain_completion(tokenizer, text, "length", n + 40)


def test_read_requests_accepts_chat_and_completion_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "max_tokens": 3}) + "\n\n" + json.dumps(CHAT.body) + "\n")
    requests = read_requests(path)
    assert [(r.line, r.kind) for r in requests] == [(1, "completion"), (3, "chat")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json\n", "r.jsonl:1: not JSON"),
        ("[1, 2]\n", "must be a JSON object, got list"),
        ('{"prompt": "a", "messages": []}\n', "exactly one of 'messages' (chat) or 'prompt'"),
        ('{"max_tokens": 3}\n', "exactly one of 'messages' (chat) or 'prompt'"),
        ('{"messages": [{"role": "user"}]}\n', "'messages' must be a non-empty list"),
        ('{"prompt": ""}\n', "'prompt' must be a non-empty string"),
        ("\n", "holds no requests"),
    ],
)
def test_bad_request_files(tmp_path, text, message):
    path = tmp_path / "r.jsonl"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        read_requests(path)
    assert message in str(info.value)


@pytest.mark.model  # runs the real default model (through the command line)
def test_unreachable_server_fails_fast_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from sparseety.cli import app

    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["audit-usage", "--base-url", "http://127.0.0.1:9/v1", "--model", "smollm2-135m",
                                      "--requests", str(path), "--timeout", "2"])
    assert result.exit_code == 2
    assert "error: cannot reach the server at http://127.0.0.1:9/v1" in result.stderr


def test_a_chat_gap_no_variant_explains_is_the_template_when_plain_prompts_agree(tokenizer):
    local = local_prompt_tokens(tokenizer, CHAT)
    assert explain_prompt(tokenizer, CHAT, local * 3 + 17).startswith("tokenizer vocabulary differs")
    cause = explain_prompt(tokenizer, CHAT, local * 3 + 17, vocabulary_agrees=True)
    assert cause.startswith("chat template differs: plain prompts count the same") and f"{local * 3 + 17} tokens" in cause
