"""Decoding with and without drafts from the text read (``--lookup``), side by side on real answers:
each held-out question asked twice in one process, ``--lookup 0`` and ``--lookup N``, the order
alternating from one question to the next (a machine whose pace drifts weighs on both alike).

    python benchmarks/lookup_speed.py docs/bench/cite/heldout-questions.json -m qwen2.5-coder-1.5b \\
        --method "pages:pages=3,skim=0" --wording q,user --out docs/bench/qwen/lookup-1.5b.json

Per answer: both answers (the same text, or not: a pass of several rows rounds differently from
steps of one, which can flip a near tie), the seconds after the first token and the tokens after it,
the drafts checked, drafted and taken. At the end: how many answers are the same, and decoding's
tokens/s each way over all answers (the tokens after the first over the seconds after it) with the
median of the per-answer ratios. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout_answers import load_version  # noqa: E402
from portable import scrub  # noqa: E402

from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline  # noqa: E402


def decoding(result) -> tuple[float, int]:
    """(seconds after the first token, tokens after it) of one answer."""
    return result.total_s - result.ttft_s, max(len(result.answer_ids) - 1, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("questions", type=Path)
    p.add_argument("-m", "--model", default=None, help="kvcli's -m")
    p.add_argument("--method", default="pages:pages=3,skim=0", help="kvcli's -c")
    p.add_argument("--wording", type=lambda x: x.split(","), default=["q", "user"])
    p.add_argument("--lookup", type=int, default=3, help="the drafts' length against --lookup 0")
    p.add_argument("--max-new-tokens", type=int, default=64, help="kvcli's default")
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    base = Session.open(AskOptions(model=args.model, use_cache=False))
    sessions = {
        n: dataclasses.replace(base, options=dataclasses.replace(base.options, lookup=n)) for n in (0, args.lookup)
    }
    rows = []
    for doc in json.loads(args.questions.read_text())["documents"]:
        document = load_version(doc, "pdf", args.pdf_dir)
        for q in doc["questions"]:
            for wording in args.wording:
                order = (0, args.lookup) if len(rows) % 2 == 0 else (args.lookup, 0)
                got = {}
                for n in order:
                    result = sessions[n].ask(
                        document,
                        q[wording],
                        parse_pipeline(args.method),
                        QuestionOptions(max_new_tokens=args.max_new_tokens),
                    )
                    seconds, tokens = decoding(result)
                    got[n] = {
                        "answer": result.answer,
                        "decode_s": round(seconds, 3),
                        "tokens": tokens,
                        "lookup": result.extra.get("lookup"),
                    }
                rows.append(
                    {
                        "document": doc["name"],
                        "question": q["q"],
                        "wording": wording,
                        "first": order[0],
                        "runs": {str(n): r for n, r in got.items()},
                    }
                )
                print(
                    json.dumps(
                        {
                            "document": doc["name"],
                            "wording": wording,
                            **{f"tok/s@{n}": round(r["tokens"] / max(r["decode_s"], 1e-9), 2) for n, r in got.items()},
                        }
                    ),
                    flush=True,
                )
                if args.out:
                    args.out.write_text(json.dumps({"command": scrub(" ".join(sys.argv)), "rows": rows}, indent=1))
    print(summary(rows, args.lookup))


def summary(rows: list[dict], n: int) -> str:
    """Same answers; decoding tokens/s each way over all answers; the median per-answer speed-up."""
    off, on = [r["runs"]["0"] for r in rows], [r["runs"][str(n)] for r in rows]
    same = sum(a["answer"] == b["answer"] for a, b in zip(off, on))
    pace = [sum(r["tokens"] for r in runs) / sum(r["decode_s"] for r in runs) for runs in (off, on)]
    ratios = [
        (b["tokens"] / b["decode_s"]) / (a["tokens"] / a["decode_s"])
        for a, b in zip(off, on)
        if a["tokens"] and b["tokens"]
    ]
    drafts = [r["lookup"] for r in on if r["lookup"]]
    drafted, taken = sum(d["lookup_drafted"] for d in drafts), sum(d["lookup_taken"] for d in drafts)
    return (
        f"{len(rows)} answers: {same} the same text; decoding {pace[0]:.2f} tok/s at --lookup 0, {pace[1]:.2f} at "
        f"--lookup {n} ({pace[1] / pace[0]:.2f}x; per answer median {median(ratios):.2f}x, "
        f"from {min(ratios):.2f}x to {max(ratios):.2f}x); {taken} of {drafted} drafted tokens taken"
    )


if __name__ == "__main__":
    main()
