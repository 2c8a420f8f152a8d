#!/usr/bin/env bash
# Set up, index the sample documents with SmolLM2-135M-Instruct and ask a question in two modes.
# (SmolLM2-135M is tiny and is easily misled by distractor passages, hence k=1 here.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
kvrag index examples/docs --index ./demo-index --model smollm2
kvrag ask ./demo-index "In which country is Mount Kilimanjaro?" --mode full --k 1
kvrag ask ./demo-index "In which country is Mount Kilimanjaro?" --k 1   # the default mode: probe, 15 % recomputed
