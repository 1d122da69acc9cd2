"""Would 16-bit storage of a float32 model's prefix KV change its answers?

The disk store keeps the KV in the dtype the model computes in: bfloat16/float16 on a GPU, float32
for the embedded SmolLM2 on CPU (~46 KB per token). This asks every question of a document from a
prefix KV stored (and loaded back) as float32, float16 and bfloat16, and counts the answers that
differ from float32's. Usage (defaults: the lighthouse example and its questions plus a few more):

    python benchmarks/kv_storage_dtype.py [--document examples/lighthouse.md] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from kvcli.answer.pipeline import Pipeline
from kvcli.api import AskOptions, Session
from kvcli.caches import KVCache
from kvcli.documents import load_document
from kvcli.store import KVStore

ROOT = Path(__file__).resolve().parent.parent
MORE = [
    "Who wrote the log?",
    "What happened during the storm?",
    "Where is the lighthouse?",
    "What does the narrator do every evening?",
    "Summarise the document in one sentence.",
]


def questions() -> list[str]:
    lines = (ROOT / "examples" / "questions.txt").read_text().splitlines()
    return [q for q in lines if q.strip() and not q.startswith("#")] + MORE


def stored_as(dtype: torch.dtype | None):
    """KVCache.to_tensors / from_tensors storing the KV in ``dtype`` and loading it back as it was."""
    to_tensors, from_tensors = KVCache.to_tensors, KVCache.from_tensors.__func__

    def to(self):
        tensors, facts = to_tensors(self)
        if dtype is not None:
            facts = {**facts, "compute_dtype": str(self.keys[0].dtype)}
            tensors = {n: t.to(dtype) if n[:2] in ("k.", "v.") else t for n, t in tensors.items()}
        return tensors, facts

    def back(cls, tensors, facts, device="cpu"):
        if "compute_dtype" in facts:
            want = getattr(torch, facts["compute_dtype"].removeprefix("torch."))
            tensors = {n: t.to(want) if n[:2] in ("k.", "v.") else t for n, t in tensors.items()}
        return from_tensors(cls, tensors, facts, device)

    return to, classmethod(back)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--document", default=str(ROOT / "examples" / "lighthouse.md"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    doc = load_document(args.document)
    session = Session.open(AskOptions(max_new_tokens=args.max_new_tokens, use_cache=False))
    pipeline = Pipeline.parse("full")
    answers: dict[str, list[str]] = {}
    for name, dtype in (("float32", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        KVCache.to_tensors, KVCache.from_tensors = stored_as(dtype)
        with tempfile.TemporaryDirectory() as tmp:
            session.store = KVStore.open(Path(tmp))
            session.ask(doc, "What is this document about?", pipeline)  # computes and stores the prefix
            answers[name] = []
            for q in questions():
                session.store._memo = None  # every question loads the stored prefix from disk
                result = session.ask(doc, q, pipeline)
                assert result.extra["cache"]["status"] == "hit"
                answers[name].append(result.answer)
            entry = next(Path(tmp).glob("kv/*.safetensors"))
            print(f"{name}: entry {entry.stat().st_size / 2**20:.1f} MiB", flush=True)
    for name in ("float16", "bfloat16"):
        same = sum(a == b for a, b in zip(answers["float32"], answers[name]))
        print(f"{name}: {same}/{len(answers[name])} answers identical to float32's")
    print(json.dumps(answers, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
