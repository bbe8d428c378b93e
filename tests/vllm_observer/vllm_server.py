"""The vLLM tests' launcher: :mod:`sparseety.integrations.vllm_launcher` (a real ``vllm serve`` of the side
venv on loopback, shared with the benchmarks) with the tests' flags, and what only the tests need: skipping
(or failing, in CI) without the side venv, and waiting for the observer's stored rows.

A test module that imports :func:`require_vllm` from here starts vLLM processes: ``tests/conftest.py`` gives
its tests the ``vllm`` marker.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparseety.integrations.vllm_launcher import VENV, VLLM, free_port, serve_flags
from sparseety.integrations.vllm_launcher import VllmServer as _Launcher

__all__ = ["BLOCK_SIZE", "MAX_BATCHED_TOKENS", "MAX_MODEL_LEN", "NUM_BLOCKS", "ROOT", "VENV", "VLLM", "VllmServer",
           "free_port", "require_vllm", "wait_for_vllm_rows"]

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # CPU_ATTN takes multiples of 32
NUM_BLOCKS = 32  # 1,024 tokens of KV: small enough to force evictions and preemptions
MAX_MODEL_LEN = 768
MAX_BATCHED_TOKENS = 128  # prompts of a few hundred tokens are prefilled in several chunks


def require_vllm() -> None:
    """Skip when the side venv is absent outside CI; in CI (which builds it) its absence fails the test."""
    if VLLM.is_file():
        return
    reason = f"the vLLM side venv {VENV} is absent: build it with `bash scripts/setup-vllm.sh`"
    if os.environ.get("CI"):
        pytest.fail(reason + " (CI runs scripts/setup.sh --test, which builds it)")
    pytest.skip(reason)


class VllmServer(_Launcher):
    """``vllm serve MODEL`` with prefix caching, KV events, ngram speculative decoding (``speculative``), the
    plugin on and the tests' small KV cache (:data:`NUM_BLOCKS` blocks of :data:`BLOCK_SIZE`)."""

    def __init__(self, model_dir: str, trace_dir: Path, log_path: Path, *, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, speculative: bool = True):
        flags = serve_flags(prefix_caching=True, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                            max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_batched_tokens=MAX_BATCHED_TOKENS,
                            speculative=speculative, prompt_tokens_details=True)
        super().__init__(model_dir, trace_dir, log_path, flags=flags, extra_env=extra_env, extra_args=extra_args)

    def stored(self, request_ids: list[str], columns: str = "extra_json", timeout: float = 120) -> dict[str, tuple]:
        """``request id -> (columns...)`` of the ``requests`` rows of ``request_ids``, once all are stored (the
        observer writes them after the answers go out); fails with the server's log after ``timeout`` seconds."""
        from sparseety.store import connect

        deadline = time.monotonic() + timeout
        while True:
            try:
                rows = connect(self.trace_dir).sql(f"SELECT request_id, {columns} FROM requests").fetchall()
                found = {r[0]: tuple(r[1:]) for r in rows if r[0] in request_ids}
                if len(found) == len(set(request_ids)):
                    return found
            except Exception:  # a commit in progress: ask again
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"records of {sorted(request_ids)} not stored:\n{self.log_tail()}")
            time.sleep(1)


@contextlib.contextmanager
def side_by_side(*servers: VllmServer, timeout: float = 600) -> Iterator[tuple[VllmServer, ...]]:
    """Launch every server at once, wait for each, hand them over and stop them all at the end: their starts
    overlap (much of a start is one process importing at a time), and no test runs until all are ready."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(timeout)
        yield servers
    finally:
        for server in servers:
            server.stop()


def wait_for_vllm_rows(trace_dir: Path, expected: int, timeout: float = 60.0) -> int:
    """Wait until ``trace_dir`` holds ``expected`` vLLM request rows (the observer writes them after the
    answers go out) or ``timeout`` seconds pass; the number stored."""
    from sparseety.store import list_traces

    def stored() -> int:
        try:
            return len([t for t in list_traces(trace_dir, limit=1000) if t.get("policy") == "vllm"])
        except Exception:  # a commit in progress: ask again
            return 0

    deadline = time.monotonic() + timeout
    while (count := stored()) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return count
