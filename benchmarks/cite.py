"""Citations: do an answer's sources hit the page (or paragraph) that holds its answer? (issue 43)

    python benchmarks/cite.py verify                                   # every question's page, with pdftotext
    python benchmarks/cite.py books --methods bm25,bm25-units,auto      # real manuals (over the window)
    python benchmarks/cite.py ruler --methods bm25,full,snapkv:budget=0.25 --instances 0-29
    python benchmarks/cite.py table docs/bench/cite/*.json              # the Markdown table

Sets:

* ``books``: Debian manuals, questions whose answer page was checked with ``pdftotext -f N -l N``
  (docs/bench/cite/questions.json; ``--with-books`` adds docs/bench/books/questions.json). The PDFs
  are fetched from Debian (``apt-get download`` + ``dpkg -x``, sha256 checked), never committed.
  A source hits when its pages include the answer's page (or one of the question's ``also`` pages).
* ``ruler``: RULER's ``qa_2`` in the model's window (HotpotQA: the question's paragraphs among
  distractors); a source hits when it overlaps a gold paragraph (their character offsets come
  from kvcli's generator, ``Instance.spans``).

Methods: ``oracle`` (books: full attention on the answer's page alone: the answers the model can
give; no sources scored), ``bm25`` (the question as the query over the pages, or over the paragraphs of an unpaged
text: :func:`kvcli.cite.sources.bm25_sources`), ``bm25-units`` (BM25 over the document's units,
ranked and merged as the attention's are), and any ``-c`` spec (``full``, ``auto``,
``snapkv:budget=0.25``, ``finch``, ``infllm``): the model answers, and its sources
(``Result.sources``, from what it read) are scored, with the time they added.

hit@k: the gold page / paragraph among the top k sources. Rows (one per question and method) go
to ``--out`` (JSON); ``table`` prints hit@1, hit@3, how often "no clear source" was said and the
hit@1 on either side of it, the answers right, and the time sources add.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from books import fetch_pdf, fresh_cache_dir, page_text, right, store_dir  # noqa: E402
from cite_heads import PerHead, span  # noqa: E402  (per-head attention; "0-39" or "0,3,5" -> the indices)
from contextcite import ranking  # noqa: E402  (ContextCite, the reference ranking)
from portable import scrub  # noqa: E402  (no machine's paths in the JSON)

from kvcli.answer.question import QuestionOptions  # noqa: E402
from kvcli.cite.sources import DocumentUnits, bm25_sources, rank  # noqa: E402
from kvcli.documents import document_from_text, load_document  # noqa: E402
from kvcli.retrieval.bm25 import bm25_scores  # noqa: E402

QUESTIONS = ROOT / "docs" / "bench" / "cite" / "questions.json"
BOOK_QUESTIONS = ROOT / "docs" / "bench" / "books" / "questions.json"
LEXICAL = ("bm25", "bm25-units")


def load() -> float:
    return os.getloadavg()[0]


# --------------------------------------------------------------------------- cases


def book_cases(args) -> list[dict]:
    """One case per question: the document, the question, the gold pages."""
    files = [QUESTIONS] + ([BOOK_QUESTIONS] if args.with_books else [])
    cases = []
    for path in files:
        for doc in json.loads(path.read_text())["documents"]:
            if args.docs and doc["name"] not in args.docs:
                continue
            document = load_document(fetch_pdf(doc, args.pdf_dir))
            for q in doc["questions"][: args.limit]:
                cases.append(
                    {
                        "set": "books",
                        "document": doc["name"],
                        "doc": document,
                        "question": q["q"],
                        "accept": q["accept"],
                        "gold_pages": [q["page"], *q.get("also", [])],
                        "answer_prefix": "",
                    }
                )
    return cases


def ruler_cases(args, tokenizer) -> list[dict]:
    from kvcli.bench.ruler_tasks import make_instance

    cases = []
    for index in span(args.instances):
        inst = make_instance(tokenizer, "qa_2", args.length, index, seed=0)
        cases.append(
            {
                "set": "ruler",
                "document": f"qa_2-{args.length}-{index}",
                "doc": document_from_text(inst.document, source=f"ruler-qa_2-{index}"),
                "question": inst.question,
                "query": inst.question.rpartition("Question:")[2].strip(),  # BM25's: without RULER's instruction
                "accept": inst.outputs,
                "gold_spans": [list(s) for s in inst.spans],
                "answer_prefix": inst.answer_prefix,
                "max_new_tokens": inst.max_new_tokens,
            }
        )
    return cases


def hit(case: dict, source: dict) -> bool:
    if "gold_pages" in case:
        first, last = source["pages"]
        return any(first <= p <= last for p in case["gold_pages"])
    return any(source["start"] < e and s < source["end"] for s, e in case["gold_spans"])


def scored(case: dict, method: str, sources, extra: dict) -> dict:
    items = sources.to_json()
    hits = [hit(case, s) for s in items]
    return {
        "set": case["set"],
        "document": case["document"],
        "question": case["question"],
        "method": method,
        "gold": case.get("gold_pages") or case.get("gold_spans"),
        "hit1": any(hits[:1]),
        "hit3": any(hits[:3]),
        "clear": sources.clear,
        "peak": None if sources.peak is None else round(sources.peak, 3),
        "reason": sources.reason,
        "signal": sources.signal,
        "sources": [{k: v for k, v in s.items() if k != "text"} | {"quote": s["text"][:120]} for s in items],
        "source_pages": [s["pages"][1] - s["pages"][0] + 1 for s in items if "pages" in s],
        "load": round(load(), 2),
        **extra,
    }


# --------------------------------------------------------------------------- methods


def lexical(case: dict, method: str):
    query = case.get("query", case["question"])
    if method == "bm25":
        return bm25_sources(case["doc"], query)
    du = DocumentUnits.of(case["doc"])
    scores = np.array(bm25_scores([case["doc"].text[u.start : u.end] for u in du.units], query))
    return rank(du, scores, read=np.ones(len(du), dtype=bool), signal="bm25-units")


def tokenizer_only():
    """The embedded model's tokenizer (the lexical methods need no model)."""
    from transformers import AutoTokenizer

    from kvcli.model.embedded import ensure_converted

    return AutoTokenizer.from_pretrained(str(ensure_converted(None)[0]))


