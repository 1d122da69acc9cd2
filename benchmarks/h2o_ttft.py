"""H2O's time to first token against full attention's, on the embedded model, in one process.

    PYTHONPATH=. python benchmarks/h2o_ttft.py                          # 4k and 8k tokens, 3 rounds
    PYTHONPATH=. python benchmarks/h2o_ttft.py --lengths 4096 --rounds 5 --threads 1
    PYTHONPATH=. python benchmarks/h2o_ttft.py --kept h2o_kept.pt      # also save what H2O kept

Each round runs ``full`` then ``h2o:budget=0.25`` (``--spec``) on the same needle prompt (filler
haystack, needle at depth 0.5, one answer token, no disk store), so the two alternate and share
whatever load the machine is under; the table gives each method's median TTFT and the median of
the per-round ratios, and the same for the CPU time of the process over each run (with
``--threads 1`` on a machine shared with other work, the CPU-time ratio is the steadier one). Run on another checkout of kvcli (``PYTHONPATH=that/checkout``) the script
measures that code: that is how a change to H2O is compared with the code before it. ``--kept``
saves, per length, H2O's kept-position mask (n_layers, n_kv_heads, n_prompt): two runs' files
compare with ``torch.equal``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prompt import build_prompt
from kvcli.bench.needle import make_case
from kvcli.bench.runner import PROMPT_OVERHEAD
from kvcli.model import load_model
from kvcli.runtime.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,8000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument(
        "--rounds", type=int, default=3, help="full/h2o pairs per length (after one warm-up pair at the first length)"
    )
    ap.add_argument("--spec", default="h2o:budget=0.25", help="the method compared with full attention")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--kept", default=None, help="save H2O's kept-position masks (one per length) to this .pt file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None)
    engine = Engine(lm)
    lengths = [int(x) for x in args.lengths.split(",")]
    specs = ["full", args.spec]

    def ttft(prompt, spec):
        cpu = time.process_time()
        result = run(engine, prompt, Pipeline.parse(spec), max_new_tokens=1, stop_ids=set())
        return (result.ttft_s, time.process_time() - cpu), result

    prompts = {}
    for n in lengths:
        case = make_case(lm.tokenizer, n - PROMPT_OVERHEAD, 0.5, haystack="filler")
        prompts[n] = build_prompt(lm.tokenizer, case.text, case.question)
    warm = build_prompt(lm.tokenizer, make_case(lm.tokenizer, 512, 0.5, haystack="filler").text, "Why?")
    for spec in specs:
        ttft(warm, spec)

    kept, rows = {}, []
    for n, prompt in prompts.items():
        times = {spec: [] for spec in specs}  # (wall TTFT, CPU time) per round
        for r in range(args.rounds):
            for spec in specs:
                t, result = ttft(prompt, spec)
                times[spec].append(t)
                if spec != "full" and r == 0:
                    kept[n] = result.kept_mask()
            (fw, fc), (hw, hc) = times["full"][-1], times[args.spec][-1]
            print(
                f"{prompt.n_tokens} tokens, round {r + 1}: full {fw:.2f} s (CPU {fc:.2f}), "
                f"{args.spec} {hw:.2f} s (CPU {hc:.2f}), ratio {hw / fw:.2f} (CPU {hc / fc:.2f})",
                flush=True,
            )
        row = [prompt.n_tokens]
        for i in (0, 1):  # wall, CPU
            ratios = [h[i] / f[i] for f, h in zip(times["full"], times[args.spec])]
            row += [
                statistics.median(t[i] for t in times["full"]),
                statistics.median(t[i] for t in times[args.spec]),
                statistics.median(ratios),
                min(ratios),
                max(ratios),
            ]
        rows.append(row)
    print(
        f"\n| tokens | full TTFT s | {args.spec} TTFT s | ratio (median) | min-max | full CPU s | {args.spec} CPU s | CPU ratio | min-max |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, f, h, ratio, lo, hi, fc, hc, cratio, clo, chi in rows:
        print(
            f"| {n:,} | {f:.2f} | {h:.2f} | {ratio:.2f} | {lo:.2f}-{hi:.2f} | {fc:.2f} | {hc:.2f} | {cratio:.2f} | {clo:.2f}-{chi:.2f} |"
        )
    print(f"threads: {torch.get_num_threads()}, rounds: {args.rounds}")
    if args.kept:
        torch.save(kept, args.kept)


if __name__ == "__main__":
    main()
