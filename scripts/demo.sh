#!/usr/bin/env bash
# Install what the demo needs, index the sample documents with SmolLM2-135M-Instruct, show the index, and ask
# a question with a full prefill and with kvrag's default (fused caches under the correctness gate).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf ./demo-index
kvrag index examples/docs --index ./demo-index --model smollm2
kvrag info ./demo-index
question="In which country is Mount Kilimanjaro?"
echo "== a full prefill of the prompt (the reference):"
kvrag ask ./demo-index "$question" --mode full --warmup 1
echo "== kvrag's default, from the stored caches under the correctness gate (the line below says what it ran):"
kvrag ask ./demo-index "$question" --warmup 1
