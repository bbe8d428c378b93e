"""``bench faithfulness`` with learned head weights: the ``learned`` method's numbers against a brute-force
computation, and ``--resume`` adding it to finished cases without redoing their other methods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, build_tokenizer, prompt_ids
from typer.testing import CliRunner

from sparseety.suites.faithfulness import LEARNED, METHODS, add_learned, counts, run_case, summarize
from sparseety.cli import app
from sparseety.engine import EncodedInput, SparseEngine
from sparseety.extract.head_weights import HeadWeights
from sparseety.policies import build_policy

N, NEW = 24, 3


def brute_logprob(model, context: list[int], answer: list[int]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + answer])).logits[0].double()
    return sum(float(logits[len(context) - 1 + i].log_softmax(-1)[t]) for i, t in enumerate(answer))


@pytest.fixture(scope="module")
def engine() -> SparseEngine:
    return SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama")


@pytest.fixture(scope="module")
def weights(engine) -> HeadWeights:
    values = torch.rand(engine.num_layers, engine.num_heads, generator=torch.Generator().manual_seed(1))
    return HeadWeights(values, "output", engine.model_name, engine.model_info.fingerprint())


def test_learned_numbers_equal_a_brute_force_computation(engine, weights):
    torch.set_num_threads(1)
    prompt = prompt_ids(N, seed=7)[0].tolist()
    row = run_case(engine, 0, "p", prompt, max_new_tokens=NEW, head_weights=weights)
    assert set(row.comprehensiveness) == {*METHODS, LEARNED} and len(row.top5[LEARNED]) == 5
    result = engine.generate(EncodedInput(torch.tensor([prompt])), build_policy("dense"), max_new_tokens=NEW,
                             importance="learned", importance_weights=weights)
    scores = result.arrays["importance"].astype("float64").sum(0)[:N]
    sinks = set(result.arrays["sink.position"].tolist())
    ranked = sorted((j for j in range(N) if j not in sinks), key=lambda j: (-scores[j], j))
    reference = build_model("llama")
    full = brute_logprob(reference, prompt, result.output_ids)
    for i, k in enumerate(counts(N)):
        top = set(ranked[:k])
        drop = full - brute_logprob(reference, [t for j, t in enumerate(prompt) if j not in top], result.output_ids)
        assert row.comprehensiveness[LEARNED][i] == pytest.approx(drop, abs=2e-4)
    plain = run_case(engine, 0, "p", prompt, max_new_tokens=NEW)
    assert LEARNED not in plain.comprehensiveness and LEARNED not in summarize([plain])
    added = add_learned(engine, plain, prompt, weights, max_new_tokens=NEW)
    assert added.comprehensiveness[LEARNED] == pytest.approx(row.comprehensiveness[LEARNED], abs=1e-6)
    assert added.sufficiency[LEARNED] == pytest.approx(row.sufficiency[LEARNED], abs=1e-6)
    assert added.top5[LEARNED] == row.top5[LEARNED]
    assert summarize([added])[LEARNED]["aopc_comprehensiveness"] == pytest.approx(sum(row.comprehensiveness[LEARNED]) / 4)


def test_resume_adds_the_learned_method_and_redoes_nothing_else(engine, weights, tmp_path: Path):
    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    texts = []
    for i in range(2):
        path = tmp_path / f"text{i}.txt"
        path.write_text("\n".join(" ".join(f"t{5 + (7 * i + 3 * j + w) % 150}" for w in range(6)) for j in range(12)))
        texts += ["--text", str(path)]
    weights_file = HeadWeights(weights.weights, "output", str(folder), engine.model_info.fingerprint()).save(
        tmp_path / "w.json")
    out = tmp_path / "bench"
    args = ["bench", "faithfulness", "--model", str(folder), *texts, "--tokens", "20", "--max-new-tokens", "2",
            "--out", str(out), "--quiet"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    target = out / "faithfulness.json"
    document = json.loads(target.read_text())
    assert LEARNED not in document["summary"] and document["importance_weights"] is None
    kept = document["results"][0]
    document.update(complete=False, results=[kept])  # as if killed after the first case
    target.write_text(json.dumps(document))
    resumed = CliRunner().invoke(app, [*args, "--resume", "--importance-weights", str(weights_file)])
    assert resumed.exit_code == 0, resumed.output
    done = json.loads(target.read_text())
    assert done["complete"] is True and LEARNED in done["summary"] and done["methods"][-1] == LEARNED
    first_case = done["results"][0]
    for method in METHODS:  # the finished case's own methods are the very numbers it had
        assert first_case["comprehensiveness"][method] == kept["comprehensiveness"][method]
    assert len(first_case["comprehensiveness"][LEARNED]) == 4
    assert done["importance_weights"]["digest"].startswith("sha256:")
    done["complete"] = False
    target.write_text(json.dumps(done))
    refused = CliRunner().invoke(app, [*args, "--resume"])
    assert refused.exit_code == 2
    assert "ranked the learned method with other importance weights" in refused.stderr
