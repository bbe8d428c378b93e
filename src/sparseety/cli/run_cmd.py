"""``sparseety run``: the main job, a traced sparse generation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress

from sparseety.cli.app import app, user_errors
from sparseety.errors import InputError
from sparseety.models.registry import DEFAULT_MODEL


def read_text(path: Path, what: str) -> str:
    """Read a UTF-8 text file named by a flag, with a clear error."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None


@app.command("run")
@user_errors
def run(
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    context_file: Path | None = typer.Option(None, "--context-file", help="Long document, compressed by the policy."),
    question: str | None = typer.Option(None, "--question", help="Question about --context-file, never compressed."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="Chat template (default: on for chat models)."),
    policy: str = typer.Option("dense", "--policy", help="KV policy (see `sparseety policies list`)."),
    budget: int | None = typer.Option(None, "--budget", help="Tokens kept per layer and KV head."),
    ratio: float | None = typer.Option(None, "--ratio", help="Fraction of the context removed (kvpress compression_ratio)."),
    policy_opt: list[str] = typer.Option([], "--policy-opt", help="Policy option key=value (repeatable)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Generation length limit."),
    tier: int = typer.Option(2, "--tier", help="0 nothing, 1 counts, 2 tokens and events, 3 per-step vectors."),
    top_k: int = typer.Option(16, "--top-k", help="Important tokens per layer."),
    speculative: int | None = typer.Option(None, "--speculative", help="Draft N tokens per step by prompt lookup."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help="Where traces are written."),
    seed: int = typer.Option(0, "--seed", help="Seed for seeded policies."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object."),
) -> None:
    """Generate with a sparse KV policy and trace which tokens went in, came out and were evicted."""
    # Heavy imports (torch, transformers) stay out of CLI start-up for the other commands.
    from sparseety.cli.summary import print_summary
    from sparseety.engine import SparseEngine, encode_document, encode_prompt
    from sparseety.models import load_model
    from sparseety.policies import build_policy, parse_policy_opts, resolve_budget
    from sparseety.store import write_trace

    sources = sum(x is not None for x in (prompt, prompt_file, context_file))
    if sources != 1:
        raise InputError("give exactly one of --prompt, --prompt-file or --context-file")
    if (context_file is None) != (question is None):
        raise InputError("--context-file and --question go together")
    if tier not in (0, 1, 2, 3):
        raise InputError(f"--tier must be 0, 1, 2 or 3, got {tier}")
    if top_k <= 0:
        raise InputError(f"--top-k must be positive, got {top_k}")
    options = parse_policy_opts(policy_opt)
    # Validate policy, budget and options before the model loads (a ratio is checked on a large context).
    build_policy(policy, resolve_budget(budget, ratio, 1 << 20), options)
    text = prompt if prompt is not None else None
    if prompt_file is not None:
        text = read_text(prompt_file, "--prompt-file")
    context = read_text(context_file, "--context-file") if context_file is not None else None

    lm, tokenizer = load_model(model)
    if context is not None:
        encoded = encode_document(tokenizer, context, question or "", chat)
    else:
        encoded = encode_prompt(tokenizer, text or "", chat)
    resolved = resolve_budget(budget, ratio, encoded.compress_len or encoded.input_len)
    kv_policy = build_policy(policy, resolved, options)
    engine = SparseEngine(lm, tokenizer, model)

    stderr = Console(stderr=True)
    with Progress(console=stderr, transient=True, disable=as_json or encoded.input_len < 512) as progress:
        task = progress.add_task(f"prefill {encoded.input_len} tokens", total=engine.num_layers)
        result = engine.generate(
            encoded, kv_policy, max_new_tokens=max_new_tokens, tier=tier, top_k=top_k,
            speculative=speculative, seed=seed,
            on_prefill_layer=lambda layer, n: progress.update(task, completed=layer + 1),
        )
    if tier >= 1:
        result.trace_path = str(write_trace(result, trace_dir))
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    console = Console()
    console.print(result.text, markup=False, highlight=False)
    print_summary(result, console)
