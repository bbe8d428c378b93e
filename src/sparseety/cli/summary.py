"""The human-readable summary ``sparseety run`` prints after the generated text."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sparseety.engine.result import RunResult


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _runs(rows: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Merge consecutive layers with equal (kept, evicted) into ``(first, last, kept, evicted)``."""
    merged: list[tuple[int, int, int, int]] = []
    for layer, kept, evicted in rows:
        if merged and merged[-1][2:] == (kept, evicted) and merged[-1][1] == layer - 1:
            merged[-1] = (merged[-1][0], layer, kept, evicted)
        else:
            merged.append((layer, layer, kept, evicted))
    return merged


def _token_counts(result: RunResult) -> str:
    """Prompt rows each layer computed, consecutive equal layers merged: ``0-8: 300, 9-29: 150``."""
    counts = result.arrays.get("layer_tokens")
    if counts is None:
        return "not recorded"
    runs = _runs([(layer, int(n), 0) for layer, n in enumerate(counts)])
    return ", ".join(f"{a}-{b}: {n}" if a != b else f"{a}: {n}" for a, b, n, _ in runs)


def print_summary(result: RunResult, console: Console, top: int = 10) -> None:
    """Token counts, KV memory against dense, top important tokens, and per-layer kept/evicted."""
    prompt, completion = len(result.prompt_ids), len(result.output_ids)
    tps = result.decode_tokens_per_s
    console.rule("summary")
    console.print(
        f"policy [bold]{result.policy}[/] {result.params or ''} budget={result.budget}  tier={result.tier}\n"
        f"tokens: prompt {prompt}, completion {completion}, total {prompt + completion}\n"
        f"KV cache: peak {_mib(result.kv_cache_bytes_peak)} vs dense {_mib(result.kv_cache_bytes_dense)}"
        f" ({result.kv_cache_bytes_peak / max(1, result.kv_cache_bytes_dense):.1%})\n"
        f"evicted positions {result.evicted_positions}, eviction events {result.eviction_events}, "
        f"skipped (top-k, window) {result.skipped_events}, drafts {result.draft_tokens} (rejected {result.draft_rejected})\n"
        + (f"pruned tokens {result.pruned_tokens} (schedule {result.prune['schedule']}); prompt tokens per layer "
           f"{_token_counts(result)}\n" if result.prune else "")
        + (f"important tokens from layers {result.extraction_layers} (--layers {result.layer_selection})\n"
           if result.layer_selection != "all" and result.extraction_layers is not None else "")
        + f"timings: prefill {result.prefill_s:.2f} s, decode {result.decode_s:.2f} s"
        + (f" ({tps:.1f} tokens/s)" if tps else "")
    )
    overall = [r for r in result.important_tokens if r.layer is None][:top]
    if overall:
        table = Table("rank", "position", "token", "type", "score", title="most important tokens (all layers)")
        for r in overall:
            table.add_row(str(r.rank), str(r.position), repr(r.text), r.token_type, f"{r.score:.3f}")
        console.print(table)
    rows = result.kept_per_layer()
    if rows and result.eviction_events:
        table = Table("layers", "kept slots (all KV heads)", "eviction events", title="per layer")
        for first, last, kept, evicted in _runs(rows):
            table.add_row(str(first) if first == last else f"{first}-{last}", str(kept), str(evicted))
        console.print(table)
    if result.trace_path:
        console.print(f"trace: {result.trace_path}")
