"""``sparseety run --batch-file``: requests from a JSONL file, validated line by line, run as one continuous batch.

Each line is one JSON object: ``prompt`` (text) or ``messages`` (a chat), and optionally ``policy``,
``budget``, ``ratio``, ``max_new_tokens`` and ``request_id``; the command's flags give the defaults.
A bad line is reported on its own (``error: FILE line N: ...``) and the others still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from sparseety.errors import InputError, SparseetyError
from sparseety.options import GenerationOptions
from sparseety.ratio import StrictRatio
from sparseety.request_json import Role, check_text_size, parse_json_object

if TYPE_CHECKING:
    from sparseety.cli.run_inputs import RunInputs
    from sparseety.engine import EncodedInput
    from sparseety.policies import Policy

MAX_LINES = 100_000
REQUEST_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    content: StrictStr


class BatchLine(BaseModel):
    """One line of a batch file."""

    model_config = ConfigDict(extra="forbid")
    prompt: StrictStr | None = None
    messages: list[_Message] | None = None
    policy: StrictStr | None = None
    budget: StrictInt | None = Field(None, ge=1, le=1 << 24)
    ratio: StrictRatio | None = None
    max_new_tokens: StrictInt | None = Field(None, ge=1, le=1 << 20)
    request_id: StrictStr | None = Field(None, pattern=REQUEST_ID)

    @model_validator(mode="after")
    def _one_source(self) -> BatchLine:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.budget is not None and self.ratio is not None:
            raise ValueError("give either 'budget' or 'ratio', not both")
        return self


@dataclass
class BatchItem:
    """A validated, encoded line."""

    line: int
    request_id: str
    encoded: EncodedInput
    policy: Policy  #: ``options``' policy sized on ``encoded``
    options: GenerationOptions  #: the flags' options with what the line sets

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens


def read_batch_file(path: Path) -> list[tuple[int, BatchLine | str]]:
    """Per non-empty line: ``(line number, BatchLine)`` or ``(line number, error message)``.

    Lines are split on bytes and decoded one by one, so a line that is not UTF-8 is refused alone.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read --batch-file {path}: {exc.strerror or exc}") from None
    lines = [(n, raw) for n, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").splitlines(), start=1)
             if raw.strip()]
    if not lines:
        raise InputError(f"--batch-file {path} holds no requests (one JSON object per line)")
    if len(lines) > MAX_LINES:
        raise InputError(f"--batch-file {path} holds {len(lines)} requests, more than {MAX_LINES}")
    return [(n, _parse_line(raw)) for n, raw in lines]


def _parse_line(raw: bytes) -> BatchLine | str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    try:
        return BatchLine.model_validate(parse_json_object(text, what="the line"))
    except InputError as exc:
        return str(exc)
    except ValidationError as exc:
        return "; ".join(_problem(e) for e in exc.errors(include_url=False))


def _problem(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown key {key!r}; known keys: {', '.join(BatchLine.model_fields)}"
    message = str(err.get("ctx", {}).get("error", err["msg"])) if err["type"] == "value_error" else err["msg"]
    return f"{key}: {message}" if key else message


def line_options(line: BatchLine, defaults: GenerationOptions) -> GenerationOptions:
    """The options of one line: ``defaults`` (the command's flags) with the line's ``policy``, ``budget`` or
    ``ratio`` (a budget or ratio on the line replaces both of the flags'; a ``dense`` line takes none of the
    flags', and is refused with one of its own) and ``max_new_tokens``."""
    changes: dict[str, Any] = {"policy": line.policy or defaults.policy,
                               "max_new_tokens": line.max_new_tokens or defaults.max_new_tokens}
    if line.budget is not None or line.ratio is not None or changes["policy"] == "dense":
        changes.update(budget=line.budget, ratio=line.ratio)
    return defaults.replace(**changes)


def encode_item(n: int, line: BatchLine, inputs: RunInputs, tokenizer: Any, default_id: str,
                max_positions: int | None = None) -> BatchItem:
    """Encode one line with the flags' defaults; raises :class:`SparseetyError` naming what was wrong.

    Text that cannot fit in ``max_positions`` tokens is refused by its size in bytes, before tokenizing.
    """
    from sparseety.engine import encode_messages, encode_prompt

    if line.messages is not None:
        check_text_size(sum(len(m.content.encode()) for m in line.messages), "the messages' content", max_positions)
        encoded = encode_messages(tokenizer, [m.model_dump() for m in line.messages])
    else:
        check_text_size(len((line.prompt or "").encode()), "the prompt", max_positions)
        encoded = encode_prompt(tokenizer, line.prompt or "", inputs.chat)
    options = line_options(line, inputs.generation_options())
    policy = options.policy_for(encoded.compress_len or encoded.input_len)
    return BatchItem(n, line.request_id or default_id, encoded, policy, options)


def prepare(path: Path, lines: list[tuple[int, BatchLine | str]], inputs: RunInputs, tokenizer: Any,
            new_id: Any, max_positions: int | None = None) -> tuple[list[BatchItem], list[str]]:
    """Validated items and one error line per rejected line of ``lines`` (:func:`read_batch_file`);
    duplicate ids are rejected too."""
    items: list[BatchItem] = []
    errors: list[str] = []
    seen: set[str] = set()
    for n, line in lines:
        try:
            if isinstance(line, str):
                raise InputError(line)
            item = encode_item(n, line, inputs, tokenizer, new_id(), max_positions)
            if item.request_id in seen:
                raise InputError(f"request_id {item.request_id!r} appears twice")
        except SparseetyError as exc:
            errors.append(f"{path} line {n}: {exc}")
            continue
        seen.add(item.request_id)
        items.append(item)
    return items, errors
