"""``sparseety serve``: the OpenAI-compatible sparse server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.output_opts import output_dir
from sparseety.options import default_of
from sparseety.run_file import with_run_file

if TYPE_CHECKING:
    from sparseety.serve import ServeConfig


@app.command("serve")
@user_errors
@with_run_file
def serve(
    ctx: typer.Context,
    config: Path | None = opt.CONFIG_OPT,
    model: str = opt.MODEL_OPT,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    policy: str = typer.Option(default_of("policy"), "--policy", help="Default KV policy (a request may override it)."),
    budget: int | None = opt.BUDGET_OPT,
    ratio: float | None = typer.Option(None, "--ratio", help="Fraction of each prompt removed."),
    policy_opt: list[str] = opt.POLICY_OPT_OPT,
    trace_dir: Path | None = typer.Option(None, "--trace-dir", help="Trace store; without it nothing is traced.",
                                          parser=output_dir, metavar="DIR"),
    sample_rate: float | None = typer.Option(None, "--sample-rate", help="Share of requests traced (hash of the "
                                             "id); default 0.05. Needs --trace-dir."),
    tier: int = typer.Option(default_of("tier"), "--tier", help="Tier of sampled requests (forced ones get 3, the rest 1)."),
    top_k: int = typer.Option(default_of("top_k"), "--top-k", help="Important tokens per layer in traces."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SPARSEETY_API_KEY",
                                       help="Bearer key for /v1 (also turns the trace endpoints on)."),
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="Sequences decoded together (one "
                                        "continuous batch)."),
    max_queue: int | None = typer.Option(None, "--max-queue", help="Requests waiting before 429 (default 4 x "
                                         "--max-concurrency)."),
    kv_memory_limit: str | None = typer.Option(None, "--kv-memory-limit", help="KV bytes the batch may reserve, "
                                               "e.g. 512MiB (each request reserves its worst case)."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="Prompt tokens prefilled per step."),
    threads: int | None = typer.Option(None, "--threads", help="Torch threads of the engine loop (default: "
                                       "cores - 1, at least 1)."),
    max_tokens_limit: int = typer.Option(256, "--max-tokens-limit", help="Largest max_tokens a request may ask."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body (else 413)."),
    redact: bool = typer.Option(False, "--redact", help="Redact e-mails, phone numbers, keys... in stored traces."),
    ids_only: bool = typer.Option(False, "--ids-only", help="Store token ids only, no text."),
    otlp_endpoint: str | None = typer.Option(None, "--otlp-endpoint", help="Export spans over OTLP/HTTP (needs "
                                             "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
    prune_schedule: str | None = opt.PRUNE_SCHEDULE_OPT,
    prune_opt: list[str] = opt.PRUNE_OPT_OPT,
    attention_topk: int | None = opt.ATTENTION_TOPK_OPT,
    layers: str = opt.LAYERS_OPT,
    importance: str = opt.IMPORTANCE_OPT,
    importance_weights: Path | None = opt.IMPORTANCE_WEIGHTS_OPT,
    sql_timeout: float = typer.Option(10.0, "--sql-timeout", help="Seconds a trace endpoint's read may run (else 503)."),
    sql_memory_limit: str = typer.Option("512MiB", "--sql-memory-limit", help="Memory DuckDB may use per trace "
                                         "endpoint read (no spilling to disk)."),
    sql_threads: int = typer.Option(1, "--sql-threads", help="DuckDB threads per trace endpoint read."),
) -> None:
    """Serve a model behind the OpenAI API with a sparse KV policy, Prometheus /metrics and sampled tracing."""
    from sparseety.errors import ConfigError
    from sparseety.policies import parse_policy_opts
    from sparseety.units import parse_size

    if trace_dir is None and (sample_rate is not None or redact or ids_only):
        raise ConfigError("--sample-rate, --redact and --ids-only apply to stored traces: give --trace-dir too")

    serve_config = _config_naming_flags(
        model=model, host=host, port=port, policy=policy, budget=budget, ratio=ratio,
        policy_opts=parse_policy_opts(policy_opt), trace_dir=trace_dir,
        sample_rate=0.05 if sample_rate is None else sample_rate, tier=tier,
        top_k=top_k, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
        kv_memory_limit=None if kv_memory_limit is None else parse_size(kv_memory_limit, "--kv-memory-limit"),
        prefill_chunk=prefill_chunk, threads=threads,
        max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes, redact=redact, ids_only=ids_only,
        otlp_endpoint=otlp_endpoint, prune_schedule=prune_schedule,
        prune_opts=parse_policy_opts(prune_opt, flag="--prune-opt"), attention_topk=attention_topk, layers=layers,
        importance=importance, importance_weights=importance_weights,
        sql_timeout=sql_timeout, sql_memory_limit=sql_memory_limit, sql_threads=sql_threads,
    )
    from sparseety.serve import create_app
    from sparseety.serve.shutdown import interrupt_on_sigterm, serve_until_stopped

    import torch

    torch.set_num_threads(serve_config.torch_threads())
    try:
        with interrupt_on_sigterm():
            server_app = create_app(serve_config)
    except KeyboardInterrupt:  # SIGINT or SIGTERM while the model loads: stop quietly
        print("sparseety serve: stopped while loading the model", file=sys.stderr, flush=True)
        return
    limit = serve_config.kv_memory_limit
    print(f"sparseety serve: {model} on http://{host}:{port} (policy {policy}, batch of up to "
          f"{serve_config.max_concurrency} sequences, KV limit {'none' if limit is None else f'{limit} bytes'}, "
          f"{serve_config.torch_threads()} torch thread(s), tracing {'to ' + str(trace_dir) if trace_dir else 'off'})",
          file=sys.stderr, flush=True)
    serve_until_stopped(server_app, host=host, port=port, log_level=log_level)


#: ``ServeConfig`` fields whose flag is not the field's name with dashes
_FLAGS = {"policy_opts": "--policy-opt", "prune_opts": "--prune-opt"}


def _config_naming_flags(**fields: Any) -> ServeConfig:
    """``ServeConfig(**fields)``; a refusal names serve's flags (``--max-body-bytes``), never the config's fields."""
    from sparseety.errors import ConfigError
    from sparseety.serve import ServeConfig

    try:
        return ServeConfig(**fields)
    except ConfigError as exc:
        problems = []
        for problem in str(exc).removeprefix(f"invalid {ServeConfig.__name__}: ").split("; "):
            field = problem.split(" ", 1)[0]
            if field in ServeConfig.model_fields:
                problem = _FLAGS.get(field, "--" + field.replace("_", "-")) + problem[len(field):]
            problems.append(problem)
        raise ConfigError("; ".join(problems)) from None
