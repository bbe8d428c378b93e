"""Regenerate the trained policy files that ship in ``src/sparseety/policies/weights/``.

Usage (from a source checkout: the traces are built by ``benchmarks/learned_policy_bench.py``)::

    .venv/bin/python -m sparseety.training.shipped_policies [--models smollm2-135m,gemma3-270m] [--cases 64]
                                                           [--only learned|kvzap] [--reuse-traces]

For each model: (1) training traces, exactly those of ``benchmarks/learned_policy_bench.py`` (retrieval
questions and summaries over documents made of sentences of Python's standard-library docstrings,
600-1,200 tokens, run with ``dense`` at tier 3 under the long-document protocol; never the license
texts of ``bench passkey`` / ``bench ruler``), kept in ``build/shipped_policies/<model>``;
(2) ``learned-<model>.safetensors``: ``sparseety learn-policy DIR`` with its defaults; (3)
``kvzap-linear-<model>.safetensors``: ``sparseety learn-policy DIR --target kvzip`` with its defaults
(ridge per layer on the KVzip+ scores of each traced prompt). Everything is seeded and greedy, so a
rerun on the same versions writes the same weights. Prints each file's held-out figures. One torch thread.

The shipped files were made with (the traces of fewer cases are the first cases of a larger run):

- ``learned-smollm2-135m``: ``benchmarks/results/learned_policy/policy.safetensors`` as committed, written
  by ``benchmarks/learned_policy_bench.py`` (64 cases, the same traces and training as ``--cases 64 --only learned``);
- ``kvzap-linear-smollm2-135m``: ``--models smollm2-135m --cases 26 --only kvzap``;
- ``learned-gemma3-270m``, ``kvzap-linear-gemma3-270m``: ``--models gemma3-270m --cases 16``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  #: the source checkout (src/sparseety/training/ -> root)
WEIGHTS = Path(__file__).resolve().parents[1] / "policies" / "weights"  #: the shipped files (read at run time)
WORK = ROOT / "build" / "shipped_policies"  #: training traces (not committed; rebuilt unless --reuse-traces)
TEXT_SOURCE = ("benchmarks/learned_policy_bench.py training cases: sentences of Python standard-library docstrings "
               "(DOC_MODULES), a hidden fact or a summary request, 600-1200 tokens, dense, tier 3")


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}" if __spec__ else None,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--cases", type=int, default=64, help="training traces per model")
    parser.add_argument("--lengths", default="600,900,1200")
    parser.add_argument("--only", choices=("learned", "kvzap"), default=None)
    parser.add_argument("--reuse-traces", action="store_true", help="keep the traces already built")
    args = parser.parse_args()
    if not (ROOT / "benchmarks" / "learned_policy_bench.py").is_file():
        parser.error(f"needs a source checkout: the training traces are built by benchmarks/learned_policy_bench.py, "
                     f"not found under {ROOT}")

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))  # the checkout's benchmarks package, which is not installed with sparseety
    from benchmarks.learned_policy_bench import build_traces

    from sparseety.training.kvzap_surrogate import KVzapConfig, learn_kvzap, read_contexts
    from sparseety.training.learned_policy import TrainConfig, learn, read_examples
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model

    for name in args.models.split(","):
        lm, tokenizer = load_model(name)
        engine = SparseEngine(lm, tokenizer, name)
        traces = WORK / name
        if not (args.reuse_traces and traces.is_dir()):
            shutil.rmtree(traces, ignore_errors=True)
            build_traces(engine, tokenizer, args.cases, traces, [int(x) for x in args.lengths.split(",")])
        summary: dict[str, object] = {}
        if args.only in (None, "learned"):
            result = learn(engine, read_examples(traces, name), TrainConfig(), trace_dir=str(traces.relative_to(ROOT)),
                           text_source=TEXT_SOURCE, on_progress=print)
            result.predictor.save(WEIGHTS / f"learned-{name}.safetensors")
            summary["learned"] = result.metrics
        if args.only in (None, "kvzap"):
            fitted = learn_kvzap(engine, read_contexts(traces, name), KVzapConfig(),
                                 trace_dir=str(traces.relative_to(ROOT)), text_source=TEXT_SOURCE, on_progress=print)
            fitted.surrogate.save(WEIGHTS / f"kvzap-linear-{name}.safetensors")
            summary["kvzap"] = {"heldout_mean": fitted.surrogate.provenance["heldout_mean"], "per_layer": fitted.per_layer}
        print(json.dumps({name: summary}, indent=2), flush=True)


if __name__ == "__main__":
    main()
