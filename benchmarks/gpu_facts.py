"""The device run's quick checks (benchmarks/gpu_check.sh), each caught and recorded, never fatal:

    python benchmarks/gpu_facts.py facts OUT_DIR     -> OUT_DIR/facts.json (and a line per check)
    python benchmarks/gpu_facts.py summary OUT_DIR   -> OUT_DIR/summary.md from gpu.json + junit.xml

facts: versions (torch, CUDA, transformers, bitsandbytes and the native library it loaded, flash-attn);
bitsandbytes nf4 on the GPU against its own dequantised weight, and its bytes against the
simulator's formula; kvcli's real loading path (``load_model --quant 4bit`` through transformers'
BitsAndBytesConfig, ``--attn flash``'s refusal) and a cold then warm question through the disk store
on a small random llama; which SDPA backends run kvcli's own attention calls in bfloat16 (plain
causal, a lower-right CausalBias block on a longer KV, a decoding row on a view of a reserved
buffer), their error against a float32 reference and their time; pinned host memory.
Random weights: numbers and paths, never answer quality. On a machine without CUDA the CUDA-only
checks say so and the rest run on the CPU (a dry run of this script).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

FACTS: dict = {}


def check(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            FACTS[name] = fn()
            status = "ok"
        except Exception as e:  # noqa: BLE001 - recorded
            FACTS[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-1500:]}
            status = "FAILED " + FACTS[name]["error"]
        FACTS.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        print(f"[facts] {name}: {status} ({time.perf_counter() - t0:.1f}s)", flush=True)
        return fn

    return wrap


CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def version(name: str):
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001
        try:
            return getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            return f"missing ({type(e).__name__})"


def run_facts(out: Path) -> None:
    @check("versions")
    def _():
        v = {
            n: version(n)
            for n in (
                "torch",
                "transformers",
                "accelerate",
                "tokenizers",
                "safetensors",
                "huggingface-hub",
                "bitsandbytes",
                "typer",
                "rich",
                "numpy",
                "psutil",
                "pypdfium2",
                "gguf",
                "setuptools",
                "pytest",
                "pytest-xdist",
                "kvcli",
            )
        }
        v["python"] = sys.version.split()[0]
        v["torch.version.cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version() if CUDA else None
        v["flash_attn importable"] = importlib.util.find_spec("flash_attn") is not None
        if CUDA:
            p = torch.cuda.get_device_properties(0)
            v["gpu"] = {
                "name": p.name,
                "capability": list(torch.cuda.get_device_capability(0)),
                "total_GiB": round(p.total_memory / 2**30, 2),
                "bf16": torch.cuda.is_bf16_supported(),
            }
            v["sdp_enabled"] = {
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                "math": torch.backends.cuda.math_sdp_enabled(),
            }
        from kvcli.cli.app import version_line

        v["kvcli --version"] = version_line()
        return v

    @check("bitsandbytes_library")
    def _():
        import bitsandbytes as bnb
        from bitsandbytes import cextension

        lib = getattr(cextension.lib, "_lib", None)
        return {
            "version": bnb.__version__,
            "backend": cextension.BNB_BACKEND,
            "library": getattr(lib, "_name", repr(cextension.lib)),
            "cuda_native": type(cextension.lib).__name__,
        }

    @check("nf4_linear")
    def _():
        if not CUDA:
            return "skipped: no CUDA"
        import bitsandbytes as bnb
        import bitsandbytes.functional as F4

        torch.manual_seed(0)
        out_f, in_f = 14336, 4096  # Llama-3.1-8B's gate/up projection
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16, device="cuda") * 0.02
        lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        lin.weight = bnb.nn.Params4bit(
            w, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=False
        ).to("cuda")
        del w
        qs = lin.weight.quant_state
        ref_w = F4.dequantize_4bit(lin.weight.data, qs)
        stored = (
            lin.weight.data.numel() * lin.weight.data.element_size()
            + qs.absmax.numel() * qs.absmax.element_size()
            + qs.code.numel() * qs.code.element_size()
        )
        n = out_f * in_f
        sim = (n + 1) // 2 + 4 * -(-n // 64) + 16 * 4  # kvcli/bench/simulate/models.py: SimLinear4bit
        res = {
            "stored_bytes": stored,
            "sim_bytes": sim,
            "absmax_dtype": str(qs.absmax.dtype),
            "code_device": str(qs.code.device),
            "rows": {},
        }
        for rows in (1, 4, 64, 8192):
            x = torch.randn(rows, in_f, dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = lin(x)
            torch.cuda.synchronize()
            transient = torch.cuda.max_memory_allocated() - base
            ref = torch.nn.functional.linear(x.float(), ref_w.float())
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            # the simulator's model: <= 4 rows: the output only; more: a bf16 (out, in) dequantised weight + the output
            sim_t = rows * out_f * 2 + (0 if rows <= 4 else out_f * in_f * 2)
            res["rows"][rows] = {"max_rel_err": err, "transient_bytes": transient, "sim_transient_bytes": sim_t}
            del x, y, ref
        return res

    tmp = Path(tempfile.mkdtemp(prefix="kvcli-facts-"))

    def tiny_llama() -> str:
        from tests.helpers import tiny_models

        tok = Path(".whl/tokenizer")
        if tok.is_dir():
            tiny_models.use_tokenizer_from(tok)
        # head_dim 64, GQA 4:2: shapes the CUDA kernels take (flash needs head_dim % 8 == 0)
        return str(
            tiny_models.make_tiny_model(
                "llama",
                tmp,
                hidden_size=256,
                intermediate_size=512,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_hidden_layers=4,
                max_position_embeddings=16384,
            )
        )

    doc_words = " ".join(f"word{i % 97}" for i in range(1500))  # ~4-5k tokens

    @check("kvcli_load_and_store")
    def _():
        from kvcli.answer.pipeline import Pipeline
        from kvcli.answer.question import QuestionOptions
        from kvcli.api import AskOptions, Session
        from kvcli.documents import document_from_text

        path = tiny_llama()
        res = {}
        quants = ("4", "8", "none") if CUDA else ("none",)
        for quant in quants:
            t0 = time.perf_counter()
            s = Session.open(
                AskOptions(
                    model=path,
                    device=str(DEV),
                    quant=quant,
                    max_new_tokens=12,
                    cache_dir=tmp / f"cache-{quant}",
                    answer_guard=False,
                )
            )
            kinds = sorted({type(m).__name__ for m in s.lm.model.modules() if "Linear" in type(m).__name__})
            row = {
                "load_s": round(time.perf_counter() - t0, 2),
                "dtype": str(s.lm.dtype),
                "linear_types": kinds,
                "lm_head": type(s.lm.model.get_output_embeddings()).__name__,
                "engine_device": str(s.engine.device),
            }
            doc = document_from_text(doc_words, source="facts")
            for method in ("full", "snapkv", "blocksparse"):
                runs = []
                for _ in range(2):  # cold (computes and stores the prefix), then warm (the store's memo)
                    r = s.ask(
                        doc, "Which word comes first?", Pipeline.parse(method), QuestionOptions(force_tokens=True)
                    )
                    runs.append(
                        {
                            "answer_ids": r.answer_ids[:12],
                            "ttft_s": round(r.ttft_s, 3),
                            "peak_mem_mb": round(r.peak_mem_mb, 1),
                            "reserved_mb": r.extra.get("peak_mem_reserved_mb"),
                            "cache": r.extra.get("cache"),
                        }
                    )
                row[method] = {"cold_equals_warm": runs[0]["answer_ids"] == runs[1]["answer_ids"], "runs": runs}
            res[quant] = row
            del s
            if CUDA:
                torch.cuda.empty_cache()
        return res

    @check("attn_flash_without_flash_attn")
    def _():
        from kvcli.errors import KvcliError
        from kvcli.model import load_model

        try:
            load_model(tiny_llama(), device=str(DEV), attn="flash", dtype="bfloat16")
            return "loaded (flash-attn is installed)"
        except KvcliError as e:
            return f"refused: {e}"

    @check("offload_tiny")
    def _():
        if not CUDA:
            return "skipped: no CUDA (the CPU ignores --kv-offload cpu)"
        from kvcli.answer.pipeline import Pipeline
        from kvcli.answer.question import QuestionOptions
        from kvcli.api import AskOptions, Session
        from kvcli.caches import blocks
        from kvcli.documents import document_from_text

        s = Session.open(
            AskOptions(
                model=tiny_llama(),
                device="cuda",
                max_new_tokens=12,
                kv_offload="cpu",
                use_cache=False,
                answer_guard=False,
            )
        )
        r = s.ask(
            document_from_text(doc_words, source="facts"),
            "Which word comes first?",
            Pipeline.parse("blocksparse:block_size=32,topk=4"),
            QuestionOptions(force_tokens=True, use_store=False),
        )
        cache = r.cache
        stages = getattr(cache, "_stages", {})
        return {
            "answer_ids": r.answer_ids[:12],
            "kv_offload": r.extra["method_stats"].get("kv_offload"),
            "context_on": str(cache.keys[0].device),
            "context_pinned": bool(cache.keys[0].is_pinned()),
            "staging_pinned": [bool(a.is_pinned()) for a, _ in list(stages.values())[:2]],
            "host_empty_pinned": bool(blocks._host_empty((4,), torch.bfloat16).is_pinned()),
        }

    @check("sdpa_backends")
    def _():
        if not CUDA:
            return "skipped: no CUDA"
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from kvcli.runtime import kernels

        torch.manual_seed(0)
        H, KV, D = 32, 8, 128  # Llama-3.1-8B
        scale = D**-0.5
        cases = {}
        # a prompt (square, plain is_causal)
        q = torch.randn(1, H, 4096, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV, 4096, D, device="cuda", dtype=torch.bfloat16)
        cases["square causal 4096"] = (q, k, k.clone())
        # a prefill chunk / a question on a longer KV: kernels.causal -> lower-right CausalBias on CUDA
        q = torch.randn(1, H, 512, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV, 16384, D, device="cuda", dtype=torch.bfloat16)
        cases["lower-right 512 on 16384"] = (q, k, k.clone())
        # a decoding row on the first 16,000 entries of a reserved 16,384-entry buffer (a strided view)
        buf_k = torch.randn(1, KV, 16384, D, device="cuda", dtype=torch.bfloat16)
        buf_v = torch.randn(1, KV, 16384, D, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.bfloat16)
        cases["decode row on a view"] = (q, buf_k[:, :, :16000], buf_v[:, :, :16000])
        out = {}
        for name, (q, k, v) in cases.items():
            mask = kernels.causal(q.shape[2], k.shape[2], None, q.device)
            ref = kernels.eager(
                q.float(), k.float(), v.float(), kernels.causal_mask(q.shape[2], k.shape[2], None, q.device), scale
            )
            row = {"mask": type(mask).__name__}
            for label, backends in (
                ("default", None),
                ("flash", [SDPBackend.FLASH_ATTENTION]),
                ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                ("math", [SDPBackend.MATH]),
            ):
                try:
                    ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
                    with ctx:
                        o = kernels.sdpa(q, k, v, mask, scale)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(5):
                            o = kernels.sdpa(q, k, v, mask, scale)
                        torch.cuda.synchronize()
                    row[label] = {
                        "ms": round((time.perf_counter() - t0) / 5 * 1e3, 3),
                        "max_abs_err": (o.float() - ref).abs().max().item(),
                    }
                except Exception as e:  # noqa: BLE001
                    row[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            # which kernels the default call launches
            try:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    kernels.sdpa(q, k, v, mask, scale)
                    torch.cuda.synchronize()
                row["default_kernels"] = sorted(
                    {e.key[:90] for e in prof.key_averages() if e.device_type.name == "CUDA"}
                )[:6]
            except Exception as e:  # noqa: BLE001
                row["default_kernels"] = f"{type(e).__name__}: {e}"
            out[name] = row
        return out

    (out / "facts.json").write_text(json.dumps(FACTS, indent=1, default=str))


def run_summary(out: Path) -> None:
    gib = 2**30
    lines = ["# kvcli GPU check: summary", ""]
    f_cuda = False
    facts = out / "facts.json"
    if facts.exists():
        f = json.loads(facts.read_text())
        v = f.get("versions", {})
        f_cuda = "gpu" in v
        lines += [
            f"- {v.get('gpu', {}).get('name', 'no GPU')}, torch {v.get('torch')} (CUDA {v.get('torch.version.cuda')}), "
            f"transformers {v.get('transformers')}, bitsandbytes {v.get('bitsandbytes')}, Python {v.get('python')}",
            "- facts: "
            + ", ".join(
                f"{k}: {'FAILED' if isinstance(x, dict) and 'error' in x else 'skipped' if str(x).startswith('skipped') else 'ok'}"
                for k, x in f.items()
                if not k.startswith("_")
            ),
            "",
        ]
    junit = out / "junit.xml"
    if junit.exists():
        import xml.etree.ElementTree as ET

        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        tot = {a: sum(int(s.get(a, 0)) for s in suites) for a in ("tests", "failures", "errors", "skipped")}
        secs = sum(float(s.get("time", 0)) for s in suites)
        lines += [
            f"## pytest ({'cuda' if f_cuda else 'cpu'}): {tot['tests']} tests, {tot['failures']} failed, {tot['errors']} errors, "
            f"{tot['skipped']} skipped, {secs:.0f} s",
            "",
        ]
        for case in root.iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                msg = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
                lines.append(f"- `{case.get('classname')}::{case.get('name')}`: {msg}")
        lines.append("")
    else:
        lines += ["## pytest: no junit.xml (killed at its time limit? see pytest.log)", ""]
    gpu = out / "gpu.json"
    if gpu.exists():
        rows = json.loads(gpu.read_text())
        lines += [
            "## measured vs simulated (peak = max_memory_allocated over the question, weights included)",
            "",
            "| weights | method | tokens | offload | peak GiB | sim GiB | measured/sim | reserved GiB | KV GiB | TTFT s | decode tok/s | wall s | error |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["weights"], r["kv_offload"], r["tokens"], r["method"])):

            def g(key, div=gib, fmt="{:.2f}"):
                x = r.get(key)
                return fmt.format(x / div) if isinstance(x, (int, float)) else ""

            lines.append(
                f"| {r['weights']} | {r['method']} | {r['tokens']} | {r['kv_offload']} | {g('peak_bytes')} | "
                f"{g('sim_peak_bytes')} | {g('measured_over_sim', 1, '{:.3f}')} | {g('peak_reserved_bytes')} | "
                f"{g('kv_bytes')} | {g('ttft_s', 1)} | {g('decode_tokens_per_s', 1, '{:.1f}')} | {g('wall_s', 1, '{:.0f}')} | "
                f"{(r.get('error') or '')[:120]} |"
            )
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    run_facts(out) if mode == "facts" else run_summary(out)
