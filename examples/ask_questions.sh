#!/usr/bin/env bash
# Ask every question of a file (one per line) about one document, print "question<TAB>answer".
#
#   examples/ask_questions.sh examples/lighthouse.pdf examples/questions.txt
#
# The document is read once; its prefix KV goes to the disk cache on the first question, so each
# later question only runs its own tokens (see `kvcli cache ls`).
set -euo pipefail
document=${1:?usage: ask_questions.sh DOCUMENT QUESTIONS_FILE}
questions=${2:?usage: ask_questions.sh DOCUMENT QUESTIONS_FILE}

kvcli ask "$document" --questions "$questions" -c "${KVCLI_COMPRESSOR:-full}" --quiet \
  | jq -r '[.question, (if .error then "ERROR: " + .error else .answer end), .cache] | @tsv'
