#!/bin/bash
# answers of several methods on gemma3, ~3k-token text: before (cff2514) vs after (HEAD), one pass
Q="What does R stand for, and who wrote this manual?"
for spec in full "snapkv:budget=0.25" "adakv:budget=0.25" razor "blocksparse" "gemfilter:k=512" "kvzip:budget=0.25" "expectedattention:budget=0.25" "tova:budget=0.25" "h2o:budget=0.25" "pyramidkv:budget=0.25" duo; do
  for tree in before main; do
    src=/work/wt/$tree; [ $tree = main ] && src=/work/main
    rm -rf /tmp/s13/cd/kv
    for pass in 1 2; do
      out=$(cd $src && KVCLI_PREFILL_CHUNK=0 OMP_NUM_THREADS=2 /work/main/.venv/bin/python -m kvcli ask -m gemma3-270m /tmp/s13/doc3k.txt "$Q" -c "$spec" --json --max-new-tokens 24 --cache-dir /tmp/s13/cd -q 2>&1)
      echo "$spec $tree pass$pass $(echo "$out" | python3 -c 'import json,sys
t=sys.stdin.read()
try:
  d=json.loads(t); print(repr(d["answer"]), d["cache"], d["compression_ratio"], d["n_kept_tokens"], d["peak_mem_mb"])
except Exception: print("ERR", t[-300:])')"
    done
  done
done
