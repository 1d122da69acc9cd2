#!/usr/bin/env bash
# The citation measurements of docs/bench/cite/README.md, in one heavy job (from the worktree root):
#   bash docs/bench/cite/measure.sh   (alone on the machine, one thread: the runs used a local wrapper, heavy.sh)
# JSON beside this script (`python benchmarks/cite.py table docs/bench/cite/*.json`: the table); each
# head's attention per unit in $tmp/cite-*.npz ($TMPDIR, else /tmp; `python benchmarks/cite_heads.py analyze`).
set -u
out=docs/bench/cite
tmp=${TMPDIR:-/tmp}
py=${PYTHON:-python}
uptime
# in-window QA (RULER qa_2 at 4,096 tokens, HotpotQA's gold paragraphs): full attention, SnapKV at 4x
$py benchmarks/cite.py ruler --methods full --instances 100-131 --length 4096 --per-head $tmp/cite-ruler-full.npz --out $out/ruler-full.json
uptime
# the books (over the window): -c auto (the book path: infllm's stored book), each book read once into its own store
$py benchmarks/cite.py books --methods auto --per-head $tmp/cite-books-auto.npz --out $out/books-auto.json
uptime
$py benchmarks/cite.py ruler --methods snapkv:budget=0.25 --instances 100-107 --length 4096 --out $out/ruler-snapkv.json
uptime
# ContextCite's ranking (16 random paragraph ablations each) as the reference, at 1,024 tokens
$py benchmarks/cite.py ruler --methods bm25,full,contextcite --instances 100-102 --length 1024 --ablations 16 --out $out/contextcite-1024.json
uptime
