#!/usr/bin/env bash
# GPU checks and benchmarks on a CUDA machine (random-weight Llama-3.1-8B shape, bf16), each step under a time limit
# so that one call of a few minutes covers them all:
#   1. the GPU tests (plain decoder layers against transformers' in bf16, the Triton cachegen decoder bit for bit
#      against the host decoder, FlexAttention, loading and the speed bench on CUDA);
#   2. the cachegen decoder's throughput (`kvrag bench decode`);
#   3. TTFT against length per mode, int8 caches from local disk and from GPU memory (`kvrag bench speed`).
# Usage: bash scripts/gpu_bench.sh OUT_DIR [extra `kvrag bench speed` options]
# Works from a source checkout without installing kvrag (PYTHONPATH), given torch, transformers, triton and matplotlib.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/gpu}"; shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to OUT/NAME.log, show the end
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $SECONDS s of the script"; tail -n 12 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
step gpu-tests "${GPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_llama_layer.py \
    tests/test_cachegen_region.py tests/test_scatter_attention.py
step gpu-tests-bench "${GPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_feed.py \
    tests/test_bench.py -k "gpu or cuda or decode"
step decode "${DECODE_S:-90}" python3 -m kvrag.cli -v bench decode --chunks 8,32,128,256 --out "$out/decode"
step speed "${SPEED_S:-240}" python3 -m kvrag.cli -v bench speed --arch llama-3.1-8b --codec int8 \
    --lengths 4096,8192,32768 --tiers disk,gpu --modes full,reuse,probe@0.15,cacheblend@0.15,attnlink@16 \
    --repeats 3 --out "$out/speed" "$@"
