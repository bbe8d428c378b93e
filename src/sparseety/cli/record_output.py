"""How ``sparseety extract`` and ``sparseety replay`` print token records: JSONL as they come, a table, or score statistics."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from sparseety.config import ExtractionConfig
    from sparseety.extract.extractor import ExtractionResult
    from sparseety.extract.ingest import OfflineRecord

PERCENTILES = (25, 50, 75, 90)

# Extraction flags shared by ``extract`` and ``replay`` (each a Typer option used as a parameter default).
TOP_K_OPT = typer.Option(None, "--top-k", help="Most records per ranking [default: 16].")
MIN_SCORE_OPT = typer.Option(None, "--min-score", help="Keep scores >= this, in [0, 1) [default: 0.05].")
SCORE_TYPE_OPT = typer.Option(None, "--score-type", help="attention|route|activation [default: attention].")
HEAD_REDUCE_OPT = typer.Option(None, "--head-reduce", help="mean|max|none [default: mean].")
NORMALIZE_OPT = typer.Option(None, "--normalize", help="l2|l1|max|none [default: max].")
EXPERTS_K_OPT = typer.Option(None, "--experts-k", help="Top experts per route record [default: 2].")
ACTIVATION_REDUCE_OPT = typer.Option(None, "--activation-reduce", help="maxabs|l2|nonzero_frac [default: maxabs].")
EXCLUDE_SPECIAL_OPT = typer.Option(
    False, "--exclude-special", help="Drop special tokens (ids from the config, else from the tokenizer).")
CONFIG_OPT = typer.Option(None, "--config", help="Extraction settings (YAML).")
FORMAT_OPT = typer.Option("jsonl", "--format", help="jsonl|table.")


def given_flags(**values: Any) -> dict[str, Any]:
    """The extraction settings given on the command line (``None`` and a false ``exclude_special`` are unset)."""
    if not values.get("exclude_special"):
        values.pop("exclude_special", None)
    return {key: value for key, value in values.items() if value is not None}


class RecordPrinter:
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
        if not result.records:
            _say_why_none(record, config, result)
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


def _say_why_none(record: OfflineRecord, config: ExtractionConfig, result: ExtractionResult) -> None:
    """One ``warning:`` line saying why a record gave no token (instead of silence)."""
    values = result.token_scores.detach().flatten().float().cpu().numpy()
    values = values[np.isfinite(values)]
    if values.size == 0:
        why = "it has no token to rank (empty, or every token left out as special)"
    else:
        why = (f"no token's score reached min_score {config.min_score:g} (highest {float(values.max()):.4g}, "
               f"normalize {config.normalize}); lower --min-score or check the scores' sign")
    print(f"warning: {record.source}: no important token: {why}", file=sys.stderr)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)
