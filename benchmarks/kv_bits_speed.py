"""Decoding over 16-bit against 8-bit (and 4-bit) KV on this CPU (issue 40: at most 10% slower at 8
bits, 4k tokens).

    python benchmarks/kv_bits_speed.py [BITS] [REPS] [DOCUMENT]     # default: 16,8  5  a 4k-token text

The embedded model answers one question about DOCUMENT (default: examples/lighthouse.md four times,
~4k tokens) from the disk cache, 64 tokens forced, the settings alternating REPS times each, each
in its own session (one miss first, to store the entry); prints each answer's decoding speed and
the medians. Time it alone on the machine.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline  # noqa: E402
from kvcli.documents import document_from_text, load_document  # noqa: E402

QUESTION = "What is the combination for the oil store padlock?"


def main() -> None:
    bits_list = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "16,8").split(",")]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    if len(sys.argv) > 3:
        doc = load_document(sys.argv[3])
    else:
        doc = document_from_text("\n\n".join([(ROOT / "examples" / "lighthouse.md").read_text()] * 4))
    cache = tempfile.mkdtemp(prefix="kvcli-bits-")
    sessions = {b: Session.open(AskOptions(kv_bits=b, cache_dir=cache, sources=False, threads="2")) for b in bits_list}
    for b in bits_list:  # the misses: each precision stores its entry
        sessions[b].ask(doc, QUESTION, parse_pipeline("full"), QuestionOptions(max_new_tokens=2, force_tokens=True))
    speeds = {b: [] for b in bits_list}
    for r in range(reps):
        for b in bits_list:
            res = sessions[b].ask(
                doc, QUESTION, parse_pipeline("full"), QuestionOptions(max_new_tokens=64, force_tokens=True)
            )
            speeds[b].append(res.decode_tokens_per_s)
            print(
                f"{b}-bit #{r}: {res.extra['cache']['status']}, {res.prompt.n_tokens} tokens, "
                f"{res.decode_tokens_per_s:.2f} tokens/s, TTFT {res.ttft_s:.3f} s",
                flush=True,
            )
    for b in bits_list:
        print(f"{b}-bit: median {statistics.median(speeds[b]):.2f} tokens/s, all {[round(x, 2) for x in speeds[b]]}")


if __name__ == "__main__":
    main()
