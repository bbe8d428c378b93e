"""Tiny random-weight models and RunResult helpers for engine tests (built in code, nothing downloaded).

Every family is built from a config with ``torch.manual_seed(0)``, so two builds of one family have
identical weights. The *reference* model used for plain ``generate`` is a separate build that is never
wrapped by :class:`SparseEngine` (which switches its model's attention implementation).

Geometry: hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 16, 4 layers (3 for the MoE families),
vocab 160, float32; ``gemma3`` has sliding-window layers 0-2 (window 8) and a global layer 3. ``eos_token_id`` is None in both config and generation config, so every run
generates exactly ``max_new_tokens`` tokens unless a test sets an eos on purpose.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from sparseety.engine import EncodedInput, SparseEngine

VOCAB = 160
HEAD_DIM = 16
KV_HEADS = 2
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

FAMILIES: dict[str, tuple[type, type, dict]] = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(num_hidden_layers=4)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_hidden_layers=4)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_hidden_layers=3, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    # hybrid: three sliding-window layers (window 8) then a global one, as Gemma 3 interleaves them
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(
        num_hidden_layers=4, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
}
WINDOW = 8  #: the ``gemma3`` family's sliding window
MOE_FAMILIES = ("qwen2_moe", "mixtral")


def build_model(family: str) -> torch.nn.Module:
    """A fresh tiny model of ``family`` with seed-0 random weights (float32, eval mode, SDPA)."""
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**_COMMON, **extra})
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer over the words ``t4 .. t159`` (WordLevel, whitespace split), no downloads."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), VOCAB)})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def prompt_ids(n: int, seed: int = 1) -> torch.Tensor:
    """``[1, n]`` random non-special token ids."""
    return torch.randint(len(SPECIALS), VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def repetitive_ids(n: int) -> torch.Tensor:
    """``[1, n]`` a short cycle repeated: prompt lookup finds drafts in it."""
    cycle = [11, 23, 37, 41, 53, 67, 79]
    return torch.tensor([[cycle[i % len(cycle)] for i in range(n)]])


# -- helpers on RunResult arrays ----------------------------------------------------------------------

def evicted_by_head(result, layer: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, steps)`` of the evictions of one (layer, kv_head)."""
    a = result.arrays
    if "evicted.position" not in a:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    sel = (a["evicted.layer"] == layer) & (a["evicted.kv_head"] == head)
    return a["evicted.position"][sel], a["evicted.step"][sel]


def kept_after_step(result, layer: int, head: int, step: int, seen: int) -> set[int]:
    """Positions held by (layer, head) after the forward of ``step``, when ``seen`` tokens had been fed."""
    positions, steps = evicted_by_head(result, layer, head)
    return set(range(seen)) - set(positions[steps <= step].tolist())


def run(engine: SparseEngine, ids: torch.Tensor, policy, new_tokens: int, **kwargs):
    return engine.generate(EncodedInput(ids), policy, max_new_tokens=new_tokens, **kwargs)
