"""``sparseety replay``: re-run the extractor on a request's stored tier-3 signals with another config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from sparseety.cli import record_output as shared
from sparseety.cli.app import app, user_errors
from sparseety.cli.query_cmd import TRACE_DIR_HELP
from sparseety.errors import InputError


@app.command("replay")
@user_errors
def replay_command(
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    request_id: str | None = typer.Option(None, "--request-id", help="Request to replay [default: the newest]."),
    top_k: int | None = shared.TOP_K_OPT,
    min_score: float | None = shared.MIN_SCORE_OPT,
    score_type: str | None = shared.SCORE_TYPE_OPT,
    layer: int | None = typer.Option(None, "--layer", help="Only this layer [default: every layer]."),
    head_reduce: str | None = shared.HEAD_REDUCE_OPT,
    query_reduce: str | None = typer.Option(
        None, "--query-reduce", help="sum|mean|max|last over decode forwards [default: sum]."
    ),
    normalize: str | None = shared.NORMALIZE_OPT,
    experts_k: int | None = shared.EXPERTS_K_OPT,
    activation_reduce: str | None = shared.ACTIVATION_REDUCE_OPT,
    exclude_special: bool = shared.EXCLUDE_SPECIAL_OPT,
    decode: bool = typer.Option(False, "--decode", help="Fill text from the stored token texts (else --model)."),
    model: str | None = typer.Option(None, "--model", help="Model whose tokenizer decodes [default: the request's]."),
    config: Path | None = shared.CONFIG_OPT,
    output_format: str = shared.FORMAT_OPT,
    stats: bool = typer.Option(False, "--stats", help="Print the score percentiles instead of records."),
) -> None:
    """Rank a stored request's tokens again from its tier-3 signals, printed as `sparseety extract` prints."""
    from sparseety.cli.record_output import RecordPrinter
    from sparseety.config import ExtractionConfig
    from sparseety.extract import extract_detailed
    from sparseety.models import load_tokenizer
    from sparseety.store import load_trace
    from sparseety.store.replay import replay_inputs

    if output_format not in ("jsonl", "table"):
        raise InputError(f"--format must be jsonl or table, got {output_format!r}")
    flags = shared.given_flags(top_k=top_k, min_score=min_score, score_type=score_type, head_reduce=head_reduce,
                            query_reduce=query_reduce, normalize=normalize, experts_k=experts_k,
                            activation_reduce=activation_reduce, exclude_special=exclude_special)
    defaults = ExtractionConfig.from_yaml(config).model_dump(exclude_unset=True) if config else {}
    defaults.pop("layout", None)  # the stored signals' layout is known
    ExtractionConfig(**{**defaults, **flags, "exclude_special": False})  # a bad flag fails before any work
    trace = load_trace(trace_dir, request_id)
    inputs = replay_inputs(trace, flags.get("score_type") or defaults.get("score_type") or "attention", layer)

    text_of: Callable[[int], str] | None = None
    tokenizer = None
    stored_model = model or str(trace.document.get("model"))
    if flags.get("exclude_special") and not defaults.get("special_ids"):
        tokenizer = load_tokenizer(stored_model)
        defaults = {"special_ids": tuple(tokenizer.all_special_ids), **defaults}
    if decode:
        text_of = _decoder(trace.document, model, stored_model, tokenizer, load_tokenizer)

    out = RecordPrinter(output_format, stats)
    for entry in inputs:
        settings = ExtractionConfig(**{**defaults, **flags, "layout": entry.layout})
        result = extract_detailed(entry.token_ids, entry.scores, settings, text_of,
                                  prompt_len=entry.prompt_len, layer=entry.layer)
        out.add(entry, settings, result)
    out.finish()


def _decoder(document: dict[str, Any], model: str | None, stored_model: str, tokenizer: Any,
             load: Callable[[str], Any]) -> Callable[[int], str]:
    """Token text from the stored texts (no model needed), else from a tokenizer."""
    ids = list(document.get("prompt_token_ids") or []) + list(document.get("output_token_ids") or [])
    texts = document.get("token_texts") or []
    if texts and model is None:
        known = dict(zip(ids, texts))
        return lambda token_id: known[token_id]
    tokenizer = tokenizer or load(stored_model)
    return lambda token_id: tokenizer.decode([token_id])
