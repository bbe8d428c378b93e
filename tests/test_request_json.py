"""``sparseety.request_json``: one JSON object, no key twice at any depth, and the chat roles shared by the
server and ``--batch-file``."""

from __future__ import annotations

import pytest

from sparseety.errors import InputError
from sparseety.request_json import CHAT_ROLES, check_text_size, parse_json_object


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "x", "prompt": "y"}', "the line gives the key 'prompt' twice"),
        ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}', "the line gives the key 'content' twice"),
        ('{"prompt": "x",', "the line is not JSON: Expecting property name enclosed in double quotes at column 16"),
        ('["prompt"]', "the line must be one JSON object, got an array"),
        ("null", "the line must be one JSON object, got null"),
        ("[" * 100_000, "the line is not JSON"),
    ],
)
def test_refused_json(text: str, message: str):
    with pytest.raises(InputError) as info:
        parse_json_object(text, what="the line")
    assert str(info.value).startswith(message)


def test_an_object_is_returned_as_is():
    assert parse_json_object('{"a": {"b": [1, {"c": null}]}, "d": "e"}', what="x") == {"a": {"b": [1, {"c": None}]},
                                                                                     "d": "e"}


def test_the_server_and_the_batch_file_share_the_roles():
    from sparseety.cli.batch_file import _Message
    from sparseety.serve.schemas import ChatMessage

    assert CHAT_ROLES == ("system", "developer", "user", "assistant", "tool")
    assert ChatMessage.model_fields["role"].annotation is _Message.model_fields["role"].annotation


def test_text_size_bound_names_both_sizes():
    check_text_size(128 * 8192, "the prompt", 8192)  # exactly at the bound: accepted
    check_text_size(1 << 40, "the prompt", None)  # context unknown: no bound
    with pytest.raises(InputError) as info:
        check_text_size(128 * 8192 + 1, "the prompt", 8192)
    assert str(info.value) == ("the prompt is 1048577 bytes, more than the 1048576 bytes the model's context of 8192 "
                               "tokens can hold (128 bytes a token at most); refused before tokenizing")


def test_the_default_models_longest_token_is_within_the_bound(smollm):
    """The byte bound never refuses a prompt that would fit: no token of the default model is longer."""
    from sparseety.request_json import MAX_BYTES_PER_TOKEN

    _, tokenizer = smollm
    longest = max(len(tokenizer.convert_tokens_to_string([t]).encode()) for t in tokenizer.get_vocab())
    assert longest <= MAX_BYTES_PER_TOKEN
