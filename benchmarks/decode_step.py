"""One decoding step of full attention, timed on its own: what a token costs after a prompt of N tokens.

    .venv/bin/python benchmarks/decode_step.py -m qwen2.5-coder-0.5b --length 4700 --kv-bits 16
    .venv/bin/python benchmarks/decode_step.py -m qwen2.5-coder-0.5b --length 1024 --profile

Loads the model as ``kvcli ask -m NAME --quant Q`` does (``--quant``, default auto), reads ``--length`` random token ids
(a fixed seed) with the engine's own prefill, holds the KV in ``--kv-bits`` (16: the plain bfloat16
cache; 8 or 4: the quantized layout kvcli decodes from by default), runs 3 steps to warm up and
``--steps`` greedy steps timed, with the process's peak RSS over them (its high-water mark reset
after the prompt); ``--profile``: 8 more under torch.profiler, the operators by self time (stderr);
``--fused on|off``: the step's attention through PyTorch's fused kernel or not (default: what
``native.fused_decoding`` says for this CPU). Run it alone on the machine: the figure is the step's wall time.

``--compare``: in the same process, after the same prompt, three decodings in turn, ``--rounds``
rounds of 4 steps each, the median step of each: a 16-bit KV through kvcli's own matrix products
(``kernels.grouped``, as a step with a mask runs), a 16-bit KV through PyTorch's fused attention
with the query heads of a KV head as its rows (``kernels.group_rows``, what a bfloat16 KV's step
runs on every CPU: ``native.fused_decoding``), and the 8-bit KV. Alternating in one process puts the variants side by side on a machine whose pace drifts.

``--rows 1,2,5,9``: what a pass of k rows costs after the same prompt (a draft of k - 1 tokens
checked, :mod:`kvcli.runtime.lookup`), the passes alternating over ``--rounds`` rounds of 4 each,
every pass's rows taken back after it (the length stays put); the median pass per k and its ratio
to one row's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from kvcli.caches.qkv import QuantKVCache
from kvcli.model import load_model
from kvcli.runtime import native
from kvcli.runtime.engine import Engine
from kvcli.runtime.measure import _read_hwm_mb, _reset_hwm, malloc_trim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="kvcli's -m (default: the embedded SmolLM2)")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens before the steps")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-bits", type=int, default=16, choices=(16, 8, 4))
    p.add_argument("--quant", default="auto", help="kvcli's --quant: auto (its default), none, 8bit or 4bit")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compare", action="store_true", help="the attention kernels and KV bits side by side")
    p.add_argument("--rounds", type=int, default=6, help="--compare, --rows: rounds of 4 steps per variant")
    p.add_argument("--rows", default=None, help="passes of these many rows side by side, e.g. 1,2,5,9")
    p.add_argument(
        "--fused",
        choices=("auto", "on", "off"),
        default="auto",
        help="the step's attention: native.fused_decoding or forced",
    )
    args = p.parse_args()
    lm = load_model(args.model, quant=args.quant)
    engine = Engine(lm)
    ids = torch.randint(100, 20000, (args.length,), generator=torch.Generator().manual_seed(0))
    cache = engine.new_cache()
    t = time.perf_counter()
    with torch.inference_mode():
        logits = engine.logits(engine.forward(ids, torch.arange(args.length), cache))[-1]
    prefill_s = time.perf_counter() - t
    if args.compare:
        return compare(engine, cache, logits, args)
    if args.rows:
        return rows(engine, cache, args)
    if args.kv_bits != 16:
        cache = QuantKVCache.of(cache, args.kv_bits)
    if args.fused != "auto":
        native.fused_decoding = lambda dtype: args.fused == "on"
    malloc_trim()  # as kvcli does at a prompt's end
    _reset_hwm()
    token, position = torch.argmax(logits).view(1), args.length

    def run(steps: int) -> None:
        nonlocal token, position
        for _ in range(steps):
            token = torch.argmax(engine.step(token, position, cache)).view(1)
            int(token)  # the host reads each token, as kvcli's loop does
            position += 1

    run(3)
    t = time.perf_counter()
    run(args.steps)
    step_ms = 1000 * (time.perf_counter() - t) / args.steps
    print(
        f"{args.model or 'smollm2'} {platform.processor() or platform.machine()} threads={torch.get_num_threads()} "
        f"length={args.length} quant={args.quant} kv_bits={args.kv_bits}: prefill {prefill_s:.1f} s, "
        f"decoding {step_ms:.1f} ms a step ({1000 / step_ms:.2f} tok/s), fused {args.fused}, "
        f"peak RSS over the steps {_read_hwm_mb():.0f} MiB"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(8)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)


def compare(engine: Engine, cache, logits: torch.Tensor, args) -> None:
    """``--compare``: the variants' steps alternating in one process (see the module doc)."""
    caches = {16: cache, 8: QuantKVCache.of(cache.copy(), 8)}
    state = {bits: [torch.argmax(logits).view(1), args.length] for bits in caches}
    variants = {
        "kv16 grouped": (16, False),
        "kv16 group_rows": (16, True),
        "kv8": (8, native.fused_decoding(torch.bfloat16)),
    }

    def run(name: str, steps: int) -> float:
        bits, amx = variants[name]
        native.fused_decoding = lambda dtype: amx  # noqa: B023 - what kernels.grouped asks, for this variant's steps
        token, position = state[bits]
        t = time.perf_counter()
        for _ in range(steps):
            token = torch.argmax(engine.step(token, position, caches[bits])).view(1)
            int(token)
            position += 1
        state[bits] = [token, position]
        return 1000 * (time.perf_counter() - t) / steps

    times = alternating(run, list(variants), args.rounds)
    cells = ", ".join(f"{n} {statistics.median(t):.1f} ms (best {min(t):.1f})" for n, t in times.items())
    print(
        f"{args.model or 'smollm2'} threads={torch.get_num_threads()} length={args.length} quant={args.quant}: {cells}"
    )


def alternating(run, variants: list, rounds: int) -> dict:
    """``run(variant, n) -> ms`` for each variant in turn: 2 to warm up, then ``rounds`` rounds of 4
    each; every variant's times (a machine whose pace drifts weighs on all alike)."""
    for v in variants:
        run(v, 2)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            times[v].append(run(v, 4))
    return times


def rows(engine: Engine, cache, args) -> None:
    """``--rows``: passes of k rows alternating, each taken back (module doc)."""
    sizes = [int(k) for k in args.rows.split(",")]
    ids = torch.randint(100, 20000, (max(sizes),), generator=torch.Generator().manual_seed(1))

    def run(k: int, passes: int) -> float:
        t = time.perf_counter()
        for _ in range(passes):
            with torch.inference_mode():
                hidden = engine.forward(ids[:k], torch.arange(args.length, args.length + k), cache)
                int(torch.argmax(engine.logits(hidden), dim=-1)[-1])  # the host reads the tokens, as the loop does
            cache.rewind(k)
        return 1000 * (time.perf_counter() - t) / passes

    times = alternating(run, sizes, args.rounds)
    one = statistics.median(times[sizes[0]])
    cells = ", ".join(
        f"{k} rows {statistics.median(t):.1f} ms ({statistics.median(t) / one:.2f}x)" for k, t in times.items()
    )
    print(
        f"{args.model or 'smollm2'} threads={torch.get_num_threads()} length={args.length} quant={args.quant}: {cells}"
    )


if __name__ == "__main__":
    main()
