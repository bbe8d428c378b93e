"""A ``learned`` policy trained on tiny llama, shared by the policy tests and the training tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import build_model, build_tokenizer, prompt_ids

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.policies import build_policy
from sparseety.store import write_trace
from sparseety.training.learned_policy import TrainConfig, learn, read_examples


def train_tiny_learned_policy(tmp: Path):
    """Tier-3 dense traces of tiny llama (long-document protocol) under ``tmp``, a predictor trained on them
    (3 requests trained, 1 held out), and the engine: ``(engine, LearnResult, predictor path)``."""
    torch.set_num_threads(1)
    engine = SparseEngine(build_model("llama"), build_tokenizer(), model_name="tiny-llama")
    for seed in range(4):
        result = engine.generate(EncodedInput(prompt_ids(40, seed=seed), compress_len=32), build_policy("dense"),
                                 max_new_tokens=6, tier=3)
        write_trace(result, tmp / "traces")
    examples = read_examples(tmp / "traces")
    result = learn(engine, examples, TrainConfig(epochs=2, max_examples=2000), trace_dir=str(tmp / "traces"),
                   text_source="random token ids")
    return engine, result, result.predictor.save(tmp / "policy.safetensors")
