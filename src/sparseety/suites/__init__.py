"""Benchmarks of sparse policies: passkey retrieval from real license text."""

from sparseety.suites.passkey import (
    QUESTION,
    PasskeyCase,
    is_correct,
    make_case,
    make_cases,
    tokenizer_counter,
)
from sparseety.suites.passkey_run import (
    PasskeyReport,
    PasskeyResult,
    answer_case,
    run_passkey,
)

__all__ = [
    "QUESTION",
    "PasskeyCase",
    "PasskeyReport",
    "PasskeyResult",
    "answer_case",
    "is_correct",
    "make_case",
    "make_cases",
    "run_passkey",
    "tokenizer_counter",
]
