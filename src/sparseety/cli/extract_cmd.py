"""``sparseety extract``: offline records -> ranked token records (JSONL or a table), or score statistics."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import typer

from sparseety.cli import record_output as shared
from sparseety.cli.app import app, fail, user_errors
from sparseety.cli.record_output import RecordPrinter
from sparseety.config import ExtractionConfig
from sparseety.errors import RecordError, SparseetyError
from sparseety.extract import (
    extract_detailed,
    read_records,
)
from sparseety.models import DEFAULT_MODEL, load_tokenizer


@app.command("extract")
@user_errors
def extract_command(
    records: list[Path] = typer.Argument(..., help="Record files: .json (one record) or .jsonl (one per line)."),
    top_k: int | None = shared.TOP_K_OPT,
    min_score: float | None = shared.MIN_SCORE_OPT,
    score_type: str | None = shared.SCORE_TYPE_OPT,
    layer: int | None = typer.Option(None, "--layer", help="Layer to report (overrides the record's own)."),
    layout: str | None = typer.Option(None, "--layout", help="Attention axes: bhqk|hqk|qk|bhkq|hkq|kq."),
    head_reduce: str | None = shared.HEAD_REDUCE_OPT,
    query_reduce: str | None = typer.Option(None, "--query-reduce", help="sum|mean|max|last [default: sum]."),
    normalize: str | None = shared.NORMALIZE_OPT,
    experts_k: int | None = shared.EXPERTS_K_OPT,
    activation_reduce: str | None = shared.ACTIVATION_REDUCE_OPT,
    exclude_special: bool = shared.EXCLUDE_SPECIAL_OPT,
    base_dir: Path | None = typer.Option(
        None, "--base-dir", help="Folder scores_path is resolved in [default: each record file's folder]."
    ),
    decode: bool = typer.Option(False, "--decode", help="Fill text with the tokenizer of --model."),
    model: str | None = typer.Option(
        None, "--model", help=f"Model whose tokenizer decodes [default: {DEFAULT_MODEL}]."
    ),
    config: Path | None = shared.CONFIG_OPT,
    output_format: str = shared.FORMAT_OPT,
    stats: bool = typer.Option(False, "--stats", help="Print the score percentiles per score type instead of records."),
) -> None:
    """Rank the tokens offline records say were important.

    Settings come from the flags, then each record's own fields, then --config, then the defaults.
    """
    if output_format not in ("jsonl", "table"):
        fail(f"--format must be jsonl or table, got {output_format!r}")
    flags = shared.given_flags(top_k=top_k, min_score=min_score, score_type=score_type, layout=layout,
                            head_reduce=head_reduce, query_reduce=query_reduce, normalize=normalize,
                            experts_k=experts_k, activation_reduce=activation_reduce, exclude_special=exclude_special)
    defaults = ExtractionConfig.from_yaml(config).model_dump(exclude_unset=True) if config else {}
    ExtractionConfig(**{**defaults, **flags, "exclude_special": False})  # a bad flag fails before any work

    text_of: Callable[[int], str] | None = None
    wants_special_ids = flags.get("exclude_special") and not defaults.get("special_ids")
    if decode or wants_special_ids:
        tokenizer = load_tokenizer(model or DEFAULT_MODEL)
        defaults = {"special_ids": tuple(tokenizer.all_special_ids), **defaults}
        if decode:

            def text_of(token_id: int) -> str:
                return tokenizer.decode([token_id])

    out = RecordPrinter(output_format, stats)
    failed = succeeded = 0
    for path in records:
        try:
            entries = read_records(path, base_dir)
        except RecordError as exc:
            entries = [exc]
        for entry in entries:
            if isinstance(entry, RecordError):
                failed += 1
                print(f"error: {entry}", file=sys.stderr)
                continue
            try:
                settings = ExtractionConfig(**{**defaults, **entry.config_fields(), **flags})
                result = extract_detailed(
                    entry.token_ids,
                    entry.scores_for(settings),
                    settings,
                    text_of,
                    prompt_len=len(entry.prompt_tokens),
                    layer=entry.layer if layer is None else layer,
                    step=entry.step,
                )
            except SparseetyError as exc:
                failed += 1
                print(f"error: {entry.source}: {exc}", file=sys.stderr)
                continue
            succeeded += 1
            out.add(entry, settings, result)
    out.finish()
    if failed:
        raise typer.Exit(1 if succeeded else 2)
