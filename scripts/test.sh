#!/usr/bin/env bash
# Set up and run the checks and the test suite (CPU). Extra arguments go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "dev,langchain,llamaindex,bench"
# Triton runs kvrag's GPU kernels; without a GPU the tests run them in its interpreter. (CUDA builds of
# torch bring their own pinned triton; this is the CPU test setup.)
python -m pip install -q "triton==3.9.0"
# the Redis chunk store's tests run a real redis-server (tests/conftest.py starts one on a free loopback port)
command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m ruff check kvrag tests benchmarks/experiments
python -m mypy kvrag
python -m pytest -q --timeout=900 "$@"
