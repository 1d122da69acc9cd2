"""Real GPU runs of the simulator's cells: a random-weight model of a published config on CUDA,
asked through kvcli's own session, with the peak memory CUDA's allocator reports beside the
simulated one (issue 25, item 4).

Needs a CUDA GPU and, for nf4, bitsandbytes. The model is ``from_config`` of the simulator's
config (:mod:`kvcli.bench.simulate.models`) with random weights (no download), bfloat16, every
``nn.Linear`` but ``lm_head`` swapped for bitsandbytes' ``Linear4bit`` (nf4, blocksize 64, no
double quantisation: what ``kvcli --quant 4bit`` loads). The prompt is the simulator's word-level
document of exactly ``tokens - steps`` tokens, decoding runs ``steps`` tokens with the stop tokens
ignored, no disk store: the simulator's cell, run for real.

    python benchmarks/gpu_measure.py --config llama-3.1-8b --weights nf4 \
        --lengths 32768,131072 --methods "full;gemfilter;snapkv" --out DIR [--sim docs/bench/gpu-sim/memory.json]

writes ``DIR/gpu.json`` (one row per cell, saved after each): measured ``peak_bytes``
(kvcli's own measure: ``torch.cuda.max_memory_allocated`` over the question, weights included),
``peak_reserved_bytes``, ``weights_bytes``, ``kv_bytes``, ``ttft_s``, ``decode_tokens_per_s``, the
simulated row's ``sim_peak_bytes`` (same config, weights, method, tokens, offload) and the ratio.
``--device cpu --weights bf16 --layers 2`` runs the same path on the CPU (a check of this script,
not a measurement). Random weights make the answers meaningless; what a method selects from them is data-dependent,
so sizes that depend on it (per-head budgets) may differ from a real model's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch


def nf4_swap(model) -> int:
    """Every ``nn.Linear`` but ``lm_head`` -> bitsandbytes ``Linear4bit`` (nf4), quantised on the GPU."""
    import bitsandbytes as bnb

    from kvcli.bench.simulate.models import linears_but_head

    swaps = linears_but_head(model)
    for parent, name, child in swaps:
        q = bnb.nn.Linear4bit(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            compute_dtype=torch.bfloat16,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(
            child.weight.data, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
        ).to("cuda")
        if child.bias is not None:
            q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name, q)
        del child
    torch.cuda.empty_cache()
    return len(swaps)


def build(config: str, weights: str, device: str = "cuda", layers: int | None = None):
    from transformers import AutoModelForCausalLM

    from kvcli.bench.simulate.models import hf_config

    torch.manual_seed(0)
    cfg = hf_config(config)
    if layers:
        cfg.num_hidden_layers = layers
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    if weights == "nf4":
        nf4_swap(model)
    return model


def sim_rows(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    rows = json.loads(path.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    return {
        (r["config"], r["weights"], r["method"], r["tokens"], r.get("kv_offload", "none"), r.get("kv_bits", 16)): r
        for r in rows
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3.1-8b")
    ap.add_argument("--weights", default="nf4")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--methods", default="full;gemfilter;snapkv;finch;blocksparse")
    ap.add_argument("--kv-offload", default="none")
    ap.add_argument(
        "--kv-bits",
        default="auto",
        choices=("16", "8", "4", "auto"),
        help="as kvcli ask --kv-bits and the simulator (auto: 8 or 16 bits by method; a row says the bits it held)",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sim", default="docs/bench/gpu-sim/memory.json")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cells after this many seconds")
    ap.add_argument(
        "--device", default="cuda", help="cuda; cpu (bf16 only) checks this script on a small --layers model"
    )
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count (a smoke run)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(
            "gpu_measure: no CUDA GPU here (use --device cpu --weights bf16 --layers 2 for a smoke run)",
            file=sys.stderr,
        )
        return 2
    if not cuda and args.weights != "bf16":
        print("gpu_measure: on the CPU only --weights bf16", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvcli import notices
    from kvcli.answer.pipeline import Pipeline
    from kvcli.answer.question import QuestionOptions
    from kvcli.bench.simulate.models import CONFIGS
    from kvcli.bench.simulate.report import bits_key, cell_bits
    from kvcli.bench.simulate.run import QUESTION, document_of, open_loaded
    from kvcli.caches.quant import check_bits
    from kvcli.runtime.engine import Engine

    setting = check_bits(args.kv_bits)
    sims = sim_rows(Path(args.sim) if args.sim else None)
    t0 = time.perf_counter()
    model = build(args.config, args.weights, args.device, args.layers)
    if cuda:
        torch.cuda.synchronize()
    print(f"built {args.config} {args.weights} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    sim = open_loaded(
        model,
        args.config,
        args.weights,
        CONFIGS[args.config][0],
        args.kv_offload,
        engine_cls=Engine,
        kv_bits=setting,
    )
    session = sim.session
    weights_bytes = (
        torch.cuda.memory_allocated() if cuda else sum(t.numel() * t.element_size() for t in sim.weights_list)
    )
    path = out / "gpu.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    for tokens in [int(x) for x in args.lengths.split(",")]:
        document = document_of(session.lm.tokenizer, tokens, args.steps, session.template)
        for method in [m for m in args.methods.split(";") if m]:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget reached, skipping {method} at {tokens}", file=sys.stderr, flush=True)
                continue
            bits = cell_bits(method, setting)  # the bits the method holds (the row's, as the simulator's)
            row = {
                "config": args.config,
                "weights": args.weights,
                "method": method,
                "tokens": tokens,
                "kv_offload": args.kv_offload,
                **bits_key(bits),
                "steps": args.steps,
                "weights_bytes": weights_bytes,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "layers": args.layers,
                "error": None,
            }
            if cuda:
                torch.cuda.empty_cache()
            notices.reset()
            t0 = time.perf_counter()
            try:
                result = session.ask(
                    document,
                    QUESTION,
                    Pipeline.parse(method),
                    QuestionOptions(max_new_tokens=args.steps, force_tokens=True, use_store=False),
                )
                row.update(
                    peak_bytes=int(result.peak_mem_mb * 2**20),
                    peak_reserved_bytes=int((result.extra.get("peak_mem_reserved_mb") or 0) * 2**20) or None,
                    ttft_s=result.ttft_s,
                    total_s=result.total_s,
                    decode_tokens_per_s=result.decode_tokens_per_s,
                    kv_bytes=result.extra.get("kv_cache_bytes"),
                    n_prompt_tokens=result.prompt.n_tokens,
                    n_kept_tokens=result.n_kept_tokens,
                )
                del result
            except Exception as e:  # noqa: BLE001 - the row says why
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                row["traceback"] = traceback.format_exc()[-2000:]
            row["wall_s"] = time.perf_counter() - t0
            if cuda and row.get("peak_bytes") is None:  # failed: the peak up to the failure
                row["peak_bytes_before_error"] = torch.cuda.max_memory_allocated()
            row["warnings"] = notices.drain()
            s = sims.get((args.config, args.weights, method, tokens, args.kv_offload, bits))
            if s is not None and not args.layers:
                row["sim_peak_bytes"] = s.get("peak_bytes")
                row["sim_kv_bytes"] = s.get("kv_bytes")
                if s.get("peak_bytes") and row.get("peak_bytes"):
                    row["measured_over_sim"] = row["peak_bytes"] / s["peak_bytes"]
            rows = [
                r
                for r in rows
                if (r["config"], r["weights"], r["method"], r["tokens"], r["kv_offload"], r.get("kv_bits", 16))
                != (row["config"], row["weights"], row["method"], row["tokens"], row["kv_offload"], bits)
            ] + [row]
            path.write_text(json.dumps(rows, indent=1))
            gib = 2**30
            sim_txt = f" sim {row['sim_peak_bytes'] / gib:.2f}" if row.get("sim_peak_bytes") else ""
            print(
                f"{method:>28} {tokens:>7} peak {(row.get('peak_bytes') or 0) / gib:6.2f} GiB{sim_txt} reserved "
                f"{(row.get('peak_reserved_bytes') or 0) / gib:6.2f} ttft {row.get('ttft_s') or 0:7.2f}s "
                f"decode {row.get('decode_tokens_per_s') or 0:6.1f} tok/s {row['error'] or ''}",
                file=sys.stderr,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
