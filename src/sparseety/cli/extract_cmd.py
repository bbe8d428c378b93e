"""``sparseety extract``: offline records -> ranked token records (JSONL or a table), or score statistics."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app, fail, user_errors
from sparseety.config import ExtractionConfig
from sparseety.errors import ModelLoadError, RecordError, SparseetyError
from sparseety.extract import (
    ExtractionResult,
    OfflineRecord,
    extract_detailed,
    read_records,
)
from sparseety.models import DEFAULT_MODEL

PERCENTILES = (25, 50, 75, 90)


@app.command("extract")
@user_errors
def extract_command(
    records: list[Path] = typer.Argument(..., help="Record files: .json (one record) or .jsonl (one per line)."),
    top_k: int | None = typer.Option(None, "--top-k", help="Most records per ranking [default: 16]."),
    min_score: float | None = typer.Option(None, "--min-score", help="Keep scores >= this, in [0, 1) [default: 0.05]."),
    score_type: str | None = typer.Option(None, "--score-type", help="attention|route|activation."),
    layer: int | None = typer.Option(None, "--layer", help="Layer to report (overrides the record's own)."),
    layout: str | None = typer.Option(None, "--layout", help="Attention axes: bhqk|hqk|qk|bhkq|hkq|kq."),
    head_reduce: str | None = typer.Option(None, "--head-reduce", help="mean|max|none [default: mean]."),
    query_reduce: str | None = typer.Option(None, "--query-reduce", help="sum|mean|max|last [default: sum]."),
    normalize: str | None = typer.Option(None, "--normalize", help="l2|l1|max|none [default: max]."),
    experts_k: int | None = typer.Option(None, "--experts-k", help="Top experts per route record [default: 2]."),
    activation_reduce: str | None = typer.Option(
        None, "--activation-reduce", help="maxabs|l2|nonzero_frac [default: maxabs]."
    ),
    exclude_special: bool = typer.Option(
        False, "--exclude-special", help="Drop special tokens (ids from the config, else from the tokenizer)."
    ),
    base_dir: Path | None = typer.Option(
        None, "--base-dir", help="Folder scores_path is resolved in [default: each record file's folder]."
    ),
    decode: bool = typer.Option(False, "--decode", help="Fill text with the tokenizer of --model."),
    model: str | None = typer.Option(
        None, "--model", help=f"Model whose tokenizer decodes [default: {DEFAULT_MODEL}]."
    ),
    config: Path | None = typer.Option(None, "--config", help="Extraction settings (YAML)."),
    output_format: str = typer.Option("jsonl", "--format", help="jsonl|table."),
    stats: bool = typer.Option(False, "--stats", help="Print the score percentiles per score type instead of records."),
) -> None:
    """Rank the tokens offline records say were important.

    Settings come from the flags, then each record's own fields, then --config, then the defaults.
    """
    if output_format not in ("jsonl", "table"):
        fail(f"--format must be jsonl or table, got {output_format!r}")
    flags: dict[str, Any] = {
        key: value
        for key, value in {
            "top_k": top_k,
            "min_score": min_score,
            "score_type": score_type,
            "layout": layout,
            "head_reduce": head_reduce,
            "query_reduce": query_reduce,
            "normalize": normalize,
            "experts_k": experts_k,
            "activation_reduce": activation_reduce,
            "exclude_special": exclude_special or None,
        }.items()
        if value is not None
    }
    defaults = ExtractionConfig.from_yaml(config).model_dump(exclude_unset=True) if config else {}
    ExtractionConfig(**{**defaults, **flags, "exclude_special": False})  # a bad flag fails before any work

    text_of: Callable[[int], str] | None = None
    wants_special_ids = flags.get("exclude_special") and not defaults.get("special_ids")
    if decode or wants_special_ids:
        tokenizer = _load_tokenizer(model or DEFAULT_MODEL)
        defaults = {"special_ids": tuple(tokenizer.all_special_ids), **defaults}
        if decode:

            def text_of(token_id: int) -> str:
                return tokenizer.decode([token_id])

    out = _Output(output_format, stats)
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
                    entry.load_scores(),
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


def _load_tokenizer(model: str) -> Any:
    """The tokenizer of a built-in model, a local directory or a Hugging Face id (no model weights)."""
    from transformers import AutoTokenizer

    from sparseety.models.registry import resolve_model_dir

    source = resolve_model_dir(model)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {model!r}: {exc}") from None


class _Output:
    """Writes records as they come (JSONL), or collects them for a table or the statistics."""

    def __init__(self, output_format: str, stats: bool) -> None:
        self.output_format = output_format
        self.stats = stats
        self.rows: list[dict[str, Any]] = []
        self.scores: dict[str, list[np.ndarray]] = {}

    def add(self, record: OfflineRecord, config: ExtractionConfig, result: ExtractionResult) -> None:
        if self.stats:
            values = result.token_scores.detach().flatten().float().cpu().numpy()
            candidates = values[np.isfinite(values)]  # tokens left out by exclude_special score -inf
            self.scores.setdefault(config.score_type, []).append(candidates)
            return
        for token in result.records:
            row = {"generation_id": record.generation_id, **token.to_dict()}
            del row["step"]
            if self.output_format == "jsonl":
                sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                self.rows.append(row)

    def finish(self) -> None:
        if self.stats:
            self._print_stats()
        elif self.output_format == "table":
            self._print_table()
        sys.stdout.flush()

    def _print_stats(self) -> None:
        summary = []
        for score_type, chunks in self.scores.items():
            values = np.concatenate(chunks)
            cuts = np.percentile(values, PERCENTILES) if values.size else [float("nan")] * len(PERCENTILES)
            summary.append(
                {"score_type": score_type, "count": int(values.size)}
                | {f"p{p}": float(cut) for p, cut in zip(PERCENTILES, cuts)}
            )
        if self.output_format == "jsonl":
            for line in summary:
                sys.stdout.write(json.dumps(line) + "\n")
            return
        table = Table("score_type", "count", *(f"p{p}" for p in PERCENTILES), title="score distribution")
        for line in summary:
            table.add_row(line["score_type"], str(line["count"]), *(f"{line[f'p{p}']:.4f}" for p in PERCENTILES))
        Console().print(table)

    def _print_table(self) -> None:
        """One table per generation and layer."""
        groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
        for row in self.rows:
            groups.setdefault((row["generation_id"], row["layer"]), []).append(row)
        console = Console()
        for (generation_id, layer), rows in groups.items():
            with_experts = any("experts" in row for row in rows)
            title = f"{generation_id} · layer {_cell(layer)}"
            table = Table("head", "rank", "position", "token_id", "score", "type", "text", title=title)
            if with_experts:
                table.add_column("experts (id:prob)", no_wrap=True)
            for row in rows:
                cells = [
                    _cell(row["head"]),
                    str(row["rank"]),
                    str(row["position"]),
                    str(row["token_id"]),
                    f"{row['score']:.4f}",
                    row["token_type"],
                    "" if row["text"] is None else json.dumps(row["text"], ensure_ascii=False),
                ]
                if with_experts:
                    cells.append(" ".join(f"{e}:{p:.3f}" for e, p in row.get("experts", [])))
                table.add_row(*cells)
            console.print(table)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)
