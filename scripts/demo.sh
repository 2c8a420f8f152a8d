#!/usr/bin/env bash
# Set up, index the sample documents with SmolLM2-135M-Instruct and ask a question in two modes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
kvrag index examples/docs --index ./demo-index --model smollm2
kvrag ask ./demo-index "In which country is Mount Kilimanjaro?" --mode full --k 3
kvrag ask ./demo-index "In which country is Mount Kilimanjaro?" --mode cacheblend --ratio 0.15 --k 3
