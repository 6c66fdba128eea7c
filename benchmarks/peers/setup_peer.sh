#!/usr/bin/env bash
# Create benchmarks/peers/.venvs/NAME with torch 2.13.0 (CPU wheel), the peer from PyPI, and
# Traceprop (editable, --no-deps) so both run in one process.  NAME: logix | bergson | kronfluence | traker | dattri
set -euo pipefail
NAME=${1:?usage: setup_peer.sh NAME}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3.11}
VENV_ROOT=${VENV_ROOT:-$HERE/.venvs}   # override to build elsewhere (e.g. to re-check this script)
VENV="$VENV_ROOT/$NAME"
mkdir -p "$VENV_ROOT"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip wheel setuptools
"$PIP" install -q torch==2.13.0            # first: the CPU wheel on this machine's disk
# keep it: a peer whose deps (e.g. the newest torchvision) want another torch would otherwise pull
# a multi-GB CUDA build; with the pin pip picks the releases compatible with torch 2.13.0.
PIN="$VENV_ROOT/torch-pin.txt"
echo "torch==2.13.0" > "$PIN"
export PIP_CONSTRAINT="/etc/xdg/pip/constraints.txt $PIN"
TP_DEPS="h5py numpy transformers tokenizers polars tqdm faiss-cpu scipy peft psutil"
case "$NAME" in
  logix)       # logix-ai 0.1.1 declares Requires-Python <3.11; --ignore-requires-python alone lets pip pick
               # numpy 2.5 (needs Python 3.12) for it, so: its deps (numpy einops pyyaml torch tqdm) normally,
               # then the package itself with --no-deps.
               "$PIP" install numpy einops pyyaml tqdm
               "$PIP" install --ignore-requires-python --no-deps logix-ai ;;
  bergson)     "$PIP" install bergson
               # bergson declares torchvision + torchaudio; under the torch pin pip picks PyPI's CUDA
               # builds (torchvision 0.28.0, torchaudio 2.11.1) whose ops do not load against the CPU
               # torch ("operator torchvision::nms does not exist"), which breaks `import transformers`
               # models. bergson's own code imports neither, so they are removed.
               "$PIP" uninstall -y torchvision torchaudio ;;
  kronfluence) "$PIP" install kronfluence
               # same torchvision problem as bergson (declared, never imported by kronfluence)
               "$PIP" uninstall -y torchvision ;;
  traker)      "$PIP" install traker ;;
  dattri)      "$PIP" install dattri dattri-llm ;;
  *)           echo "unknown peer $NAME" >&2; exit 2 ;;
esac
"$PIP" install -q $TP_DEPS
"$PIP" install -q --no-deps -e "$ROOT"
"$VENV/bin/python" - <<PY
import torch, importlib.metadata as md
print("torch", torch.__version__)
for d in ["logix-ai", "bergson", "kronfluence", "traker", "dattri", "transformers", "traceprop"]:
    try: print(d, md.version(d))
    except md.PackageNotFoundError: pass
PY
"$PIP" freeze > "$VENV_ROOT/$NAME.freeze.txt"
