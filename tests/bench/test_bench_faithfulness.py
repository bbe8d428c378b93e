"""``bench faithfulness`` on a tiny model, against a brute-force computation, and its resume after SIGKILL."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
from killed_bench import SPARSEETY, kill_after_first_case
from tiny_models import build_model, build_tokenizer, prompt_ids
from typer.testing import CliRunner

from sparseety.suites.faithfulness import FRACTIONS, METHODS, counts, run_case, summarize
from sparseety.cli import app
from sparseety.engine import EncodedInput, SparseEngine
from sparseety.policies import build_policy

N, NEW = 30, 4


def brute_logprob(model, context: list[int], answer: list[int]) -> float:
    """log p(answer | context) from one plain forward of the whole sequence, token by token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + answer])).logits[0].double()
    return sum(float(logits[len(context) - 1 + i].log_softmax(-1)[t]) for i, t in enumerate(answer))


@pytest.fixture(scope="module")
def engine() -> SparseEngine:
    return SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama")


def test_numbers_equal_a_brute_force_computation(engine):
    torch.set_num_threads(1)
    prompt = prompt_ids(N, seed=3)[0].tolist()
    row = run_case(engine, 0, "p", prompt, max_new_tokens=NEW)
    reference = build_model("llama")  # never wrapped
    answer = engine.generate(EncodedInput(torch.tensor([prompt])), build_policy("dense"), max_new_tokens=NEW).output_ids
    full = brute_logprob(reference, prompt, answer)
    loo = [full - brute_logprob(reference, prompt[:j] + prompt[j + 1 :], answer) for j in range(N)]
    order = sorted(range(N), key=lambda j: (-loo[j], j))
    for i, k in enumerate(counts(N)):
        top = set(order[:k])
        comp = full - brute_logprob(reference, [t for j, t in enumerate(prompt) if j not in top], answer)
        suff = full - brute_logprob(reference, [t for j, t in enumerate(prompt) if j in top], answer)
        assert row.comprehensiveness["leave_one_out"][i] == pytest.approx(comp, abs=2e-4)
        assert row.sufficiency["leave_one_out"][i] == pytest.approx(suff, abs=2e-4)
    shuffled = list(range(N))
    random.Random(0).shuffle(shuffled)
    k = counts(N)[-1]
    drop = full - brute_logprob(reference, [t for j, t in enumerate(prompt) if j not in set(shuffled[:k])], answer)
    assert row.comprehensiveness["random"][-1] == pytest.approx(drop, abs=2e-4)
    # the value mode's ranking: the engine's importance summed over layers, sinks (position 0 at least) last
    result = engine.generate(EncodedInput(torch.tensor([prompt])), build_policy("dense"), max_new_tokens=NEW,
                             importance="value")
    scores = result.arrays["importance"].astype("float64").sum(0)[:N]
    sinks = set(result.arrays["sink.position"].tolist())
    ranked = sorted((j for j in range(N) if j not in sinks), key=lambda j: (-scores[j], j))
    top = set(ranked[: counts(N)[0]])
    drop = full - brute_logprob(reference, [t for j, t in enumerate(prompt) if j not in top], answer)
    assert row.comprehensiveness["value"][0] == pytest.approx(drop, abs=2e-4)
    assert set(row.comprehensiveness) == set(METHODS) and len(row.top5["value"]) == 5
    table = summarize([row])
    assert table["leave_one_out"]["of_leave_one_out"] == 1.0
    assert table["random"]["aopc_comprehensiveness"] == pytest.approx(sum(row.comprehensiveness["random"]) / 4)
    assert len(FRACTIONS) == 4


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    texts = []
    for i in range(3):
        path = folder / f"text{i}.txt"
        path.write_text("\n".join(" ".join(f"t{5 + (7 * i + 3 * j + w) % 150}" for w in range(6)) for j in range(12)))
        texts += ["--text", str(path)]
    return ["bench", "faithfulness", "--model", str(folder), *texts, "--tokens", "24", "--max-new-tokens", "3"]


@pytest.mark.slow
def test_a_killed_faithfulness_bench_resumes(args: list[str], tmp_path: Path):
    out = tmp_path / "bench"
    kept = kill_after_first_case(args, out, "--out", "faithfulness.json", 3, "faithfulness")
    fresh = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert fresh.exit_code == 2 and "pass --resume" in fresh.stderr
    resumed = subprocess.run([SPARSEETY, *args, "--out", str(out), "--resume"], capture_output=True, text=True,
                             check=True)
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == 3 - len(kept) and lines[-1].startswith("[3/3]")
    done = json.loads((out / "faithfulness.json").read_text())
    assert done["complete"] is True and [r["case"] for r in done["results"]] == [0, 1, 2]
    assert done["results"][: len(kept)] == kept
    assert set(done["summary"]) == set(METHODS) and (out / "faithfulness.png").is_file()


def test_a_changed_passage_is_never_reused_on_resume(args: list[str], tmp_path: Path):
    """The resume key holds each --text file's contents: after a passage changes, --resume is refused (the
    complete document is left as it was), and a result written without the contents is refused clearly."""
    texts = [Path(a) for a in args[args.index("--text") + 1 :: 2] if a.endswith(".txt")]
    copies = []
    for path in texts:
        copies.append(tmp_path / path.name)
        copies[-1].write_text(path.read_text())
    own = [a for a in args if not a.endswith(".txt") and a != "--text"]
    own = own[:own.index("--tokens")] + [x for c in copies for x in ("--text", str(c))] + own[own.index("--tokens"):]
    out = tmp_path / "bench"
    first = CliRunner().invoke(app, [*own, "--out", str(out), "--quiet"])
    assert first.exit_code == 0, first.output
    before = (out / "faithfulness.json").read_text()
    document = json.loads(before)
    assert document["complete"] is True and set(document["run"]["inputs"]) == {str(c) for c in copies}
    again = CliRunner().invoke(app, [*own, "--out", str(out), "--resume", "--quiet"])
    assert again.exit_code == 0, again.output  # the same contents resume (nothing to redo)
    copies[0].write_text("\n".join(" ".join(f"t{9 + (j * w) % 140}" for w in range(6)) for j in range(12)))
    changed = CliRunner().invoke(app, [*own, "--out", str(out), "--resume", "--quiet"])
    assert changed.exit_code == 2, changed.output
    assert changed.stderr.startswith("error: ") and f"the contents of {copies[0]} changed" in changed.stderr
    assert json.loads((out / "faithfulness.json").read_text())["results"] == document["results"]
    old = {**document, "run": {k: v for k, v in document["run"].items() if k != "inputs"}}
    (out / "faithfulness.json").write_text(json.dumps(old))
    copies[0].write_text(texts[0].read_text())
    legacy = CliRunner().invoke(app, [*own, "--out", str(out), "--resume", "--quiet"])
    assert legacy.exit_code == 2 and "does not record its input files' contents" in legacy.stderr, legacy.output
