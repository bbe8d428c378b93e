"""A real ``vllm serve`` from the side venv (``scripts/setup-vllm.sh``) on loopback, for the vLLM tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SPARSEETY_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM = VENV / "bin" / "vllm"
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """``vllm serve MODEL`` with prefix caching, KV events, ngram speculative decoding and the plugin on."""

    def __init__(self, model_dir: str, trace_dir: Path, log_path: Path, *, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, speculative: bool = True):
        self.model = model_dir
        self.port = free_port()
        self.kv_port = free_port()
        self.trace_dir = trace_dir
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
        env.update({
            "SPARSEETY_TRACE_DIR": str(trace_dir),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            **(extra_env or {}),
        })
        self.env = env
        self.args = [
            str(VLLM), "serve", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://127.0.0.1:{self.kv_port}"}),
            *(["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
               "--per-request-spec-decode-metrics", "detailed"] if speculative else []),
            "--enable-prompt-tokens-details",
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600) -> VllmServer:
        start = time.monotonic()
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        self.startup_s = time.monotonic() - start
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not start in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def complete(self, prompt: list[int] | str, max_tokens: int, **extra) -> dict:
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "return_token_ids": True, **extra})

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of vLLM's /metrics, labels dropped and summed."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out

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

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)  # its own session: vLLM and the engine it spawned
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


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
