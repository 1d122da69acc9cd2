#!/usr/bin/env bash
# Set up each peer in its own virtual environment under .peers/ (git-ignored):
#   .peers/kvpress   NVIDIA kvpress 0.5.5 (pins transformers<5.3, so it cannot share kvcli's venv)
#   .peers/llamacpp  llama-cpp-python, which builds llama.cpp from source with this machine's compiler
# Idempotent: a venv whose import check passes is left alone. Needs cmake and a C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
mkdir -p .peers

if ! .peers/kvpress/bin/python -c "import kvpress" 2>/dev/null; then
  echo "== kvpress 0.5.5 in .peers/kvpress" >&2
  $PY -m venv .peers/kvpress
  .peers/kvpress/bin/pip install -q torch==2.13.0
  .peers/kvpress/bin/pip install -q "kvpress==0.5.5" "transformers<5.3" psutil
fi

if ! .peers/llamacpp/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "== llama-cpp-python in .peers/llamacpp (compiles llama.cpp: ~10 min on 2 cores)" >&2
  $PY -m venv .peers/llamacpp
  # GGML_NATIVE: the build uses this CPU's instruction set (AVX2/AVX-512...), as a CPU user's would
  CMAKE_ARGS="-DGGML_NATIVE=ON" .peers/llamacpp/bin/pip install -q llama-cpp-python psutil numpy
fi
.peers/kvpress/bin/python -c "import kvpress, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__)"
.peers/llamacpp/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
