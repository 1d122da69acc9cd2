#!/usr/bin/env bash
# Ask one question of every document of a folder with JOBS kvcli processes in parallel (xargs -P),
# all sharing one disk cache: JSON Lines on stdout, one object per document.
#
#   JOBS=4 examples/ask_parallel.sh contracts/ "Who are the parties?" > answers.jsonl
#
# Each process loads the model, so this pays off on a machine with cores (or GPUs) to spare; on a
# small machine prefer `kvcli ask FOLDER QUESTION` (one process, the model loaded once). The cache
# is safe to share: entries are written atomically and a per-entry lock makes processes that need
# the same entry wait for the one computing it.
set -euo pipefail
folder=${1:?usage: ask_parallel.sh FOLDER QUESTION}
question=${2:?usage: ask_parallel.sh FOLDER QUESTION}
export KVCLI_CACHE_DIR=${KVCLI_CACHE_DIR:-$HOME/.cache/kvcli}

find "$folder" -mindepth 1 -name '.*' -prune \
  -o -type f \( -iname '*.pdf' -o -iname '*.txt' -o -iname '*.md' -o -iname '*.html' -o -iname '*.htm' \) -print0 \
  | sort -z \
  | xargs -0 -P "${JOBS:-2}" -I{} kvcli ask {} "$question" --json --quiet
