"""Messages that name the field, the value and the limit (issue 25, finding 9): a ratio that is NaN or
infinite, a ratio that leaves fewer slots than a policy must hold, an unreadable --kv-memory-limit, a
file given to learn-policy, and a request over a KV memory limit with the figures that would fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx2 as httpx
import pytest
import torch
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.cli.batch_file import read_batch_file
from sparseety.engine import EncodedInput
from sparseety.engine.batch import BatchEngine
from sparseety.engine.request import GenerationOptions
from sparseety.engine.scheduler import KVLimitError
from sparseety.errors import ConfigError
from sparseety.policies import build_policy, resolve_budget, sized_policy
from sparseety.serve import ServeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_helpers import MODEL, live_server  # noqa: E402


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


# -- a ratio is a finite number in [0, 1), wherever it is given ------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_ratio_flag_says_the_range(value: str):
    result = cli("run", "--prompt", "hi", "--policy", "h2o", "--ratio", value)
    assert result.exit_code == 2
    assert result.stderr == f"error: --ratio must be a finite number in [0, 1), got {value}\n"
    ratios = cli("bench", "passkey", "--ratios", f"0.5,{value}")
    assert ratios.stderr == f"error: --ratios: a ratio must be a finite number in [0, 1), got {value}\n"


def test_a_ratio_out_of_range_keeps_its_message():
    assert cli("run", "--prompt", "hi", "--policy", "h2o", "--ratio", "1.0").stderr == \
        "error: --ratio must be in [0, 1), got 1.0\n"
    with pytest.raises(ConfigError, match=r"^ratio must be a finite number in \[0, 1\), got nan$"):
        resolve_budget(None, float("nan"), 100)


def test_a_non_finite_ratio_in_a_config_file_names_the_key_and_line(tmp_path: Path):
    config = tmp_path / "run.yaml"
    config.write_text("sparsity:\n  policy: h2o\n  ratio: .nan\n")
    result = cli("run", "--config", str(config), "--prompt", "hi")
    assert result.exit_code == 2
    assert result.stderr == f"error: {config}: sparsity.ratio must be a finite number in [0, 1), got nan (line 3)\n"


def test_a_non_finite_ratio_in_a_batch_line_says_the_range(tmp_path: Path):
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"prompt": "hi", "ratio": NaN}\n{"prompt": "hi", "ratio": Infinity}\n'
                     '{"prompt": "hi", "ratio": 0.5}\n')
    lines = read_batch_file(batch)
    assert lines[0] == (1, "ratio: must be a finite number in [0, 1), got nan")
    assert lines[1] == (2, "ratio: must be a finite number in [0, 1), got inf")
    assert lines[2][1].ratio == 0.5


# -- a ratio that leaves fewer slots than the policy must hold names the ratio -------------------------------


def test_a_ratio_too_high_for_streaming_names_the_ratio_and_the_slots():
    with pytest.raises(ConfigError) as caught:
        sized_policy("streaming", None, 0.999, 12)
    assert str(caught.value) == ("ratio 0.999 leaves 1 of the prompt's 12 tokens per layer and KV head, fewer than "
                                 "the 4 streaming must hold (its 4 sinks); use a ratio of at most 0.666")
    assert sized_policy("streaming", None, 0.666, 12).budget == 4  # the advice is right
    with pytest.raises(ConfigError, match=r"no ratio leaves that many: give a budget of at least 4$"):
        sized_policy("streaming", None, 0.0, 3)
    with pytest.raises(ConfigError, match=r"^streaming: budget \(2\) must be >= sinks \(4\)$"):
        sized_policy("streaming", 2, None, 12)  # a budget someone gave is still named as such


@pytest.mark.model  # runs the real default model (through the command line)
def test_run_names_the_ratio_that_leaves_too_few_slots(tmp_path: Path):
    result = cli("run", "--prompt", "The quick brown fox jumps over the lazy dog again and again", "--no-chat",
                 "--policy", "streaming", "--ratio", "0.999", "--trace-dir", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ratio 0.999 leaves 1 of the prompt's ")
    assert "fewer than the 4 streaming must hold (its 4 sinks); use a ratio of at most" in result.stderr
    assert "budget (1)" not in result.stderr


# -- sizes, files -------------------------------------------------------------------------------------------------


def test_an_unreadable_kv_memory_limit_is_named_once():
    result = cli("serve", "--kv-memory-limit", "lots")
    assert result.exit_code == 2
    assert result.stderr == ("error: --kv-memory-limit must be a size such as 512MiB, 2GiB or a number of bytes, "
                             "got 'lots'\n")
    with pytest.raises(ConfigError) as caught:
        ServeConfig(kv_memory_limit="lots")
    assert str(caught.value).count("got 'lots'") == 1


def test_learn_policy_on_a_file_says_it_wants_a_trace_directory(tmp_path: Path):
    file = tmp_path / "traces.txt"
    file.write_text("not a dataset")
    result = cli("learn-policy", str(file), "-o", str(tmp_path / "p.safetensors"))
    assert result.exit_code == 2
    assert result.stderr == (f"error: {file} is a file, expected a trace directory (one written by "
                             "`sparseety run --trace-dir DIR`)\n")


# -- comma lists: one rule for every such flag ---------------------------------------------------------------------


@pytest.mark.parametrize("args,words", [
    (["bench", "passkey", "--ratios", "0.5,,0.5"], "--ratios: item 2 of '0.5,,0.5' is empty"),
    (["bench", "passkey", "--ratios", "0.5,0.50"], "--ratios: 0.50 is listed twice in '0.5,0.50'"),
    (["bench", "passkey", "--policies", "kvzap,kvzap"], "--policies: kvzap is listed twice"),
    (["bench", "passkey", "--lengths", "100,"], "--lengths: item 2 of '100,' is empty"),
    (["bench", "passkey", "--depths", "0.5,0.5"], "--depths: 0.5 is listed twice"),
    (["bench", "ruler", "--lengths", "300,300"], "--lengths: 300 is listed twice"),
    (["bench", "ruler", "--policies", "h2o,,tova"], "--policies: item 2 of 'h2o,,tova' is empty"),
    (["tune", "--metric", "passkey", "--threshold", "0.5", "--policy", "h2o", "--lengths", "100,100"],
     "--lengths: 100 is listed twice"),
])
def test_comma_lists_refuse_empty_items_and_duplicates(args, words, tmp_path: Path):
    result = cli(*args, "--out", str(tmp_path / "o")) if args[0] == "bench" else cli(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and words in result.stderr and result.stderr.count("\n") == 1


# -- a request over a KV memory limit: the figures that would fit ------------------------------------------------


def prompt(n: int) -> EncodedInput:
    return EncodedInput(torch.arange(100, 100 + n).unsqueeze(0))


def test_an_evicting_request_over_the_limit_gets_a_budget_and_a_limit_that_fit(smollm_engine):
    engine, encoded = smollm_engine, prompt(100)
    needed = engine.reserved_kv_bytes(encoded, build_policy("h2o", 64), 20)
    limit = needed // 3
    with pytest.raises(KVLimitError) as caught:
        BatchEngine(engine, kv_memory_limit=limit).add(encoded, build_policy("h2o", 64),
                                                        GenerationOptions(max_new_tokens=20), request_id="r1")
    assert str(caught.value) == (
        f"request 'r1' needs {needed} bytes of KV cache at worst (100 prompt tokens + max_new_tokens 20 under policy "
        f"'h2o' with budget 64: 65 slots per layer and KV head), more than the kv_memory_limit of {limit} bytes "
        f"(room for 21); use a smaller budget (at most 20 slots, a ratio of at least 0.8) or a larger "
        f"kv_memory_limit (at least {needed} bytes)")
    assert engine.reserved_kv_bytes(encoded, build_policy("h2o", 20), 20) <= limit  # the advice fits...
    assert engine.reserved_kv_bytes(encoded, build_policy("h2o", 21), 20) > limit  # ...and is the most that does
    assert engine.reserved_kv_bytes(encoded, sized_policy("h2o", None, 0.8, 100), 20) <= limit


def test_fewer_new_tokens_are_advised_when_they_would_fit(smollm_engine):
    engine, encoded = smollm_engine, prompt(10)
    needed = engine.reserved_kv_bytes(encoded, build_policy("h2o", 64), 100)
    limit = engine.reserved_kv_bytes(encoded, build_policy("dense"), 30)
    with pytest.raises(KVLimitError) as caught:
        BatchEngine(engine, kv_memory_limit=limit).add(encoded, build_policy("h2o", 64),
                                                        GenerationOptions(max_new_tokens=100), request_id="r2")
    assert f"use a smaller budget (at most 38 slots), fewer max_new_tokens (at most 30) or a larger kv_memory_limit " \
           f"(at least {needed} bytes)" in str(caught.value)


def test_the_server_refuses_an_evicting_request_with_figures_and_names_bad_ratios(smollm_engine):
    engine = smollm_engine
    body = {"model": MODEL, "prompt": "word " * 300, "max_tokens": 8, "sparsity": {"policy": "h2o", "budget": 128}}
    encoded = EncodedInput(engine.tokenizer(body["prompt"], return_tensors="pt").input_ids)
    needed = engine.reserved_kv_bytes(encoded, build_policy("h2o", 128), 8)
    limit = needed // 2
    with live_server(engine, kv_memory_limit=limit) as srv:
        def post(payload: dict | str) -> httpx.Response:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            return httpx.post(f"{srv.url}/v1/completions", content=text.encode(), timeout=120,
                              headers={"Content-Type": "application/json"})

        too_big = post(body)
        not_finite = post('{"model": "%s", "prompt": "hi", "max_tokens": 2, "sparsity": {"policy": "h2o", '
                          '"ratio": NaN}}' % MODEL)
        streaming = post({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 2,
                          "sparsity": {"policy": "streaming", "ratio": 0.999}})
    assert too_big.status_code == 400
    error = too_big.json()["error"]
    assert error["code"] == "kv_memory_limit_exceeded"
    assert error["message"].startswith(f"this request needs {needed} bytes of KV cache at worst (")
    assert "under policy 'h2o' with budget 128: 129 slots per layer and KV head), more than the --kv-memory-limit " \
           f"of {limit} bytes (room for 64); use a smaller budget (at most 63 slots, a ratio of at least" \
           in error["message"]
    assert error["message"].endswith(f"or a larger --kv-memory-limit (at least {needed} bytes)")
    assert "use an evicting policy" not in error["message"]
    assert not_finite.status_code == 400
    assert not_finite.json()["error"]["message"] == "sparsity.ratio: must be a finite number in [0, 1), got nan"
    assert streaming.status_code == 400
    assert streaming.json()["error"]["message"].startswith("ratio 0.999 leaves 1 of the prompt's ")
