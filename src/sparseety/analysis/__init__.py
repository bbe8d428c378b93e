"""Sparse against dense: token diff, teacher-forced fidelity, text quality, budget tuning and bias analysis."""

from sparseety.analysis.compare import Comparison, compare
from sparseety.analysis.fidelity import Fidelity, fidelity, teacher_forced_logprobs
from sparseety.analysis.quality import Quality, quality
from sparseety.analysis.token_diff import DiffOp, TokenDiff, apply_ops, token_diff

__all__ = [
    "Comparison", "compare", "Fidelity", "fidelity", "teacher_forced_logprobs", "Quality", "quality",
    "DiffOp", "TokenDiff", "apply_ops", "token_diff",
]
