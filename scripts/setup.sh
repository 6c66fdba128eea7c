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
# The real-browser tests drive Debian's chromium; they fail (not skip) without it. Install it when
# missing and we are root; otherwise say what to run.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium (for the real-browser tests)"
    if ! { apt-get update -q >/dev/null && \
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }; then
      echo "setup: ERROR: could not install chromium with apt-get; the browser tests will fail." >&2
      echo "setup: install it yourself (apt-get install chromium) or run: pytest -m 'not browser'" >&2
      exit 1
    fi
  else
    echo "setup: WARNING: /usr/bin/chromium is missing and this is not root: the browser tests will fail." >&2
    echo "setup: run 'sudo apt-get install chromium', or deselect them: pytest -m 'not browser'" >&2
  fi
fi
