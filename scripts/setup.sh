#!/usr/bin/env bash
# Create .venv and install Traceprop with its test extras. Idempotent.
# Torch: when the venv has none, install the CPU build pinned below first (on these machines the
# wheel lies on disk; a plain "torch" requirement would pull a multi-GB CUDA build). To use a
# CUDA build, install it into .venv yourself before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TRACEPROP_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC (CPU build)"
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
stamp=.venv/.traceprop-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing traceprop and its dependencies"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
