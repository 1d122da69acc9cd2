#!/usr/bin/env bash
# What a GPU session of issue 25 runs on the device machine (CUDA, PyTorch preinstalled, no network):
# the packages kvcli needs beyond the machine's image travel in .whl/ (wheels, and bitsandbytes
# unpacked in .whl/site with only its CUDA 13.0 library), then the CUDA suite and the real-GPU cells.
#   benchmarks/gpu_session.sh suite|measure [args for gpu_measure.py]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
export PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/site PYTHONUNBUFFERED=1 KVCLI_CACHE_DIR=/tmp/kvcli-cache
OUT=${OUT:-/tmp/out}
what=$1; shift
if [ "$what" = suite ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bitsandbytes', bitsandbytes.__version__, torch.cuda.get_device_name())"
  set -o pipefail
  timeout "${SUITE_S:-400}" python3 -m pytest --device cuda -q -m "not slow and not ray" -p no:cacheprovider --maxfail=40 "$@" 2>&1 | tee "$OUT/pytest-cuda.log" | tail -40
else
  python3 benchmarks/gpu_measure.py --out "$OUT" "$@" 2>&1 | tee "$OUT/measure.log"
fi
