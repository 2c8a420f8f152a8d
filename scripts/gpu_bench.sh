#!/usr/bin/env bash
# GPU checks and the TTFT-vs-length benchmark on a CUDA machine (random-weight Llama-3.1-8B shape, bf16).
# Usage: bash scripts/gpu_bench.sh OUT_DIR [extra `kvrag bench speed` options]
# Works from a source checkout without installing kvrag (PYTHONPATH), given torch+transformers+matplotlib.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/gpu}"; shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_feed.py tests/test_bench.py -k gpu 2>&1 | tail -5 | tee "$out/gpu_tests.txt"
python3 -m kvrag.cli -v bench speed --arch llama-3.1-8b --lengths 1024,2048,4096,8192,16384,32768 \
    --tiers disk,ram,gpu --repeats 3 --out "$out/speed-llama-3.1-8b" "$@" 2>&1 | tee "$out/speed.log"
