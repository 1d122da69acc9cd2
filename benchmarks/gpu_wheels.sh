#!/usr/bin/env bash
# The folder .whl (git-ignored) that benchmarks/gpu_check.sh installs on a GPU machine without
# network (a stock CUDA PyTorch image: torch 2.11, Python 3.12): the prepared wheels and tokenizer of
# ../shared/gpu/whl, and the CLI's own versions of what that image holds older or lacks.
#   bash benchmarks/gpu_wheels.sh [SHARED_WHL_DIR]     # then: device run with carry [".whl"]
set -eu
cd "$(dirname "$0")/.."
SRC=${1:-../shared/gpu/whl}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
cp -r "$SRC"/. .whl/ && chmod -R u+w .whl
# transformers, typer (0.29 imports pydantic) and rich as the CLI has them; the pages' BM25 stemmer; the tests' bm25s
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.24.0 typer==0.29.2 rich==15.0.0 snowballstemmer==3.1.1 bm25s==0.3.16 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 shellingham==1.5.4 annotated-doc==0.0.7
du -sh .whl
