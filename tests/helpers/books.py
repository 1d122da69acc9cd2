"""A tiny model's book (``-c infllm``) read into a disk store: in the test's process, or in one
the test kills (``python -m tests.helpers.books FOLDER CACHE KILL_AT``: SIGKILL at the start of
layer 1's pass number KILL_AT, keeping a resume point after every chunk)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prompt import build_prompt
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore

DOC = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} gulls near rock {i % 5}." for i in range(16))
SPEC = "infllm:block_size=8,initial=4,local_window=16,topk=3,chunk=12,repr_topk=2"
CHUNK = 12
QUESTION = "How many gulls near rock 3?"


def answer(lm, store: KVStore | None, engine: Engine | None = None):
    """The question about :data:`DOC` with :data:`SPEC`, its book from (or into) ``store``."""
    pipeline = Pipeline.parse(SPEC)
    pipeline.configure(lm)
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    return run(
        engine or Engine(lm),
        prompt,
        pipeline,
        max_new_tokens=4,
        stop_ids=set(),
        store=store,
        meta={"document": "doc.txt"},
    )


def entry_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a store entry's file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open is not iterable)


def main() -> None:
    from kvcli.model import load_model
    from kvcli.store import book

    folder, cache, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)  # as the test's own process (tests.helpers.threads): the same bits
    book.CHECKPOINT_EVERY_S = 0.0  # a resume point after every chunk
    lm = load_model(folder, device="cpu", dtype="float32")
    engine = Engine(lm)
    passes = [0]

    def kill(module, args, kwargs) -> None:
        passes[0] += 1
        if passes[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    engine.layers[1].register_forward_pre_hook(kill, with_kwargs=True)
    answer(lm, KVStore.open(cache), engine)


if __name__ == "__main__":
    main()