def use_heads(spec: str) -> None:
    """``--heads``: default (the product's :func:`kvcli.cite.attribution.citing_heads`), all (every head
    of every layer alike), layers:A-B (every head of layers A..B), or a .npy of (layers, heads)
    weights (benchmarks/cite_heads.py analyze --weights-out)."""
    import torch

    import kvcli.cite.attribution
    from kvcli.cite.attribution import HeadWeights

    if spec == "default":
        return
    if spec.endswith(".npy"):
        w = torch.from_numpy(np.load(spec)).float()
        kvcli.cite.attribution.citing_heads = lambda lm: HeadWeights(w, spec)
    elif spec == "all" or spec.startswith("layers:"):

        def heads(lm):
            layers = range(lm.n_layers) if spec == "all" else span(spec.split(":", 1)[1])
            return HeadWeights.uniform(lm.n_layers, lm.n_heads, list(layers), spec)

        kvcli.cite.attribution.citing_heads = heads
    else:
        raise SystemExit(f"--heads: {spec}?")


def run(args) -> list[dict]:
    model_methods = [m for m in args.methods if m not in LEXICAL]
    session = None
    use_heads(args.heads)
    if args.per_head is not None:
        PER_HEAD.path = args.per_head
        PER_HEAD.install()
    if model_methods:
        from kvcli.api import AskOptions, Session

        # books: a store of their own (a fresh one, or --store), so a book is read once for all its questions
        cache_dir = None if args.set == "ruler" else (store_dir(args.store) if args.store else fresh_cache_dir())
        session = Session.open(
            AskOptions(
                use_cache=args.set != "ruler",
                cache_dir=cache_dir,
                cache_max="none",
                max_new_tokens=args.max_new_tokens,
                template="ruler" if args.set == "ruler" else "qa",
            )
        )
    if args.set == "ruler":
        tokenizer = session.lm.tokenizer if session else tokenizer_only()
    cases = book_cases(args) if args.set == "books" else ruler_cases(args, tokenizer)
    rows = []
    for case in cases:
        for method in args.methods:
            if method in LEXICAL:
                t0 = time.perf_counter()
                sources = lexical(case, method)
                rows.append(scored(case, method, sources, {"sources_s": round(time.perf_counter() - t0, 4)}))
            elif method == "contextcite":
                rows.append(contextcite(session, case, args))
            elif method == "oracle":
                rows.append(oracle(session, case, args))
            else:
                rows += ask(session, case, method, args)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


