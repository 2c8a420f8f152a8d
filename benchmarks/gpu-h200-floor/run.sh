#!/usr/bin/env bash
# Compiled decoder layers (benchmarks/experiments/compiled_layer.py) on one CUDA GPU, Llama-3.1-8B shape, random
# weights, bf16, int8 caches from local disk and from GPU memory: TTFT with the layers eager and compiled at 4K and 8K, then compiled
# at 32K; each step under a time limit. (The figures in compiled-ab/ came from this script.)
# Usage: bash benchmarks/gpu-h200-floor/run.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench-out/gpu-compiled}"
mkdir -p "$out"
if ! python3 -c "import kvrag.kernels" 2>/dev/null && [ ! -e kvrag/kernels ]; then
    ln -s ../kernels kvrag/kernels && trap 'rm -f kvrag/kernels' EXIT  # what installing maps kvrag.kernels to
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$PWD/$out/inductor-cache"

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to OUT/NAME.log, show the end
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $SECONDS s of the script"; tail -n "${TAIL:-8}" "$out/$name.log"
}
speed() {  # speed NAME on|off SECONDS LENGTHS MODES
    step "$1" "$3" python3 benchmarks/experiments/compiled_layer.py "$2" -v bench speed --arch "${ARCH:-llama-3.1-8b}" \
        --codec int8 --lengths "$4" --tiers "${TIERS:-disk,gpu}" --modes "$5" --repeats 3 --out "$out/$1"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
speed eager-a off 80 4096,8192 full,reuse,probe@0.15,attnlink@16
speed compiled-a on 120 4096,8192 full,reuse,probe@0.15,attnlink@16
speed compiled-32k on 140 32768 full,probe@0.15,attnlink@16,reuse
rm -rf "$out/inductor-cache"
