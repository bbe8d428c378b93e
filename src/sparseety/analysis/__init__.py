"""Sparse against dense: token diff, teacher-forced fidelity, text quality, budget tuning and bias analysis."""

from sparseety.analysis.bias import BiasReport, bias_report
from sparseety.analysis.compare import Comparison, compare
from sparseety.analysis.fidelity import Fidelity, fidelity, teacher_forced_logprobs
from sparseety.analysis.quality import Quality, quality
from sparseety.analysis.token_diff import DiffOp, TokenDiff, apply_ops, token_diff
from sparseety.analysis.tune import TuneResult, tune_fidelity, tune_passkey

__all__ = [
    "BiasReport",
    "Comparison",
    "DiffOp",
    "Fidelity",
    "Quality",
    "TokenDiff",
    "TuneResult",
    "apply_ops",
    "bias_report",
    "compare",
    "fidelity",
    "quality",
    "teacher_forced_logprobs",
    "token_diff",
    "tune_fidelity",
    "tune_passkey",
]