PER_HEAD = PerHead(None)


def ask(session, case: dict, method: str, args) -> list[dict]:
    """The method's answer and its sources (the product's ranking), and the same attention ranked
    with the question's BM25 over the units it read (``METHOD+bm25``: :func:`kvcli.cite.sources.fused`)."""
    import kvcli.answer.citing
    from kvcli.api import parse_pipeline
    from kvcli.cite.sources import sources_from_tokens

    kept = {}
    real = kvcli.answer.citing.cite

    def keep(document, result, question="", **kwargs):
        kept["scores"] = result.extra["citing"]["scores"].clone()
        return real(document, result, question, **kwargs)

    kvcli.answer.citing.cite = keep
    if PER_HEAD.path is not None:
        from kvcli.answer.prompt import build_prompt

        PER_HEAD.start(
            session.lm,
            build_prompt(
                session.lm.tokenizer, case["doc"].text, case["question"], session.template, case["answer_prefix"]
            ).n_tokens,
        )
    try:
        result = session.ask(
            case["doc"],
            case["question"],
            parse_pipeline(method),
            QuestionOptions(
                answer_prefix=case["answer_prefix"], max_new_tokens=case.get("max_new_tokens", args.max_new_tokens)
            ),
        )
    finally:
        kvcli.answer.citing.cite = real
    extra = {
        "answer": result.answer,
        "right": right(result.answer, case["accept"], case["question"]),
        "compressor": result.extra.get("compressor"),
        "n_tokens": result.prompt.n_tokens,
        "ttft_s": round(result.ttft_s, 3),
        "total_s": round(result.total_s, 3),
        "sources_s": round(result.extra.get("sources_s") or 0.0, 4),
        "citing_heads": args.heads,
    }
    rows = [scored(case, method, result.sources, extra)]
    if PER_HEAD.path is not None:
        PER_HEAD.keep(case, result, len(PER_HEAD.records), lambda src: hit(case, src), extra["right"])
    if not result.sources.items:
        return rows
    t0 = time.perf_counter()
    blended = sources_from_tokens(
        case["doc"],
        result.prompt,
        kept["scores"].numpy(),
        question=case.get("query", case["question"]),
        lexical=1.0,
        signal="attention+bm25",
    )
    rows.append(
        scored(
            case,
            f"{method}+bm25",
            blended,
            {**extra, "sources_s": extra["sources_s"] + round(time.perf_counter() - t0, 4)},
        )
    )
    return rows


def oracle(session, case: dict, args) -> dict:
    """Books: full attention on the text of the answer's page alone, the most this model gets from
    the book (docs/bench/books); its sources are not scored (they are on that page)."""
    from kvcli.api import parse_pipeline

    page = document_from_text(page_text(case["doc"], case["gold_pages"][0]))
    result = session.ask(
        page, case["question"], parse_pipeline("full"), QuestionOptions(max_new_tokens=args.max_new_tokens)
    )
    return {
        "set": case["set"],
        "document": case["document"],
        "question": case["question"],
        "method": "oracle",
        "gold": case["gold_pages"],
        "answer": result.answer,
        "right": right(result.answer, case["accept"], case["question"]),
        "n_tokens": result.prompt.n_tokens,
        "ttft_s": round(result.ttft_s, 3),
        "total_s": round(result.total_s, 3),
        "load": round(load(), 2),
    }


