#!/bin/bash
# $1 = label; runs gemma3 on doc16k twice with a fresh store (miss, hit) and once --no-cache
cd ${SRC:-/work/main}; PY=/work/main/.venv/bin/python
rm -rf /tmp/s13/cd/kv
Q="What is the special magic number mentioned in the text?"  # the text: head -c 60222 of pdftotext -layout R-intro.pdf (README.md)
for mode in miss hit nocache; do
  extra=""; [ $mode = nocache ] && extra="--no-cache"
  /usr/bin/time -f "maxrss_kb %M" $PY -m kvcli ask -m gemma3-270m /tmp/p32/g/doc16k.txt "$Q" -c full --json --max-new-tokens 16 --cache-dir /tmp/s13/cd $extra -q > /tmp/s13/$1-$mode.json 2> /tmp/s13/$1-$mode.err
  python3 -c "
import json,sys; d=json.load(open('/tmp/s13/$1-$mode.json'))
print('$1 $mode', {k: d.get(k) for k in ('answer','ttft_s','total_s','peak_mem_mb','n_prompt_tokens','kv_cache_bytes')}, d.get('cache'))"
  tail -1 /tmp/s13/$1-$mode.err
done
du -sb /tmp/s13/cd/kv
