"""The tools on Gemma 3 270M: the CLI writes a trace whose window edges SQL can read, the report draws
them, the server answers completions (and refuses chat: a base model has no template), models list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import openai
import pytest

from sparseety.engine import encode_prompt
from sparseety.models.registry import resolve_model_dir
from sparseety.policies import build_policy

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()
WINDOW = 512


def sparseety(*args: str) -> subprocess.CompletedProcess:
    """The installed command, in a wide terminal (tables are not wrapped)."""
    command = Path(sys.executable).parent / "sparseety"
    return subprocess.run([str(command), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "250"})


def test_models_list_names_both_models_with_their_geometry():
    out = sparseety("models", "list").stdout
    for expected in ("smollm2-135m", "llama", "gemma3-270m", "gemma3_text", "512 (15 sliding layers)", "Gemma Terms"):
        assert expected in out


def test_the_converted_checkpoint_is_a_plain_hugging_face_directory(gemma):
    config = json.loads((Path(resolve_model_dir("gemma3-270m")) / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["sliding_window"] == WINDOW and "quantization_config" not in config
    assert type(gemma[0]).__name__ == "Gemma3ForCausalLM"  # loaded from that directory by AutoModelForCausalLM


def test_run_writes_window_edges_that_sql_and_the_report_read(tmp_path: Path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(TEXT[:4000])  # about 850 tokens: past one window
    done = sparseety("run", "--model", "gemma3-270m", "--prompt-file", str(prompt), "--policy", "streaming",
                     "--budget", "256", "--max-new-tokens", "3", "--trace-dir", str(tmp_path / "t"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    prompt_tokens = result["usage"]["prompt_tokens"]
    assert prompt_tokens > WINDOW
    files = str(tmp_path / "t" / "token_events" / "**" / "*.parquet")
    rows = duckdb.sql(f"SELECT step, layer, kv_head, position FROM read_parquet('{files}', hive_partitioning = true) "
                      "WHERE event = 'skipped' AND reason = 'window' ORDER BY step, layer").fetchall()
    sliding = [layer for layer in range(18) if layer % 6 != 5]
    assert rows == [(step, layer, -1, prompt_tokens + step - WINDOW) for step in range(3) for layer in sliding]
    assert result["sparsity"]["skipped_events"] == sum(r[3] for r in rows)
    query = sparseety("query", "--trace-dir", str(tmp_path / "t"), "--format", "json",
                      "SELECT count(*) AS n FROM token_events WHERE reason = 'window'")
    assert query.returncode == 0, query.stderr
    assert json.loads(query.stdout) == [{"n": len(rows)}]
    pages = list((tmp_path / "t").rglob("*.html"))
    assert len(pages) == 1
    assert "outside the window (sliding layers)" in pages[0].read_text()


@pytest.fixture(scope="module")
def gemma_server(gemma_engine, tmp_path_factory):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serve"))
    from serve_helpers import LiveServer

    from sparseety.serve import ServeConfig, create_app

    config = ServeConfig(model="gemma3-270m", policy="streaming", budget=64, trace_dir=tmp_path_factory.mktemp("g"),
                         sample_rate=0.0, max_concurrency=2, max_tokens_limit=16)
    server = LiveServer(create_app(config, gemma_engine)).start()
    yield server
    server.stop()


def test_serve_answers_completions_and_refuses_chat_clearly(gemma_engine, gemma_server):
    client = openai.OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = "The capital of France is"
    answer = client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=6, temperature=0)
    direct = gemma_engine.generate(encode_prompt(gemma_engine.tokenizer, prompt, None),
                                   build_policy("streaming", budget=64), max_new_tokens=6, tier=0)
    assert answer.choices[0].text == direct.text
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "chat template" in str(error.value)


def test_bench_passkey_asks_a_base_model_with_an_answer_prefix(gemma_engine):
    from sparseety.suites.passkey import make_case, tokenizer_counter
    from sparseety.suites.passkey_run import answer_case

    case = make_case(700, 0.5, seed=0, count_tokens=tokenizer_counter(gemma_engine.tokenizer))
    result = answer_case(gemma_engine, case, "dense", 0.0, max_new_tokens=10)
    assert result.correct, result.answer
    assert result.answer.strip().startswith(case.passkey)  # it answers at once rather than continuing the prose
