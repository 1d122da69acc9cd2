"""Decoding speed on a GPU: plain ``transformers.generate`` against kvcli (full attention, SnapKV) on
the same random-weight model (Llama-3.1-8B's published shape, ``gpu_measure.build``), a few prompt
lengths, 64 decoded tokens each. kvcli's first question in the process is timed apart from the next
ones (the first pays CUDA's lazy set-up). A method's suffixes: ``/steps`` decodes step by step, never
captured as a CUDA graph (``KVCLI_CUDA_GRAPHS=0``); ``/kv16`` (``/kv8``, ``/kv4``) holds the KV in
those bits (``--kv-bits``; else ``auto``); ``full;full/steps;full/kv16;...`` asks the same question
each way. Rows go to ``$OUT/speed-<weights>.json`` (or ``--out``).

    python benchmarks/gpu_speed.py                                   # on a CUDA GPU: bf16, 8k and 32k
    python benchmarks/gpu_speed.py --device cpu --layers 2 --lengths 512   # the same steps, tiny, here

Random weights decode random tokens: the speeds are real, the answers are not (and greedy ties can
part two runs' tokens after a while); ``same_tokens`` says whether a question gave the tokens of
the method's first question at that length, whatever its suffixes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_measure import build  # noqa: E402  (beside this file)

from kvcli import notices  # noqa: E402
from kvcli.answer.pipeline import Pipeline  # noqa: E402
from kvcli.answer.question import QuestionOptions  # noqa: E402
from kvcli.bench.simulate.models import CONFIGS  # noqa: E402
from kvcli.bench.simulate.run import QUESTION, document_of, open_loaded  # noqa: E402
from kvcli.kv_bits import AUTO, check_bits  # noqa: E402
from kvcli.runtime import graphs  # noqa: E402
from kvcli.runtime.engine import Engine  # noqa: E402

STEPS = 64


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate_row(model, n: int, device: str, weights: str) -> dict:
    """``transformers.generate`` on ``n - STEPS`` random ids: TTFT (one token) and decoding speed."""
    ids = torch.randint(100, 120000, (1, n - STEPS), device=device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def gen(k: int) -> float:
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        sync(device)
        return time.perf_counter() - t

    gen(2)  # warm-up
    t1, t65 = gen(1), gen(STEPS + 1)
    return {
        "who": "transformers.generate",
        "weights": weights,
        "tokens": n,
        "ttft_s": t1,
        "decode_tok_s": STEPS / (t65 - t1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the config's (a CPU dry run)")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument(
        "--methods",
        default="full;full/steps;full/kv16;full/kv16/steps;snapkv/kv16;full/kv16",
        help="kvcli's questions, in order, at each length ('/steps': decoding never captured as a CUDA graph;"
        " '/kv16', '/kv8', '/kv4': --kv-bits, else auto)",
    )
    ap.add_argument("--no-generate", action="store_true", help="kvcli's rows only")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args(argv)
    rows: list[dict] = []
    path = Path(args.out) / f"speed-{args.weights}.json"
    model = build("llama-3.1-8b", args.weights, args.device, args.layers)
    session = open_loaded(
        model, "llama-3.1-8b", args.weights, CONFIGS["llama-3.1-8b"][0], "none", engine_cls=Engine
    ).session
    asked = 0
    for n in [int(x) for x in args.lengths.split(",")]:
        if not args.no_generate:
            rows.append(generate_row(model, n, args.device, args.weights))
            print(rows[-1], flush=True)
        document = document_of(session.lm.tokenizer, n, STEPS, session.template)
        first_tokens: dict[str, list[int]] = {}
        for asked_as in [m for m in args.methods.split(";") if m]:
            method, *how = asked_as.split("/")  # "/steps": never captured as a CUDA graph; "/kv16": --kv-bits 16
            os.environ[graphs.ENV_CUDA_GRAPHS] = "0" if "steps" in how else "1"
            bits = [h[2:] for h in how if h.startswith("kv")]
            session.options.kv_bits = check_bits(bits[0]) if bits else AUTO
            notices.reset()
            result = session.ask(
                document,
                QUESTION,
                Pipeline.parse(method),
                QuestionOptions(max_new_tokens=STEPS, force_tokens=True, use_store=False),
            )
            asked += 1
            same = first_tokens.setdefault(method, result.answer_ids) == result.answer_ids  # across settings too
            rows.append(
                {
                    "who": f"kvcli {asked_as}",
                    # captured: it could be, and no note says the capture failed
                    "kv_bits": result.extra["kv_bits"],
                    "cuda_graphs": "steps" not in how
                    and graphs.unavailable(session.engine, result.cache, STEPS) is None
                    and not any("CUDA graph" in note for note in notices.drain()),
                    "weights": args.weights,
                    "tokens": n,
                    "question_in_process": asked,
                    "ttft_s": result.ttft_s,
                    "decode_tok_s": result.decode_tokens_per_s,
                    "peak_gib": result.peak_mem_mb / 1024,
                    "decoded": len(result.answer_ids),
                    "same_tokens": same,
                }
            )
            print(rows[-1], flush=True)
        path.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