def contextcite(session, case: dict, args) -> dict:
    """ContextCite's ranking of the paragraphs (benchmarks/contextcite.py), scored as the others."""
    ranked = ranking(
        session,
        case["doc"],
        case["question"],
        case["answer_prefix"],
        case.get("max_new_tokens", args.max_new_tokens),
        args.ablations,
    )
    return scored(
        case,
        "contextcite",
        ranked.sources,
        {
            "answer": ranked.result.answer,
            "right": right(ranked.result.answer, case["accept"], case["question"]),
            "attention_top_in_contextcite_top": ranked.agrees,
            "ablations": args.ablations,
            "total_s": round(ranked.seconds, 2),
            "sources_s": round(ranked.seconds - ranked.result.total_s, 2),
        },
    )


def reweigh(args) -> list[dict]:
    """``reweigh``: the sources again from the heads' attention kept by ``--per-head`` (no model
    run), under other citing weights: every head alike (kvcli's default), each ``--weights`` .npy
    ((layers, heads), e.g. learned by cite_heads.py), and each layer band of ``--bands``; with and
    without the question's BM25 (``+bm25``). Cases ``--skip`` (the training ones) are left out."""
    from kvcli.cite.sources import fused

    z = np.load(args.per_head)
    records = json.loads(str(z["records"]))
    cases = book_cases(args) if args.set_of == "books" else ruler_cases(args, tokenizer_only())
    configs = {"all": None}
    for path in args.weights or []:
        configs[Path(path).stem] = np.load(path)
    for band in args.bands or []:
        configs[f"layers {band}"] = band
    rows = []
    for case, rec in zip(cases, records):
        if (args.skip and rec["index"] in span(args.skip)) or (args.only and rec["index"] not in span(args.only)):
            continue
        a = z[f"answer_{rec['index']}"].astype(np.float64)
        du = DocumentUnits.of(case["doc"])
        read = a.sum(axis=(0, 1)) > 0
        for name, w in configs.items():
            if w is None:
                scores = a.sum(axis=(0, 1))
            elif isinstance(w, str):
                scores = a[span(w)].sum(axis=(0, 1))
            else:
                scores = np.einsum("lh,lhu->u", w, a)
            query = case.get("query", case["question"])
            variants = [(name, scores)] + [
                (f"{name}+{x:g}bm25", fused(du, scores, read, query, x)) for x in args.lexical
            ]
            for label, sc in variants:
                rows.append(scored(case, f"{args.method}[{label}]", rank(du, sc, read=read), {"sources_s": 0.0}))
    return rows


# --------------------------------------------------------------------------- verify, table


