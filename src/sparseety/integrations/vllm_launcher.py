"""A real ``vllm serve`` from the vLLM side venv (``scripts/setup-vllm.sh``) on loopback: the one launcher of
the vLLM tests (``tests/vllm_observer/vllm_server.py`` builds on it) and of the vLLM benchmarks.

It starts ``<venv>/bin/vllm serve MODEL`` as a subprocess in its own session, waits for ``/health``, posts
JSON, reads ``/metrics`` and stops the whole process group (vLLM's front end and the engine it spawned).
Standard library only: it imports nothing of vLLM, torch or :mod:`sparseety.integrations.vllm`, so a test or a
benchmark in the project's venv can drive a server that runs in another one.

The venv is ``SPARSEETY_VLLM_VENV`` if set, else ``.venv-vllm`` at the root of the source checkout. The
server's environment is this process's without any ``SPARSEETY_*`` variable (a server gets only the settings
it is given), with vLLM's and Hugging Face's telemetry and downloads off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  #: the source checkout (src/sparseety/integrations/ -> root)
VENV = Path(os.environ.get("SPARSEETY_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM = VENV / "bin" / "vllm"
#: set for every vLLM process started here: no usage reports, no downloads
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
#: ngram speculative decoding as the live tests run it
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_env(extra: dict[str, str] | None = None, *, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment of a vLLM process: this one's without ``SPARSEETY_*``, ``kv_cache_gib`` GiB of CPU KV
    cache, :data:`QUIET_ENV`, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    return {**env, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **QUIET_ENV, **(extra or {})}


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGINT to ``proc``'s process group (started with ``start_new_session``), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def log_tail(path: Path, n: int = 60) -> str:
    """The last ``n`` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def serve_flags(*, block_size: int | None = None, num_blocks: int | None = None, max_model_len: int | None = None,
                max_num_seqs: int | None = None, max_batched_tokens: int | None = None,
                prefix_caching: bool | None = None, speculative: bool = False,
                prompt_tokens_details: bool = False) -> list[str]:
    """``vllm serve`` flags for the settings given (``None``: vLLM's default); ``speculative``: :data:`NGRAM`
    with per-request metrics."""
    flags: list[str] = []
    for flag, value in (("--block-size", block_size), ("--num-gpu-blocks-override", num_blocks),
                        ("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                        ("--max-num-batched-tokens", max_batched_tokens)):
        if value is not None:
            flags += [flag, str(value)]
    if prefix_caching is not None:
        flags.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if speculative:
        flags += ["--speculative-config", json.dumps(NGRAM), "--per-request-spec-decode-metrics", "detailed"]
    if prompt_tokens_details:
        flags.append("--enable-prompt-tokens-details")
    return flags


class VllmServer:
    """``vllm serve MODEL`` on loopback, float32, eager, KV-cache events on (ZMQ, their own port), then ``flags``
    and last ``extra_args`` (argparse keeps an option's last value, so they override). ``trace_dir`` becomes
    the observer's ``SPARSEETY_TRACE_DIR``; ``extra_env`` is added to :func:`vllm_env`. ``name`` tells servers
    apart in errors."""

    def __init__(self, model_dir: str, trace_dir: Path | None, log_path: Path, *, flags: Sequence[str] = (),
                 extra_env: dict[str, str] | None = None, extra_args: Sequence[str] | None = None,
                 kv_events: bool = True, name: str = "vllm serve") -> None:
        self.model, self.name = model_dir, name
        self.port = free_port()
        self.kv_port = free_port()
        self.trace_dir = trace_dir
        self.log_path = log_path
        self.env = vllm_env({**({"SPARSEETY_TRACE_DIR": str(trace_dir)} if trace_dir is not None else {}),
                             **(extra_env or {})})
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.kv_port}"}
        self.args = [str(VLLM), "serve", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", "float32", "--enforce-eager",
                     *(["--kv-events-config", json.dumps(events)] if kv_events else []), *flags, *(extra_args or [])]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log = None
        self._launched = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> VllmServer:
        """Start the process and return at once (:meth:`wait_ready` waits for it): servers start side by side."""
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop)
        self._launched = time.monotonic()
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 600) -> VllmServer:
        """Wait until ``/health`` answers 200; stops the server and raises with its log if it exits or times out."""
        assert self.proc is not None, "launch() first"
        while time.monotonic() - self._launched < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        self.startup_s = time.monotonic() - self._launched
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not start in {timeout} s:\n{self.log_tail()}")

    def start(self, timeout: float = 600) -> VllmServer:
        return self.launch().wait_ready(timeout)

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def complete(self, prompt: list[int] | str, max_tokens: int, **extra) -> dict:
        """``/v1/completions``, greedy, with the output token ids; ``extra`` adds or overrides body fields."""
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "return_token_ids": True, **extra})

    def completion_tokens(self, prompt: list[int] | str, max_tokens: int, xargs: dict | None = None) -> int:
        """Tokens generated by one greedy request with EOS ignored (a benchmark's unit of work); ``xargs``:
        its ``vllm_xargs``."""
        body = {"ignore_eos": True, "return_token_ids": False, **({"vllm_xargs": xargs} if xargs else {})}
        return self.complete(prompt, max_tokens, **body)["usage"]["completion_tokens"]

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

    def stop(self) -> None:
        """Stop the process group (vLLM and the engine it spawned) and close the log; safe to call twice."""
        if self.proc is not None:
            stop_group(self.proc)
        if self._log is not None:
            self._log.close()
