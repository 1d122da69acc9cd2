"""Answers first, on questions no setting was tuned on: ask each question of a question file
(docs/bench/cite/heldout-questions.json) with each reading, in the original wording
or the user's, and count answers right (benchmarks/books.py's ``right``), then where the answer's
page was among the sources. Two-page questions are right when the answer holds every string of
``accept_all``; unanswerable ones are reported apart (did kvcli say that no page matched?).

    KVCLI_THREADS=1 python benchmarks/heldout_answers.py docs/bench/cite/heldout-questions.json \
        --methods pages,pages:skim=0,oracle --wording q,user --out docs/bench/cite/heldout-answers.json
    python benchmarks/heldout_answers.py --analyse docs/bench/cite/heldout-answers.json   # the tables again
    python benchmarks/heldout_answers.py --compare BEFORE.json AFTER.json   # two runs, answer for answer

Documents without pages (issue 49 item 4): ``--format html`` asks the same questions of each
manual's HTML version, ``--format text`` of its Info version as plain text (``.info.gz``
decompressed: paragraphs between blank lines, no pages), ``--format text-flat`` of that text with
every blank line removed (one run of lines: passages are cut at lines, then sentences). Each
document's ``versions`` in the question file names the Debian package, path and sha256 of each;
a row's ``hit1``/``hit3`` are then false (no pages to hit) and only ``right`` compares.

Sources from the answer (issue 49 item 6): each row keeps every passage's evidence (``--json``'s
``sources_evidence``), and :func:`evidence_grid` prints the answer's page first among the sources
for a grid of weights (kvcli/cite/evidence.py), and "no clear source" on right and wrong answers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from books import fetch_pdf, page_text, right  # noqa: E402
from portable import portable, scrub  # noqa: E402  (no machine's paths in the JSON)

from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline  # noqa: E402
from kvcli.documents import document_from_text, load_document  # noqa: E402
from kvcli.report.record import result_record  # noqa: E402

# an answer saying the document does not answer the question, in the words the models use
DECLINED = re.compile(
    r"\b(does not|doesn't|do not|did not) (say|mention|state|specify|answer|contain|provide|cover)"
    r"|\bnot (mentioned|stated|specified|found|answered|covered|in the document)\b"
    r"|\bno (information|mention|answer)\b|\bcannot be (answered|determined)\b",
    re.IGNORECASE,
)


def declined(answer: str) -> bool:
    """Whether ``answer`` says that the document does not answer the question."""
    return bool(DECLINED.search(answer))


def is_right(answer: str, q: dict, question: str) -> bool | None:
    if q.get("unanswerable"):
        return None
    if q.get("accept_all"):
        return all(right(answer, [a], question) for a in q["accept_all"])
    return right(answer, q["accept"], question)


FORMATS = ("pdf", "html", "text", "text-flat")


def load_version(doc: dict, form: str, pdf_dir: Path):
    """The document in ``form`` (:data:`FORMATS`), fetched from Debian once and sha256 checked."""
    if form == "pdf":
        return load_document(fetch_pdf(doc, pdf_dir))
    spec = {**doc["versions"]["html" if form == "html" else "text"], "name": doc["name"]}
    path = fetch_pdf(spec, pdf_dir)  # any file of a Debian package (the name says PDF: the first use)
    if form == "html":
        return load_document(path)
    # Info's control bytes out (node separators \x1f, the index's \x00\x08 markers): plain text
    text = re.sub(r"[\x00-\x08\x0b-\x1f]", "", gzip.decompress(path.read_bytes()).decode("utf-8"))
    if form == "text-flat":
        text = "\n".join(line for line in text.splitlines() if line.strip())
    target = pdf_dir / f"{doc['name']}.{form}.txt"
    target.write_text(text, encoding="utf-8")
    return load_document(target)


def method_list(text: str) -> list[str]:
    """``pages,pages:pages=3,skim=0,oracle``: the commas between methods, not those between one
    method's knobs (a comma followed by ``name=`` belongs to the knobs before it)."""
    return [m for m in re.split(r",(?!\w+=)", text) if m]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("questions", type=Path, nargs="+")
    p.add_argument("--methods", type=method_list, default=["pages", "pages:skim=0", "oracle"])
    p.add_argument("--wording", type=lambda x: x.split(","), default=["q", "user"])
    p.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-bits", default="auto", help="16, 8, 4 or auto (kvcli's default)")
    p.add_argument(
        "--store",
        action="store_true",
        help="use the disk KV store, as kvcli ask does (a document read whole pays its prompt on its "
        "first question only); default: off, every prefill cold. Point KVCLI_CACHE_DIR at a fresh "
        "folder (holding a link to the converted models) to start from an empty store",
    )
    p.add_argument("--docs", type=lambda x: x.split(","), default=None, help="only these documents (by name)")
    p.add_argument("--format", choices=FORMATS, default="pdf", help="which version of each manual (module doc)")
    p.add_argument("--template", default="qa", help="kvcli's --template: a name in kvcli/prompts or a file")
    p.add_argument("--model", default=None, help="kvcli's -m (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--quant",
        default="auto",
        type=lambda x: x.removesuffix("bit"),
        help="kvcli's --quant: auto (its default), none, 8 or 4",
    )
    p.add_argument("--lookup", type=int, default=None, help="kvcli's --lookup N (default: kvcli's)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --out and ask only the questions they lack (a stopped run goes on)",
    )
    p.add_argument(
        "--analyse", action="store_true", help="read QUESTIONS as result files (--out's) and print the tables"
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="read QUESTIONS as result files and score each answer again with today's `right` (the question "
        "file each row names), writing the files back; prints the rows whose score changed",
    )
    p.add_argument(
        "--compare", action="store_true", help="read QUESTIONS as two result files, before and after: compare them"
    )
    args = p.parse_args()
    if args.compare:
        print(compare(*(json.loads(path.read_text())["rows"] for path in args.questions)))
        return
    if args.rescore:
        for path in args.questions:
            print(rescore(path))
        return
    if args.analyse:
        rows = [r for path in args.questions for r in json.loads(path.read_text())["rows"]]
        print(table(rows))
        print(checked(rows))
        print(evidence_grid(rows))
        return
    lookup = {} if args.lookup is None else {"lookup": args.lookup}
    session = Session.open(
        AskOptions(
            use_cache=args.store,
            kv_bits=args.kv_bits,
            model=args.model,
            quant=args.quant,
            template=args.template,
            **lookup,
        )
    )
    rows = json.loads(args.out.read_text())["rows"] if args.resume and args.out and args.out.exists() else []
    done = {row_key(r) for r in rows}
    for path in args.questions:
        for doc in json.loads(path.read_text())["documents"]:
            if args.docs and doc["name"] not in args.docs:
                continue
            document = load_version(doc, args.format, args.pdf_dir)
            for q in doc["questions"]:
                gold = q.get("pages") or ([q["page"], *q.get("also", [])] if "page" in q else [])
                for wording in args.wording:
                    question = q[wording]
                    for method in args.methods:
                        asked = {"document": doc["name"], "question": q["q"], "wording": wording}
                        if row_key({**asked, "method": method, "format": args.format}) in done:
                            continue
                        if method == "oracle":
                            if q.get("unanswerable") or wording != "q" or args.format != "pdf":
                                continue
                            text = "\n\n".join(page_text(document, n) for n in (q.get("pages") or [q["page"]]))
                            result = session.ask(
                                document_from_text(text),
                                question,
                                parse_pipeline("full"),
                                QuestionOptions(max_new_tokens=args.max_new_tokens, sources=False),
                            )
                            rec = {"answer": result.answer, "sources": None, "no_match": None}
                            if result.grounding is not None:
                                rec.update(grounding=result.grounding.score, grounded=result.grounding.grounded)
                        else:
                            pipeline = parse_pipeline(method)
                            result = session.ask(
                                document, question, pipeline, QuestionOptions(max_new_tokens=args.max_new_tokens)
                            )
                            rec = result_record(result, session, pipeline, document)
                        pages = [s["pages"][0] for s in rec.get("sources") or [] if s.get("pages")]
                        row = {
                            "file": portable(path),
                            "document": doc["name"],
                            "question": q["q"],
                            "wording": wording,
                            "method": method,
                            "format": args.format,
                            "gold": gold if args.format == "pdf" else [],
                            "unanswerable": bool(q.get("unanswerable")),
                            "two_page": bool(q.get("pages")),
                            "answer": rec["answer"],
                            "right": is_right(rec["answer"], q, question),
                            "declined": declined(rec["answer"]),
                            "hit1": bool(gold) and bool(pages) and pages[0] in gold,
                            "hit3": bool(gold) and any(x in gold for x in pages[:3]),
                            "no_match": rec.get("no_match"),
                            # the answer's check (kvcli/answer/grounding.py): nats a token gains from the document
                            "grounding": rec.get("grounding"),
                            "grounded": rec.get("grounded"),
                            "read": rec.get("read"),
                            "sources_note": rec.get("sources_note"),
                            "kv_bits": rec.get("kv_bits"),
                            "evidence": rec.get("sources_evidence"),  # each passage read: what ordered it
                            # seconds to the first answer token and to the end (the document's page
                            # vectors made by its first question; without --store every prefill cold)
                            "ttft_s": round(result.ttft_s, 2),
                            "total_s": round(result.total_s, 2),
                            "n_answer_tokens": len(result.answer_ids),
                            "lookup": result.extra.get("lookup"),  # drafts checked (kvcli.runtime.lookup)
                        }
                        rows.append(row)
                        print(
                            json.dumps(
                                {k: row[k] for k in ("document", "wording", "method", "right", "hit1", "no_match")}
                            ),
                            flush=True,
                        )
                        if args.out:
                            args.out.write_text(
                                json.dumps({"command": scrub(" ".join(sys.argv)), "rows": rows}, indent=1)
                            )
    print(table(rows))
    print(checked(rows))
    print(evidence_grid(rows))


def rescore(path: Path) -> str:
    """Score the answers of the result file ``path`` again (:func:`is_right`, each against the
    question file its row names) and write the file back; the rows whose score changed, one a line."""
    data = json.loads(path.read_text())
    spec: dict[str, dict] = {}
    changed = []
    for row in data["rows"]:
        if row["file"] not in spec:
            docs = json.loads(Path(row["file"]).read_text())["documents"]
            spec[row["file"]] = {(d["name"], q["q"]): q for d in docs for q in d["questions"]}
        q = spec[row["file"]][row["document"], row["question"]]
        now = is_right(row["answer"], q, q[row["wording"]])
        if now != row["right"]:
            changed.append(f"{path}: {row['document']} / {row['method']} / {row['wording']}: {row['right']} -> {now}")
            row["right"] = now
    if changed:
        path.write_text(json.dumps(data, indent=1))
    return "\n".join(changed) or f"{path}: no score changed"


def row_key(row: dict, reading: str | None = None) -> tuple:
    """What names a row: the document, the question (in the manual's words), its wording, the
    reading (``reading`` for the row's own: two readings paired by :func:`compare`) and the format
    (rows of older runs have none: PDF). --resume skips the questions whose key a stopped run wrote."""
    return row["document"], row["question"], row["wording"], reading or row["method"], row.get("format", "pdf")


def evidence_grid(rows: list[dict], attention=(0.0, 0.5, 1.0, 2.0), words=(0.0, 0.5, 1.0, 2.0)) -> str:
    """Sources from the answer (issue 49 item 6): over the rows that recorded each passage's
    evidence, the answer's page first among the sources when they are ordered by ``retrieval +
    a * attention + w * answer_words`` (a = w = 0: the retrieval's order), per wording; and how
    often "no clear source" was said on right and on wrong answers."""
    out = []
    for wording in sorted({r["wording"] for r in rows}):
        rs = [r for r in rows if r["wording"] == wording and r.get("evidence") and r["gold"]]
        if not rs:
            continue
        out.append(f"\n{wording} ({len(rs)} answerable questions with sources): hit@1 by weights")
        out.append("| attention \\ words | " + " | ".join(str(w) for w in words) + " |")
        out.append("|---|" + "---:|" * len(words))
        for a in attention:
            cells = []
            for w in words:
                hits = 0
                for r in rs:
                    best = max(r["evidence"], key=lambda e: e["retrieval"] + a * e["attention"] + w * e["answer_words"])
                    hits += any(p in r["gold"] for p in range(best["pages"][0], best["pages"][1] + 1))
                cells.append(f"{hits}/{len(rs)}")
            out.append(f"| {a} | " + " | ".join(cells) + " |")
        unclear = [r for r in rs if (r.get("sources_note") or "").startswith("no clear source")]
        right = [r for r in rs if r["right"]]
        out.append(
            f"no clear source: {sum(bool(r['right']) for r in unclear)}/{len(right)} right answers, "
            f"{sum(not r['right'] for r in unclear)}/{len(rs) - len(right)} wrong ones"
        )
    return "\n".join(out)


def compare(before: list[dict], after: list[dict]) -> str:
    """Two runs answer for answer (a change to kvcli between them, or two readings): per reading and
    wording, the questions both ran, how many answers are the same text, right answers and empty
    ones (nothing, or the prompt's own "Answer:") before and after; then every answer that changed.
    Where each run holds one reading and they differ, the questions are paired across them (the
    reading column names both)."""
    readings = {r["method"] for r in before}, {r["method"] for r in after}
    across = len(readings[0]) == len(readings[1]) == 1 and readings[0] != readings[1]
    name = f"{next(iter(readings[0]))} -> {next(iter(readings[1]))}" if across else None

    def empty(r: dict) -> bool:
        return r["answer"].strip() in ("", "Answer:")

    a, b = {row_key(r, name): r for r in before}, {row_key(r, name): r for r in after}
    common = [k for k in a if k in b]
    out = [
        "| reading | wording | questions | same answer | right before | right after | empty before | empty after |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m, w in sorted({(k[3], k[2]) for k in common}):
        ks = [k for k in common if (k[3], k[2]) == (m, w)]
        answerable = [k for k in ks if not a[k]["unanswerable"]]
        out.append(
            f"| {m} | {w} | {len(ks)} | {sum(a[k]['answer'] == b[k]['answer'] for k in ks)}/{len(ks)}"
            f" | {sum(bool(a[k]['right']) for k in answerable)}/{len(answerable)}"
            f" | {sum(bool(b[k]['right']) for k in answerable)}/{len(answerable)}"
            f" | {sum(empty(a[k]) for k in ks)} | {sum(empty(b[k]) for k in ks)} |"
        )
    timed = [k for k in common if "n_answer_tokens" in a[k] and "n_answer_tokens" in b[k]]
    if timed:  # decoding: the seconds after the first token, over the tokens after it
        for label, run in (("before", a), ("after", b)):
            seconds = sum(run[k]["total_s"] - run[k]["ttft_s"] for k in timed)
            tokens = sum(max(run[k]["n_answer_tokens"] - 1, 0) for k in timed)
            out.append(
                f"\ndecoding {label}: {tokens} tokens after the first in {seconds:.1f} s ({tokens / seconds:.2f} tok/s)"
            )
    for k in common:
        if a[k]["answer"] != b[k]["answer"]:
            out.append(f"\n{k[0]} / {k[3]} / {k[2]}: {k[1]}")
            out.append(f"  before ({a[k]['right']}): {a[k]['answer']!r}")
            out.append(f"  after  ({b[k]['right']}): {b[k]['answer']!r}")
    return "\n".join(out)


def said_no(row: dict) -> bool:
    """The answer declined (rows written before ``declined`` was recorded: read from the answer)."""
    return row["declined"] if "declined" in row else declined(row["answer"])


def table(rows: list[dict]) -> str:
    out = [
        "| reading | wording | right (answerable) | two-page right | hit@1 | hit@3 | answerable: declined"
        " | unanswerable: said no match | unanswerable: declined |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["method"], r["wording"]) for r in rows})
    for m, w in keys:
        rs = [r for r in rows if (r["method"], r["wording"]) == (m, w)]
        ans = [r for r in rs if not r["unanswerable"]]
        two = [r for r in ans if r["two_page"]]
        un = [r for r in rs if r["unanswerable"]]
        out.append(
            f"| {m} | {w} | {sum(bool(r['right']) for r in ans)}/{len(ans)} | {sum(bool(r['right']) for r in two)}/{len(two)}"
            f" | {sum(r['hit1'] for r in ans)}/{len(ans)} | {sum(r['hit3'] for r in ans)}/{len(ans)}"
            f" | {sum(said_no(r) for r in ans)}/{len(ans)}"
            f" | {sum(bool(r['no_match']) for r in un)}/{len(un)} | {sum(said_no(r) for r in un)}/{len(un)} |"
        )
    return "\n".join(out)


def checked(rows: list[dict]) -> str:
    """The answer's check (``grounded``: false gets a note): how many answers of each kind got the
    note, right, wrong and unanswerable ones, per reading and wording (rows without the check apart)."""
    out = [
        "| reading | wording | note on right answers | on wrong ones | on answers no page gives | median grounding: right / unanswerable |",
        "|---|---|---:|---:|---:|---:|",
    ]
    rows = [r for r in rows if r.get("grounding") is not None]
    for m, w in sorted({(r["method"], r["wording"]) for r in rows}):
        rs = [r for r in rows if (r["method"], r["wording"]) == (m, w)]
        kinds = [
            [r for r in rs if not r["unanswerable"] and r["right"]],
            [r for r in rs if not r["unanswerable"] and not r["right"]],
            [r for r in rs if r["unanswerable"]],
        ]
        noted = [f"{sum(not r['grounded'] for r in k)}/{len(k)}" for k in kinds]
        med = [f"{median([r['grounding'] for r in k]):.2f}" if k else "-" for k in (kinds[0], kinds[2])]
        out.append(f"| {m} | {w} | {' | '.join(noted)} | {' / '.join(med)} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
