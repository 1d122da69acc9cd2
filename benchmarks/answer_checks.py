"""Which signal says that an answer does not come from the document? Each question of a question
file is answered the default way (``-c auto``) and its answer weighed by two kinds of check, so
that the one kvcli ships (kvcli/answer/grounding.py) is chosen on tuning questions and reported on
held-out ones:

* the model asked after its answer, on the answer's own KV, a yes/no question (:data:`ASKED`): the
  log-odds of "yes" against "no" (three wordings);
* the answer's pointwise mutual information with the document: each answer token's log-probability
  with the document read (the answer's KV cut back before the prompt's last token and the answer run
  again) minus after the question alone in a closed-book prompt (``grounding.closed_book_logprobs``), per token.

    python benchmarks/answer_checks.py docs/bench/retrieval/user-check.json docs/bench/cite/unanswerable-tuning.json \\
        --model qwen2.5-coder-1.5b --out docs/bench/qwen/check/tune-1.5b.json
    python benchmarks/answer_checks.py --analyse docs/bench/qwen/check/tune-1.5b.json [--threshold 0.1]

``--analyse`` prints, for each signal, how well it separates right answers from answers to
questions no page answers (the area under the ROC curve: the chance that a right answer scores over
an unanswerable one), for the mean gain how many of each kind fall under each threshold, and for
each yes/no question how many the note catches when it is given under the gain's ``--threshold`` or
under the question's own log-odds (:data:`ASKED_UNDER`), as kvcli's check does on a model with
``check_asked`` (kvcli/model/models.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout_answers import is_right, load_version  # noqa: E402
from portable import portable, scrub  # noqa: E402

from kvcli.answer.grounding import asked_log_odds, closed_book_logprobs  # noqa: E402
from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline  # noqa: E402
from kvcli.report.record import result_record  # noqa: E402
from kvcli.runtime.decode import chosen_logprobs  # noqa: E402

ASKED = {  # asked after the answer, in the model's chat turns
    "stated": "Is that answer stated in the document? Reply yes or no.",
    "answers": "Does the document above answer the question? Reply yes or no.",
    "supported": "Is your answer supported by the document above? Answer only yes or no.",
}
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
ASKED_UNDER = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)  # the yes/no questions' log-odds weighed with the gain


def asked_after(session, result, question: str) -> float:
    """The log-odds of yes against no when ``question`` is asked right after the answer, on its KV
    (kvcli's own check: ``grounding.asked_log_odds``, which leaves the KV as it found it)."""
    engine, tok = session.engine, session.lm.tokenizer
    odds = asked_log_odds(engine, tok, result.cache, list(result.answer_ids), result.selection.n_kept, question)
    return round(odds, 3)


def gains(session, result, question: str) -> tuple[list[float], list[float]]:
    """Each answer token's log-probability with the document read (the answer run again on its KV
    cut back before the prompt's last token) and after the question alone (kvcli's own closed-book pass)."""
    engine, tok, answer = session.engine, session.lm.tokenizer, list(result.answer_ids)
    cache = copy.deepcopy(result.cache)
    cache.truncate(result.selection.n_kept - 1)
    start = int(cache.positions[-1]) + 1
    ids = torch.tensor([int(result.prompt.ids[result.selection.kept[-1]])] + answer)
    logits = engine.logits(engine.forward(ids, torch.arange(start, start + ids.numel()), cache))[:-1]
    with_doc = chosen_logprobs(logits, torch.tensor(answer)).tolist()
    without = closed_book_logprobs(engine, tok, question, answer)
    return [round(v, 4) for v in with_doc], [round(v, 4) for v in without]


def run(args) -> None:
    session = Session.open(AskOptions(model=args.model, use_cache=False, check=False))
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    done = {(r["document"], r["question"], r["wording"]) for r in rows}
    for path in args.questions:
        for doc in json.loads(path.read_text())["documents"]:
            document = load_version(doc, "pdf", args.pdf_dir)
            for q in doc["questions"]:
                for wording in ("q", "user"):
                    if wording not in q or (doc["name"], q["q"], wording) in done:
                        continue
                    question, pipeline = q[wording], parse_pipeline("auto")
                    result = session.ask(document, question, pipeline, QuestionOptions(max_new_tokens=32))
                    rec = result_record(result, session, pipeline, document)
                    asked = {k: asked_after(session, result, q) for k, q in ASKED.items()}
                    s0 = time.perf_counter()
                    with_doc, without = gains(session, result, question)
                    rows.append(
                        {
                            "file": portable(path),
                            "document": doc["name"],
                            "question": q["q"],
                            "wording": wording,
                            "unanswerable": bool(q.get("unanswerable")),
                            "answer": result.answer,
                            "right": is_right(result.answer, q, question),
                            "compressor": rec["compressor"],
                            "asked": asked,
                            "with_document": with_doc,
                            "without": without,
                            "gains_s": round(time.perf_counter() - s0, 3),
                        }
                    )
                    print(json.dumps({k: rows[-1][k] for k in ("document", "wording", "right", "asked")}), flush=True)
                    args.out.write_text(json.dumps({"command": scrub(" ".join(sys.argv)), "rows": rows}, indent=1))


def kind(row: dict) -> str:
    return "unanswerable" if row["unanswerable"] else ("right" if row["right"] else "wrong")


def mean_gain(row: dict) -> float:
    return sum(a - b for a, b in zip(row["with_document"], row["without"])) / len(row["with_document"])


def auc(high: list[float], low: list[float]) -> float:
    """The chance that a value of ``high`` is over one of ``low`` (ties half)."""
    return sum((a > b) + 0.5 * (a == b) for a in high for b in low) / max(1, len(high) * len(low))


def analyse(rows: list[dict], threshold: float = 0.1) -> str:
    signals = {f"asked: {k}": (lambda r, k=k: r["asked"][k]) for k in ASKED}
    signals["mean gain (grounding)"] = mean_gain
    out = ["| signal | AUC: right over unanswerable |", "|---|---:|"]
    for name, f in signals.items():
        right = [f(r) for r in rows if kind(r) == "right"]
        out.append(f"| {name} | {auc(right, [f(r) for r in rows if kind(r) == 'unanswerable']):.2f} |")
    n = {k: sum(kind(r) == k for r in rows) for k in ("right", "wrong", "unanswerable")}
    out += ["", "| mean gain under | right | wrong | unanswerable |", "|---:|---:|---:|---:|"]
    for t in THRESHOLDS:
        under = {k: sum(kind(r) == k and mean_gain(r) < t for r in rows) for k in n}
        out.append(
            f"| {t} | {under['right']}/{n['right']} | {under['wrong']}/{n['wrong']} | {under['unanswerable']}/{n['unanswerable']} |"
        )
    out += [
        "",
        f"| noted: mean gain under {threshold}, or asked under | right | wrong | unanswerable |",
        "|---|---:|---:|---:|",
    ]
    for k in ASKED:
        for t in ASKED_UNDER:
            noted = {c: sum(kind(r) == c and (mean_gain(r) < threshold or r["asked"][k] < t) for r in rows) for c in n}
            out.append(
                f"| {k} < {t} | {noted['right']}/{n['right']} | {noted['wrong']}/{n['wrong']} | {noted['unanswerable']}/{n['unanswerable']} |"
            )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("questions", type=Path, nargs="+")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--out", type=Path)
    p.add_argument("--analyse", action="store_true", help="read QUESTIONS as result files (--out's): the tables")
    p.add_argument("--threshold", type=float, default=0.1, help="--analyse: the gain's threshold the questions join")
    args = p.parse_args()
    if args.analyse:
        print(analyse([r for path in args.questions for r in json.loads(path.read_text())["rows"]], args.threshold))
        return
    if args.out is None:
        p.error("--out is needed to run")
    run(args)


if __name__ == "__main__":
    main()
