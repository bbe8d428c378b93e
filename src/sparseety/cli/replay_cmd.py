"""``sparseety replay``: re-run the extractor on a request's stored tier-3 signals with another config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from sparseety.cli.app import app, user_errors
from sparseety.cli.query_cmd import TRACE_DIR_HELP
from sparseety.errors import InputError


@app.command("replay")
@user_errors
def replay_command(
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    request_id: str | None = typer.Option(None, "--request-id", help="Request to replay [default: the newest]."),
    top_k: int | None = typer.Option(None, "--top-k", help="Most records per ranking [default: 16]."),
    min_score: float | None = typer.Option(None, "--min-score", help="Keep scores >= this, in [0, 1) [default: 0.05]."),
    score_type: str | None = typer.Option(None, "--score-type", help="attention|route|activation [default: attention]."),
    layer: int | None = typer.Option(None, "--layer", help="Only this layer [default: every layer]."),
    head_reduce: str | None = typer.Option(None, "--head-reduce", help="mean|max|none [default: mean]."),
    query_reduce: str | None = typer.Option(
        None, "--query-reduce", help="sum|mean|max|last over decode forwards [default: sum]."
    ),
    normalize: str | None = typer.Option(None, "--normalize", help="l2|l1|max|none [default: max]."),
    experts_k: int | None = typer.Option(None, "--experts-k", help="Top experts per route record [default: 2]."),
    activation_reduce: str | None = typer.Option(
        None, "--activation-reduce", help="maxabs|l2|nonzero_frac [default: maxabs]."
    ),
    exclude_special: bool = typer.Option(
        False, "--exclude-special", help="Drop special tokens (ids from the config, else from the tokenizer)."
    ),
    decode: bool = typer.Option(False, "--decode", help="Fill text from the stored token texts (else --model)."),
    model: str | None = typer.Option(None, "--model", help="Model whose tokenizer decodes [default: the request's]."),
    config: Path | None = typer.Option(None, "--config", help="Extraction settings (YAML)."),
    output_format: str = typer.Option("jsonl", "--format", help="jsonl|table."),
    stats: bool = typer.Option(False, "--stats", help="Print the score percentiles instead of records."),
) -> None:
    """Rank a stored request's tokens again from its tier-3 signals, printed as `sparseety extract` prints."""
    from sparseety.cli.extract_cmd import _load_tokenizer, _Output
    from sparseety.config import ExtractionConfig
    from sparseety.extract import extract_detailed
    from sparseety.store import load_trace
    from sparseety.store.replay import replay_inputs

    if output_format not in ("jsonl", "table"):
        raise InputError(f"--format must be jsonl or table, got {output_format!r}")
    flags: dict[str, Any] = {
        key: value
        for key, value in {
            "top_k": top_k, "min_score": min_score, "score_type": score_type, "head_reduce": head_reduce,
            "query_reduce": query_reduce, "normalize": normalize, "experts_k": experts_k,
            "activation_reduce": activation_reduce, "exclude_special": exclude_special or None,
        }.items()
        if value is not None
    }
    defaults = ExtractionConfig.from_yaml(config).model_dump(exclude_unset=True) if config else {}
    defaults.pop("layout", None)  # the stored signals' layout is known
    ExtractionConfig(**{**defaults, **flags, "exclude_special": False})  # a bad flag fails before any work
    trace = load_trace(trace_dir, request_id)
    inputs = replay_inputs(trace, flags.get("score_type") or defaults.get("score_type") or "attention", layer)

    text_of: Callable[[int], str] | None = None
    tokenizer = None
    stored_model = model or str(trace.document.get("model"))
    if flags.get("exclude_special") and not defaults.get("special_ids"):
        tokenizer = _load_tokenizer(stored_model)
        defaults = {"special_ids": tuple(tokenizer.all_special_ids), **defaults}
    if decode:
        text_of = _decoder(trace.document, model, stored_model, tokenizer, _load_tokenizer)

    out = _Output(output_format, stats)
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
