#!/usr/bin/env bash
# Ask one question of every document in a folder (recursively), print "file<TAB>answer" lines.
#
#   examples/ask_folder.sh contracts/ "Who are the parties?"
#
# One kvcli process reads the whole folder (the model loads once) and prints JSON Lines;
# jq turns them into a table. A file that cannot be read becomes an "ERROR: ..." row, the others
# are still answered, and the script exits 1 (kvcli's exit code) if any failed.
set -euo pipefail
folder=${1:?usage: ask_folder.sh FOLDER QUESTION}
question=${2:?usage: ask_folder.sh FOLDER QUESTION}

kvcli ask "$folder" "$question" --quiet \
  | jq -r '[.document, (if .error then "ERROR: " + .error else .answer end)] | @tsv'
