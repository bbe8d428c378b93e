"""Turn a prompt, or a long document plus a question, into token ids (chat template when the model has one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseety.errors import InputError


@dataclass(frozen=True)
class EncodedInput:
    """Token ids for one generation.

    Attributes
    ----------
    input_ids : ``[1, input_len]`` everything fed before the first generated token.
    compress_len : for the long-document protocol, the length of the context prefix that is
        prefilled and compressed on its own; None for a plain prompt.
    """

    input_ids: torch.Tensor
    compress_len: int | None = None

    @property
    def input_len(self) -> int:
        return int(self.input_ids.shape[1])


def _ids(tokenizer: object, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])  # type: ignore[operator]


def use_chat(tokenizer: object, chat: bool | None) -> bool:
    """Chat template on by default when the tokenizer has one."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise InputError("--chat was requested but the tokenizer has no chat template")
    return has_template if chat is None else chat


def encode_prompt(tokenizer: object, prompt: str, chat: bool | None) -> EncodedInput:
    """Encode a plain prompt."""
    if not prompt or not prompt.strip():
        raise InputError("the prompt is empty")
    if use_chat(tokenizer, chat):
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = _ids(tokenizer, text, special=False)
    else:
        ids = _ids(tokenizer, prompt, special=True)
    return EncodedInput(torch.tensor([ids], dtype=torch.long))


def encode_document(tokenizer: object, context: str, question: str, chat: bool | None) -> EncodedInput:
    """Encode the long-document protocol: a context to compress, then the question fed uncompressed.

    With a chat template, the user turn is ``context + "\\n\\n" + question``; the formatted text is
    split where the question starts, so the context prefix carries the template's header and the
    question part carries the end of the turn and the assistant prefix.
    """
    if not context or not context.strip():
        raise InputError("the context file is empty")
    if not question or not question.strip():
        raise InputError("the question is empty")
    if use_chat(tokenizer, chat):
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": f"{context}\n\n{question}"}], tokenize=False, add_generation_prompt=True
        )
        cut = text.rfind(question)
        context_ids = _ids(tokenizer, text[:cut], special=False)
        question_ids = _ids(tokenizer, text[cut:], special=False)
    else:
        context_ids = _ids(tokenizer, context, special=True)
        question_ids = _ids(tokenizer, "\n\n" + question, special=False)
    ids = torch.tensor([context_ids + question_ids], dtype=torch.long)
    return EncodedInput(ids, compress_len=len(context_ids))


def encode_with_answer_prefix(tokenizer: object, context: str, question: str, answer_prefix: str,
                              chat: bool | None) -> EncodedInput:
    """:func:`encode_document` with ``answer_prefix`` fed after the question, uncompressed (RULER's protocol).

    With a chat template the prefix starts the assistant turn; without one (a base model) the text is
    ``context + "\\n\\n" + question + " " + answer_prefix``, so a base model answers instead of continuing.
    """
    encoded = encode_document(tokenizer, context, question, chat)
    lead = "" if use_chat(tokenizer, chat) else " "
    prefix_ids = _ids(tokenizer, lead + answer_prefix, special=False)
    ids = torch.cat([encoded.input_ids, torch.tensor([prefix_ids], dtype=torch.long)], dim=1)
    return EncodedInput(ids, compress_len=encoded.compress_len)


def encode_messages(tokenizer: object, messages: list[dict[str, str]]) -> EncodedInput:
    """Encode a chat conversation (``[{"role", "content"}, ...]``) with the tokenizer's template and the
    assistant prefix; the template supplies every special token."""
    if not messages:
        raise InputError("messages is empty")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template; send a completion request instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    return EncodedInput(torch.tensor([_ids(tokenizer, text, special=False)], dtype=torch.long))
