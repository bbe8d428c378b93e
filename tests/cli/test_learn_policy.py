"""``sparseety learn-policy``: tier-3 traces of a tiny model (a local folder) -> predictor file -> ``run
--policy learned`` with the budget held; clear errors for an empty or missing trace directory and a file
trained for another model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from tiny_models import build_model, build_tokenizer  # noqa: E402

from sparseety.cli import app  # noqa: E402
from sparseety.policies.parts.learned_features import feature_names  # noqa: E402
from sparseety.policies.parts.learned_model import read_predictor  # noqa: E402

PROMPT = " ".join(f"t{4 + (i * 7) % 150}" for i in range(36))


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every test here runs tiny models on one torch thread (``one_torch_thread``, tests/conftest.py)."""


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama saved as a local model folder, and a trace dataset of four tier-3 dense runs of it."""
    root = tmp_path_factory.mktemp("learn")
    folder = root / "tiny-llama"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    torch.set_num_threads(1)
    for i in range(4):
        words = PROMPT.split()
        prompt = " ".join(words[i:] + words[:i])
        done = invoke("run", "--model", str(folder), "--prompt", prompt, "--no-chat", "--policy", "dense",
                      "--tier", "3", "--force-trace", "--max-new-tokens", "6", "--trace-dir", str(root / "traces"),
                      "--no-report", "--json")
        assert done.exit_code == 0, done.output
    return folder, root / "traces"


def test_learn_then_run_the_learned_policy(traced, tmp_path):
    folder, traces = traced
    out = tmp_path / "policy.safetensors"
    done = invoke("learn-policy", str(traces), "-o", str(out), "--epochs", "2", "--seed", "3",
                  "--text-source", "tiny words", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert set(report["metrics"]) == {"learned", "learned_kv_head", "tova", "h2o", "recency"}
    assert all(0.0 <= v <= 1.0 for row in report["metrics"].values() for v in row.values())
    predictor = read_predictor(out)
    provenance = predictor.provenance
    assert predictor.model == str(folder) and provenance["model"] == str(folder)
    assert provenance["model_fingerprint"].startswith("sha256:")
    assert provenance["features"] == feature_names(4, 2) == predictor.features
    assert provenance["trace_dir"] == str(traces) and provenance["text_source"] == "tiny words"
    assert provenance["requests"] == 4 and len(provenance["heldout_request_ids"]) == 1
    assert provenance["config"]["seed"] == 3 and provenance["metrics"] == report["metrics"]

    assert provenance["config"]["label"] == "max" and "the maximum" in provenance["label"]

    table = invoke("learn-policy", str(traces), "-o", str(tmp_path / "again.safetensors"), "--epochs", "1",
                   "--label", "sum")
    assert table.exit_code == 0, table.output
    assert "held-out ranking quality" in table.stdout and "h2o" in table.stdout and "tova" in table.stdout
    assert read_predictor(tmp_path / "again.safetensors").provenance["config"]["label"] == "sum"
    bad = invoke("learn-policy", str(traces), "-o", str(tmp_path / "bad.safetensors"), "--label", "mean")
    assert bad.exit_code == 2 and "--label must be one of max, sum, question" in bad.stderr

    budget, new = 12, 8
    run = invoke("run", "--model", str(folder), "--prompt", PROMPT, "--no-chat", "--policy", "learned",
                 "--policy-opt", f"model={out}", "--budget", str(budget), "--max-new-tokens", str(new),
                 "--trace-dir", str(tmp_path / "run-traces"), "--no-report", "--json")
    assert run.exit_code == 0, run.output
    sparsity = json.loads(run.stdout)["sparsity"]
    assert sparsity["policy"] == "learned" and sparsity["eviction_events"] > 0
    for by_head in sparsity["kept_positions_final"].values():
        assert all(len(kept) == budget for kept in by_head.values())


def test_a_file_for_another_model_is_refused(traced, tmp_path):
    folder, traces = traced
    out = tmp_path / "policy.safetensors"
    assert invoke("learn-policy", str(traces), "-o", str(out), "--epochs", "1").exit_code == 0
    other = tmp_path / "tiny-qwen2"
    build_model("qwen2").save_pretrained(other)
    build_tokenizer().save_pretrained(other)
    run = invoke("run", "--model", str(other), "--prompt", PROMPT, "--no-chat", "--policy", "learned",
                 "--policy-opt", f"model={out}", "--budget", "8", "--max-new-tokens", "2", "--no-report",
                 "--trace-dir", str(tmp_path / "t"))
    assert run.exit_code == 2
    lines = run.stderr.splitlines()  # the threads line, then one error naming both models
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, run.stderr
    assert str(folder) in run.stderr and str(other) in run.stderr and "Traceback" not in run.output


def test_empty_or_missing_trace_dir_fails_clearly(traced, tmp_path):
    folder, _ = traced
    (tmp_path / "empty").mkdir()
    tier2 = invoke("run", "--model", str(folder), "--prompt", PROMPT, "--no-chat", "--policy", "dense",
                   "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "tier2"), "--no-report", "--json")
    assert tier2.exit_code == 0, tier2.output
    for target, message in ((tmp_path / "empty", "not a sparseety trace dataset"),
                            (tmp_path / "tier2", "no tier-3 traces"), (tmp_path / "missing", "does not exist")):
        done = invoke("learn-policy", str(target), "-o", str(tmp_path / "p.safetensors"))
        assert done.exit_code == 2, done.output
        assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
        assert "Traceback" not in done.output
    assert not (tmp_path / "p.safetensors").exists()
    bad = invoke("learn-policy", str(tmp_path / "empty"), "-o", str(tmp_path / "p.bin"))
    assert bad.exit_code == 2 and ".safetensors" in bad.stderr


def test_bench_passkey_takes_the_learned_policy_file(traced, tmp_path):
    folder, traces = traced
    out = tmp_path / "policy.safetensors"
    assert invoke("learn-policy", str(traces), "-o", str(out), "--epochs", "1").exit_code == 0
    args = ["bench", "passkey", "--model", str(folder), "--policies", "learned,tova", "--ratios", "0.5",
            "--lengths", "60", "--depths", "0.5", "--no-chat", "--max-new-tokens", "2", "--quiet"]
    done = invoke(*args, "--policy-opt", f"learned:model={out}", "--out", str(tmp_path / "bench"))
    assert done.exit_code == 0, done.output
    document = json.loads((tmp_path / "bench" / "passkey.json").read_text())
    assert {r["policy"] for r in document["results"]} == {"dense", "learned", "tova"}
    assert document["run"]["policy_opt"] == [f"learned:model={out}"]
    missing = invoke(*args, "--policy-opt", f"learned:model={tmp_path / 'nope.safetensors'}",
                     "--out", str(tmp_path / "b2"))
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    unnamed = invoke(*args, "--out", str(tmp_path / "b3"))
    assert unnamed.exit_code == 2 and "no predictor file" in unnamed.stderr


def test_split_holds_none_out_at_zero_and_always_trains_on_one():
    from sparseety.training.learned_policy import split_requests

    assert split_requests([0] * 5, 0.0, 0)[1] == []
    assert split_requests([0], 0.5, 0) == ([0], [])
    train, held = split_requests([0, 1], 0.9, 0)
    assert len(train) == 1 and len(held) == 1


@pytest.mark.parametrize("target", ["attention", "kvzip"])
def test_no_heldout_set_stores_and_prints_no_heldout_figure(traced, tmp_path, target):
    """--holdout 0, and a dataset of one request: no figure is called held-out, none is stored."""
    folder, traces = traced
    one = tmp_path / "one"
    done = invoke("run", "--model", str(folder), "--prompt", PROMPT, "--no-chat", "--policy", "dense", "--tier", "3",
                  "--force-trace", "--max-new-tokens", "6", "--trace-dir", str(one), "--no-report", "--json")
    assert done.exit_code == 0, done.output
    for source, extra in ((traces, ["--holdout", "0"]), (one, [])):
        out = tmp_path / f"{source.name}-{target}.safetensors"
        args = ["learn-policy", str(source), "-o", str(out), "--epochs", "1", "--target", target, *extra]
        done = invoke(*args, "--json")
        assert done.exit_code == 0, done.output
        report = json.loads(done.stdout)
        provenance = report["provenance"]
        assert provenance["heldout_request_ids"] == [] and "no request was held out" in provenance["metrics_on"]
        if target == "kvzip":
            assert report["heldout"] == [] and report["heldout_mean"] is None
            assert provenance["heldout"] is None and provenance["heldout_mean"] is None
        else:
            assert report["metrics"] is None and provenance["metrics"] is None
        table = invoke(*args)
        assert table.exit_code == 0, table.output
        assert "no held-out set" in table.stdout and "held-out fidelity" not in table.stdout
        assert "held-out ranking" not in table.stdout
        assert ("--holdout 0" if extra else "a single request") in table.stdout


@pytest.mark.parametrize("target", ["attention", "kvzip"])
def test_trace_dir_messages_name_the_real_cause(traced, tmp_path, target):
    folder, traces = traced
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = str(tmp_path / "p.safetensors")
    done = invoke("learn-policy", str(afile), "-o", out, "--target", target)
    assert done.exit_code == 2 and "is a file, expected a trace directory" in done.stderr, done.output
    done = invoke("learn-policy", str(traces), "-o", out, "--target", target, "--model", "gemma3-270m")
    assert done.exit_code == 2, done.output
    assert "no traces of model 'gemma3-270m'" in done.stderr and str(folder) in done.stderr, done.stderr
    assert "at least 32 tokens" not in done.stderr


def test_kvzip_target_on_tier1_traces_names_the_tier_needed(traced, tmp_path):
    folder, _ = traced
    tier1 = tmp_path / "tier1"
    for i in range(2):
        done = invoke("run", "--model", str(folder), "--prompt", PROMPT + f" t{i}", "--no-chat", "--policy", "dense",
                      "--tier", "1", "--max-new-tokens", "2", "--trace-dir", str(tier1), "--no-report", "--json")
        assert done.exit_code == 0, done.output
    done = invoke("learn-policy", str(tier1), "-o", str(tmp_path / "k.safetensors"), "--target", "kvzip")
    assert done.exit_code == 2, done.output
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "store no prompt token ids" in lines[0] and "tier 2 or 3" in lines[0] and "32 tokens" not in lines[0]
