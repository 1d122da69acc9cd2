#!/bin/bash
# $1 = label, SRC = tree: gemma3, doc16k, snapkv with --no-cache (prefill_on_prefix path)
cd ${SRC:-/work/main}; PY=/work/main/.venv/bin/python
Q="What is the special magic number mentioned in the text?"
for spec in "snapkv:budget=0.25"; do
  /usr/bin/time -f "maxrss_kb %M" $PY -m kvcli ask -m gemma3-270m /tmp/p32/g/doc16k.txt "$Q" -c "$spec" --json --max-new-tokens 16 --cache-dir /tmp/s13/cd --no-cache -q > /tmp/s13/$1-snapkv-nocache.json 2> /tmp/s13/$1-snapkv-nocache.err
  python3 -c "
import json; d=json.load(open('/tmp/s13/$1-snapkv-nocache.json'))
print('$1 snapkv nocache', {k: d.get(k) for k in ('answer','ttft_s','total_s','peak_mem_mb','n_context_tokens','kv_cache_bytes','compression_ratio','n_kept_tokens','decode_tokens_per_s')})"
  tail -1 /tmp/s13/$1-snapkv-nocache.err
done
