"""``sparseety extract``: output formats, precedence of settings, statistics, errors and exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from sparseety.cli import app, extract_cmd
from sparseety.extract import example_record_path

JSONL_KEYS = ["generation_id", "token_id", "position", "score", "layer", "head", "rank", "token_type", "text"]
RNG = np.random.default_rng(7)


def run(*args: str):
    return CliRunner().invoke(app, ["extract", *map(str, args)])


def lines(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def make_record(folder: Path, name: str, scores: np.ndarray, **fields) -> Path:
    np.save(folder / f"{name}.npy", scores)
    n_prompt = fields.pop("n_prompt", None)
    total = fields.pop("total")
    tokens = [int(t) for t in RNG.integers(3, 1000, size=total)]
    n_prompt = total if n_prompt is None else n_prompt
    data = {
        "generation_id": name,
        "prompt_tokens": tokens[:n_prompt],
        "generated_tokens": tokens[n_prompt:],
        "layer": 4,
        "score_type": "attention",
        "scores_path": f"{name}.npy",
        **fields,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def softmax_rows(shape) -> np.ndarray:
    e = np.exp(RNG.normal(size=shape) * 2)
    return e / e.sum(-1, keepdims=True)


CASES = {
    "bhqk-batch": (softmax_rows((2, 3, 4, 12)), {"layout": "bhqk", "batch_index": 1, "total": 12}),
    "hkq-offset": (
        np.swapaxes(softmax_rows((3, 5, 11)), 1, 2).copy(),
        {"layout": "hkq", "token_offset": 1, "total": 12},
    ),
    "qk-prompt-only": (softmax_rows((6, 9)), {"layout": "qk", "total": 12, "n_prompt": 9}),
    "kq-generated": (softmax_rows((4, 10)).T.copy(), {"layout": "kq", "total": 10, "n_prompt": 7}),
    "route": (softmax_rows((10, 8)), {"score_type": "route", "total": 10}),
    "activation": (RNG.normal(size=(10, 32)), {"score_type": "activation", "total": 10, "n_prompt": 6}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_jsonl_matches_the_naive_reference(tmp_path, reference, name):
    scores, fields = CASES[name]
    path = make_record(tmp_path, name, scores, **dict(fields))
    result = run(path, "--top-k", 5, "--min-score", 0.01)
    assert result.exit_code == 0, result.stderr
    rows = lines(result)
    data = json.loads(path.read_text())
    cfg = {k: data[k] for k in ("score_type", "layout", "token_offset", "batch_index") if k in data}
    expected, _ = reference(
        data["prompt_tokens"] + data["generated_tokens"],
        scores,
        cfg | {"top_k": 5, "min_score": 0.01},
        prompt_len=len(data["prompt_tokens"]),
        layer=4,
    )
    keys = JSONL_KEYS + (["experts"] if name == "route" else [])
    assert rows and all(list(row) == keys for row in rows)
    assert all(row["generation_id"] == name and row["text"] is None for row in rows)
    for row, exp in zip(rows, expected, strict=True):
        assert {k: row[k] for k in ("token_id", "position", "layer", "head", "rank", "token_type")} == {
            k: exp[k] for k in ("token_id", "position", "layer", "head", "rank", "token_type")
        }
        assert row["score"] == pytest.approx(exp["score"], rel=1e-6)
        if name == "route":
            assert [e for e, _ in row["experts"]] == [e for e, _ in exp["experts"]]


def test_the_bundled_example_through_the_installed_entry_point():
    sparseety = Path(sys.executable).with_name("sparseety")
    done = subprocess.run(
        [str(sparseety), "extract", str(example_record_path())], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert 1 <= len(rows) <= 16 and [r["rank"] for r in rows] == list(range(len(rows)))
    assert all(list(r) == JSONL_KEYS for r in rows)


def test_table_format(tmp_path):
    path = make_record(tmp_path, "route", CASES["route"][0], **dict(CASES["route"][1]))
    result = run(path, "--format", "table", "--top-k", 3)
    assert result.exit_code == 0, result.stderr
    assert "route · layer 4" in result.stdout and "experts (id:prob)" in result.stdout
    assert len(re.findall(r"\d+:0\.\d{3} \d+:0\.\d{3}", result.stdout)) == 3  # two experts on each of 3 rows
    assert result.stdout.count("\n") > 5 and "{" not in result.stdout


def test_stats_give_percentiles_per_score_type(tmp_path, reference):
    att = make_record(tmp_path, "att", CASES["qk-prompt-only"][0], **dict(CASES["qk-prompt-only"][1]))
    act = make_record(tmp_path, "act", CASES["activation"][0], **dict(CASES["activation"][1]))
    result = run(att, act, "--stats")
    assert result.exit_code == 0, result.stderr
    stats = {row["score_type"]: row for row in lines(result)}
    assert set(stats) == {"attention", "activation"}
    data = json.loads(att.read_text())
    expected, _ = reference(
        data["prompt_tokens"] + data["generated_tokens"],
        CASES["qk-prompt-only"][0],
        {"layout": "qk", "top_k": 100, "min_score": 0.0},
        prompt_len=9,
    )
    values = [r["score"] for r in expected]
    assert stats["attention"]["count"] == 9
    for p in (25, 50, 75, 90):
        assert stats["attention"][f"p{p}"] == pytest.approx(np.percentile(values, p), rel=1e-6)
    table = run(att, "--stats", "--format", "table")
    assert "p90" in table.stdout and "attention" in table.stdout


def test_flags_override_record_fields_which_override_the_yaml_config(tmp_path):
    path = make_record(tmp_path, "r", softmax_rows((3, 4, 12)), layout="hqk", total=12)
    config = tmp_path / "extraction.yaml"
    config.write_text(yaml.safe_dump({"top_k": 3, "min_score": 0.0, "layout": "hkq", "head_reduce": "none"}))
    by_yaml = lines(run(path, "--config", config))
    assert len(by_yaml) == 9 and {r["head"] for r in by_yaml} == {0, 1, 2}  # record's hqk beat the yaml's hkq
    by_flag = lines(run(path, "--config", config, "--top-k", 2, "--head-reduce", "mean", "--layer", 9))
    assert len(by_flag) == 2 and {(r["head"], r["layer"]) for r in by_flag} == {(None, 9)}
    wrong_layout = run(path, "--layout", "hkq")
    assert wrong_layout.exit_code == 2 and "12 (prompt+generated" in wrong_layout.stderr


def test_bad_yaml_config_is_exit_2(tmp_path):
    path = make_record(tmp_path, "r", softmax_rows((3, 4, 12)), total=12)
    config = tmp_path / "c.yaml"
    config.write_text("top_k: 3\nbogus: 1\n")
    result = run(path, "--config", config)
    assert result.exit_code == 2 and "unknown key 'bogus'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--top-k", "0"], "top_k must be greater than 0"),
        (["--min-score", "1.0"], "min_score must be less than 1"),
        (["--min-score", "-0.1"], "min_score must be greater than or equal to 0"),
        (["--score-type", "logits"], "score_type must be 'attention', 'route' or 'activation'"),
        (["--layout", "bqhk"], "layout must be 'bhqk'"),
        (["--normalize", "softmax"], "normalize must be"),
        (["--format", "xml"], "--format must be jsonl or table"),
    ],
)
def test_bad_flags_are_an_error_line_and_exit_2(flags, expected):
    result = run(example_record_path(), *flags)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_bad_records_are_exit_2_alone_and_exit_1_among_good_ones(tmp_path):
    good = make_record(tmp_path, "good", softmax_rows((2, 3, 8)), total=8)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"generation_id": "bad", "prompt_tokens": [1]}))
    alone = run(bad)
    assert alone.exit_code == 2 and "record key 'generated_tokens' is missing" in alone.stderr
    mixed = run(bad, good, tmp_path / "missing.json")
    assert mixed.exit_code == 1
    assert {r["generation_id"] for r in lines(mixed)} == {"good"}
    assert mixed.stderr.count("error: ") == 2 and "records file not found" in mixed.stderr


def test_a_bad_jsonl_line_is_reported_and_the_rest_processed(tmp_path):
    make_record(tmp_path, "a", softmax_rows((2, 3, 8)), total=8)
    good = json.loads((tmp_path / "a.json").read_text())
    path = tmp_path / "many.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                "{oops",
                json.dumps({**good, "generation_id": "b", "layer": "x"}),
                json.dumps({**good, "generation_id": "c"}),
            ]
        )
        + "\n"
    )
    result = run(path)
    assert result.exit_code == 1
    assert {r["generation_id"] for r in lines(result)} == {"a", "c"}
    assert "many.jsonl:2: malformed JSON" in result.stderr and "many.jsonl:3: record key 'layer'" in result.stderr


@pytest.mark.parametrize(
    ("scores_path", "expected"),
    [
        ("../outside.npy", "escapes the base directory"),
        ("/etc/hostname", "escapes the base directory"),
        ("absent.npy", "scores file not found"),
        ("pickled.npy", "pickled data is refused"),
    ],
)
def test_unsafe_or_bad_score_files_are_exit_2(tmp_path, scores_path, expected):
    base = tmp_path / "base"
    base.mkdir()
    np.save(tmp_path / "outside.npy", np.ones((1, 3)))
    np.save(base / "pickled.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    path = base / "r.json"
    path.write_text(
        json.dumps(
            {
                "generation_id": "x",
                "prompt_tokens": [1, 2, 3],
                "generated_tokens": [],
                "layer": 0,
                "score_type": "attention",
                "scores_path": scores_path,
            }
        )
    )
    result = run(path)
    assert result.exit_code == 2 and expected in result.stderr and "Traceback" not in result.stderr


def test_base_dir_flag(tmp_path):
    (tmp_path / "data").mkdir()
    make_record(tmp_path / "data", "r", softmax_rows((2, 3, 8)), total=8)
    (tmp_path / "data" / "r.json").rename(tmp_path / "r.json")
    assert run(tmp_path / "r.json").exit_code == 2
    assert run(tmp_path / "r.json", "--base-dir", tmp_path / "data").exit_code == 0


def test_malformed_json_and_nan_scores_are_exit_2(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    assert run(tmp_path / "bad.json").exit_code == 2
    nan = softmax_rows((2, 3, 8))
    nan[1, 1, 1] = np.nan
    result = run(make_record(tmp_path, "nan", nan, total=8))
    assert result.exit_code == 2 and "NaN or infinite" in result.stderr


class FakeTokenizer:
    all_special_ids = [0, 1]

    def decode(self, ids: list[int]) -> str:
        if ids[0] % 5 == 0:
            raise ValueError("undecodable")
        return f"tok{ids[0]}"


def test_decode_and_exclude_special_use_the_tokenizer(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(extract_cmd, "load_tokenizer", lambda name: loaded.append(name) or FakeTokenizer())
    scores = np.full((1, 6), 0.1)
    scores[0, 0] = 1.0  # a sink on the special token
    np.save(tmp_path / "s.npy", scores)
    (tmp_path / "r.json").write_text(
        json.dumps(
            {
                "generation_id": "d",
                "prompt_tokens": [1, 7, 10, 11],
                "generated_tokens": [12, 13],
                "layer": 0,
                "score_type": "attention",
                "scores_path": "s.npy",
            }
        )
    )
    decoded = lines(run(tmp_path / "r.json", "--decode", "--model", "my-model", "--min-score", 0))
    assert loaded == ["my-model"]
    assert decoded[0]["token_type"] == "special" and decoded[0]["text"] == "tok1"
    assert [r["text"] for r in decoded if r["token_id"] == 10] == [None]  # a failing decode leaves text null
    excluded = lines(run(tmp_path / "r.json", "--exclude-special"))
    assert loaded[-1] == "smollm2-135m" and excluded and all(r["token_id"] != 1 for r in excluded)
    assert excluded[0]["score"] == 1.0 and all(r["text"] is None for r in excluded)
    stats = lines(run(tmp_path / "r.json", "--exclude-special", "--stats"))
    assert stats == [{"score_type": "attention", "count": 5, "p25": 1.0, "p50": 1.0, "p75": 1.0, "p90": 1.0}]


@pytest.mark.model
def test_decode_with_the_default_model_tokenizer():
    result = run(example_record_path(), "--decode", "--exclude-special", "--top-k", 5)
    assert result.exit_code == 0, result.stderr
    rows = lines(result)
    assert len(rows) == 5 and all(isinstance(r["text"], str) for r in rows)
    assert all(not r["text"].startswith("<|") for r in rows)
