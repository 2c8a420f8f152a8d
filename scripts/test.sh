#!/usr/bin/env bash
# Set up and run the test suite (CPU). Extra arguments go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q --timeout=900 "$@"
