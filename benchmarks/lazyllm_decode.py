"""LazyLLM's decoding cost vs full attention, in lockstep in one process on the same prompt.

For each length, the speed benchmark's passkey prompt (needle document at depth 0.5, as ``kvcli
bench speed``) is prefilled by every method in turn (the order rotates each round), then the
methods decode ``--new-tokens`` greedy tokens *step by step in turn* (full's step 1, lazyllm's
step 1, full's step 2, ...), so that a loaded, noisy machine slows them alike and the ratios hold
even when the absolute times do not. Stop tokens are ignored. Prints per round and the median over
``--repeat`` rounds per method: TTFT (prefill + first logits), decode tokens/s, total (TTFT +
decoding) and each against the first method's, plus whether the generated tokens equal the
first method's, and LazyLLM's share of (prompt token, layer) pairs computed.

    PYTHONPATH=. python benchmarks/lazyllm_decode.py --lengths 4096,8000 --repeat 2 --threads 1
    PYTHONPATH=. python benchmarks/lazyllm_decode.py --lengths 4096 --methods "full;lazyllm;lazyllm:reselect=8"
    PYTHONPATH=. python benchmarks/lazyllm_decode.py --lengths 4096 --profile lazyllm   # cProfile of one run
    PYTHONPATH=. python benchmarks/lazyllm_decode.py --lengths 4096 --quant none        # 16-bit weights

``--threads``: torch.set_num_threads (1 gives steadier ratios on a shared machine).
``--profile SPEC``: run SPEC alone once per length under cProfile (prefill + decoding) and print
the top functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch

from kvcli.answer.prompt import build_prompt
from kvcli.api import AskOptions, Session
from kvcli.bench.speed import SpeedBench
from kvcli.compressors import parse_one
from kvcli.model.facts import QUANT_SPELLINGS


def _runner(engine, lm, spec: str):
    """(prefill(ids) -> (state, logits, next position), step(token, position, state) -> logits)."""
    if spec == "full":

        def prefill(ids):
            cache, logits = engine.prefill(ids)
            return cache, logits, ids.numel()

        return prefill, lambda token, pos, cache: engine.step(token, pos, cache)
    method = parse_one(spec)
    method.configure(lm)
    return (lambda ids: method.prefill(engine, ids)), (
        lambda token, pos, cache: method.decode_step(engine, token, pos, cache)
    )


def lockstep(engine, lm, ids: torch.Tensor, specs: list[str], new_tokens: int, order: list[str]) -> dict:
    """One round: every method's prefill (in ``order``), then their decoding steps in turn."""
    runners = {s: _runner(engine, lm, s) for s in specs}
    state, out = {}, {}
    for spec in order:
        t = time.perf_counter()
        cache, logits, pos = runners[spec][0](ids)
        state[spec] = [cache, logits, pos]
        out[spec] = {"ttft_s": time.perf_counter() - t, "decode_s": 0.0, "tokens": []}
    for i in range(new_tokens):
        for spec in order:
            cache, logits, pos = state[spec]
            token = int(torch.argmax(logits))
            out[spec]["tokens"].append(token)
            if i + 1 == new_tokens:
                continue
            t = time.perf_counter()
            state[spec][1] = runners[spec][1](token, pos + i, cache)
            out[spec]["decode_s"] += time.perf_counter() - t
    for spec in specs:
        o, cache = out[spec], state[spec][0]
        o["decode_tok_s"] = (new_tokens - 1) / o["decode_s"] if o["decode_s"] else None
        o["total_s"] = o["ttft_s"] + o["decode_s"]
        stats = cache.stats() if hasattr(cache, "stats") else {}
        o["computed"] = stats.get("prompt_tokens_computed_frac")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,8000")
    ap.add_argument("--methods", default="full;lazyllm", help="';'-separated; the first is the baseline")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--profile", default=None, metavar="SPEC", help="cProfile one run of SPEC per length")
    ap.add_argument("--json", default=None, help="write every round here")
    ap.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_SPELLINGS,
        help="the weights: auto (the default: 8 on the CPU), none, 8, 4",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    session = Session.open(AskOptions(use_cache=False, quant=args.quant))
    print(f"weights: {session.lm.quant}, {session.lm.dtype}", flush=True)
    engine, lm = session.engine, session.lm
    bench = SpeedBench(session)
    warm = build_prompt(lm.tokenizer, "A short warm-up document. " * 20, "Why?", session.template).ids
    lockstep(
        engine,
        lm,
        warm,
        specs if args.profile is None else [args.profile],
        2,
        specs if args.profile is None else [args.profile],
    )
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        case, document = bench.document(length, "essays")
        ids = build_prompt(lm.tokenizer, document.text, case.question, session.template).ids
        n = ids.numel()
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            r = lockstep(engine, lm, ids, [args.profile], args.new_tokens, [args.profile])[args.profile]
            prof.disable()
            print(
                f"\n=== {args.profile} at {n} tokens: TTFT {r['ttft_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s, total {r['total_s']:.2f} s"
            )
            stats = pstats.Stats(prof, stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(35)
            stats.sort_stats("tottime").print_stats(25)
            continue
        runs: dict[str, list] = {s: [] for s in specs}
        for i in range(args.repeat):
            order = specs[i % len(specs) :] + specs[: i % len(specs)]
            out = lockstep(engine, lm, ids, specs, args.new_tokens, order)
            for spec in specs:
                row = {"length": n, "method": spec, "round": i, "threads": torch.get_num_threads(), **out[spec]}
                runs[spec].append(row)
                rows.append(row)
                print(
                    f"{n:>6} {spec:36s} round {i}: TTFT {row['ttft_s']:6.2f} s  decode {row['decode_tok_s']:5.2f} tok/s  "
                    f"total {row['total_s']:6.2f} s",
                    flush=True,
                )
        med = {
            s: {k: statistics.median(r[k] for r in runs[s]) for k in ("ttft_s", "decode_tok_s", "total_s")}
            for s in specs
        }
        base = med[specs[0]]
        ref = runs[specs[0]][0]["tokens"]
        print(
            f"\n| tokens | method | TTFT s | TTFT / {specs[0]} | decode tok/s | decode / {specs[0]} | total s | total / {specs[0]} | computed | same tokens as {specs[0]} |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for s in specs:
            m, comp = med[s], runs[s][0]["computed"]
            same = sum(a == b for a, b in zip(runs[s][0]["tokens"], ref))
            print(
                f"| {n:,} | `{s}` | {m['ttft_s']:.2f} | {m['ttft_s'] / base['ttft_s']:.2f} | {m['decode_tok_s']:.2f} | "
                f"{m['decode_tok_s'] / base['decode_tok_s']:.2f} | {m['total_s']:.2f} | {m['total_s'] / base['total_s']:.2f} | "
                f"{'—' if comp is None else f'{comp:.2f}'} | {same}/{len(ref)} |",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
