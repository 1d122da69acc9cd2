#!/bin/bash
# gemma3 on the 17k text, --no-cache, full attention: one pass vs KVCLI_PREFILL_CHUNK=2048/4096, alternating
cd /work/wt/after; PY=/work/main/.venv/bin/python
Q="What is the special magic number mentioned in the text?"
for rep in 1 2; do for chunk in 0 2048 4096; do
  KVCLI_PREFILL_CHUNK=$chunk /usr/bin/time -f "maxrss_kb %M" $PY -m kvcli ask -m gemma3-270m /tmp/p32/g/doc16k.txt "$Q" -c full --json --max-new-tokens 16 --cache-dir /tmp/s13/cd --no-cache -q > /tmp/s13/chunk-$chunk-$rep.json 2> /tmp/s13/chunk-$chunk-$rep.err
  python3 -c "
import json; d=json.load(open('/tmp/s13/chunk-$chunk-$rep.json'))
print('chunk $chunk rep $rep', {k: d.get(k) for k in ('answer','ttft_s','total_s','peak_mem_mb','decode_tokens_per_s')})"
done; done