def verify(args) -> None:
    """Each accepted answer is on its page by ``pdftotext -f N -l N`` and by kvcli's extraction."""
    bad = 0
    for path in (QUESTIONS, *([BOOK_QUESTIONS] if args.with_books else [])):
        for doc in json.loads(path.read_text())["documents"]:
            pdf = fetch_pdf(doc, args.pdf_dir)
            document = load_document(pdf)
            for q in doc["questions"]:
                pages = [q["page"], *q.get("also", [])]
                for p in pages:
                    ours = page_text(document, p).lower()
                    theirs = subprocess.run(
                        ["pdftotext", "-f", str(p), "-l", str(p), str(pdf), "-"],
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout.lower()
                    found = [a for a in q["accept"] if a.lower() in theirs and a.lower() in " ".join(ours.split())]
                    ok = bool(found)
                    bad += not ok
                    print(f"{'ok ' if ok else 'BAD'} {doc['name']} p. {p}: {q['q']} -> {found or q['accept']}")
    print(f"{bad} not found")
    if bad:
        raise SystemExit(1)


def share(rows: list[dict]) -> str:
    """The sources' seconds over the answer's (total_s: reading, answering and the sources)."""
    xs = [r["sources_s"] / r["total_s"] for r in rows if r.get("total_s")]
    return f"{100 * np.median(xs):.1f}%, {100 * max(xs):.1f}%" if xs else "—"


def table(rows: list[dict]) -> str:
    lines = [
        "| set | method | questions | hit@1 | hit@3 | no clear source | hit@1 when clear / not | answers right | "
        "pages a source spans (mean) | sources add (median s) | share of the answer's time (median, max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["set"], r["method"]) for r in rows))
    for s, m in keys:
        rs = [r for r in rows if (r["set"], r["method"]) == (s, m)]
        n = len(rs)
        if "hit1" not in rs[0]:  # the oracle: answers only
            right_ = [r["right"] for r in rs]
            lines.append(f"| {s} | {m} | {n} | — | — | — | — | {sum(right_)}/{n} | — | — | — |")
            continue
        clear = [r for r in rs if r["clear"]]
        unclear = [r for r in rs if not r["clear"]]

        def pct(xs):
            return f"{100 * sum(xs) / len(xs):.0f}%" if xs else "—"

        spans = [p for r in rs for p in r.get("source_pages", [])]
        right_ = [r["right"] for r in rs if "right" in r]
        lines.append(
            f"| {s} | {m} | {n} | {pct([r['hit1'] for r in rs])} | {pct([r['hit3'] for r in rs])} | "
            f"{len(unclear)}/{n} | {pct([r['hit1'] for r in clear])} / {pct([r['hit1'] for r in unclear])} | "
            f"{f'{sum(right_)}/{len(right_)}' if right_ else '—'} | {f'{np.mean(spans):.2f}' if spans else '—'} | "
            f"{np.median([r['sources_s'] for r in rs]):.3f} | {share(rs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="set", required=True)
    for name in ("books", "ruler", "verify"):
        s = sub.add_parser(name)
        s.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
        s.add_argument("--with-books", action="store_true", help="also docs/bench/books's questions")
        if name == "verify":
            continue
        s.add_argument("--methods", type=lambda x: x.split(","), default=["bm25", "bm25-units"])
        s.add_argument("--docs", type=lambda x: x.split(","), default=None)
        s.add_argument("--limit", type=int, default=None, help="books: the first N questions of each document")
        s.add_argument("--instances", default="0-29")
        s.add_argument("--length", type=int, default=4096)
        s.add_argument("--max-new-tokens", type=int, default=32)
        s.add_argument("--out", type=Path, default=None)
        s.add_argument(
            "--store", type=Path, default=None, help="books: this cache folder's disk store, kept between runs"
        )
        s.add_argument("--ablations", type=int, default=32, help="contextcite: random ablations per case")
        s.add_argument(
            "--heads", default="default", help="the citing heads: default, all, layers:A-B, or a .npy of weights"
        )
        s.add_argument(
            "--per-head",
            type=Path,
            default=None,
            help="also keep each head's attention per unit (.npz, cite_heads.py analyze)",
        )
    r = sub.add_parser("reweigh")
    r.add_argument("set_of", choices=("books", "ruler"))
    r.add_argument("per_head", type=Path)
    r.add_argument("--method", default="full", help="the method the per-head file was made with (a label)")
    r.add_argument("--weights", nargs="*", default=None)
    r.add_argument("--bands", nargs="*", default=None, help="layer bands, e.g. 10-20")
    r.add_argument("--skip", default=None, help="case indices to leave out (the training ones)")
    r.add_argument("--only", default=None, help="case indices to keep (the others left out)")
    r.add_argument(
        "--lexical", type=float, nargs="*", default=[1.0], help="BM25 weights to fuse with (kvcli.cite.sources.fused)"
    )
    r.add_argument("--instances", default="100-139")
    r.add_argument("--length", type=int, default=4096)
    r.add_argument("--docs", type=lambda x: x.split(","), default=None)
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--with-books", action="store_true")
    r.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    r.add_argument("--out", type=Path, default=None)
    t = sub.add_parser("table")
    t.add_argument("files", type=Path, nargs="+")
    args = p.parse_args()
    if args.set == "verify":
        return verify(args)
    if args.set == "table":
        print(table([r for f in args.files for r in json.loads(f.read_text())["rows"]]))
        return
    if args.set == "reweigh":
        rows = reweigh(args)
        if args.out:
            args.out.write_text(
                json.dumps(
                    {"command": scrub(" ".join(["python", "benchmarks/cite.py", *sys.argv[1:]])), "rows": rows},
                    indent=1,
                )
                + "\n"
            )
        print(table(rows))
        return
    started = {"load": load(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows = run(args)
    PER_HEAD.save()
    out = {
        "command": scrub(" ".join(["python", "benchmarks/cite.py", *sys.argv[1:]])),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "started": started,
        "ended": {"load": load(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
