"""Does a passage the model writes first find the answer's page in a user's words (Query2doc)?

    python benchmarks/expansion.py write --model qwen2.5-coder-1.5b --out W.json   # the passages
    python benchmarks/expansion.py rank W.json                                      # the pages found

``write``: for each question of the files (default: docs/bench/retrieval/user-check.json, the
tuning questions in the manual's words and in a user's) the passage the model writes closed-book
before the ranking, as ``pages:expand=N`` writes it (kvcli.retrieval.expansion.write_passage, at
most ``--tokens`` tokens), with its seconds (a timing only when nothing else runs). ``rank`` (given ``write``'s file, or
a benchmarks/heldout_answers.py run's with ``pages:expand=N``: the passages kvcli wrote there): the
answer's page first (hit@1) and among three (hit@3), per wording, for kvcli's ranking of the
question alone (``question``) and of the question expanded by its passage: as kvcli expands it
(``query2doc``: the question 5 times then the passage for BM25, question + passage for the
embedding; kvcli.retrieval.expansion.queries), with the question once or 3 times for BM25
(``bm25-n1``, ``bm25-n3``), the passage for BM25 only (``bm25-only``), for the embedding only
(``dense-only``), and HyDE's way (Gao et al. 2022, arXiv:2212.10496: the question's vector plus
the passage's embedded as a page, ``hyde``). The embedding model is kvcli's
(``$KVCLI_EMBED_MODEL``); its vectors go to ``--cache-dir``. Rows to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from portable import portable, scrub  # noqa: E402
from retrieval import WORDINGS, documents, top, tuned  # noqa: E402

from kvcli.retrieval import embed, vectors  # noqa: E402
from kvcli.retrieval import expansion as x  # noqa: E402
from kvcli.retrieval.bm25 import bm25_scores  # noqa: E402
from kvcli.retrieval.ranking import CANDIDATES, candidates_of, reranked, semantic_scores  # noqa: E402

SET = [ROOT / "docs" / "bench" / "retrieval" / "user-check.json"]
PDFS = Path(tempfile.gettempdir()) / "kvcli-books-pdfs"


def write(args) -> None:
    from kvcli.api import AskOptions, Session
    from kvcli.templates import stop_token_ids

    session = Session.open(AskOptions(model=args.model, use_cache=False, check=False))
    tok, engine = session.lm.tokenizer, session.engine
    stop = stop_token_ids(tok, session.lm.model.generation_config)
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    done = {(r["document"], r["question"], r["wording"]) for r in rows}
    for spec, texts, _ in documents(args.set, args.pdf_dir):
        if args.docs and spec["name"] not in args.docs.split(","):
            continue
        head = x.head_words(texts)
        for q in spec["questions"]:
            for wording in WORDINGS:
                if not q.get(wording) or (spec["name"], q["q"], wording) in done:
                    continue
                e = x.write_passage(engine, tok, stop, q[wording], head, args.tokens)
                rows.append({"document": spec["name"], "question": q["q"], "wording": wording, "asked": q[wording],
                             "passage": e.text, "n_tokens": e.n_tokens, "seconds": round(e.seconds, 2)})  # fmt: skip
                print(json.dumps({k: rows[-1][k] for k in ("document", "wording", "seconds", "passage")}), flush=True)
                about = {"command": scrub(" ".join(sys.argv)), "model": args.model, "tokens": args.tokens}
                args.out.write_text(
                    json.dumps({**about, "set": [portable(p) for p in args.set], "rows": rows}, indent=1)
                )


def variants(model, texts: list[str], question: str, passage: str, cache: Path) -> dict[str, np.ndarray]:
    """Each way of ranking the pages (module doc): one score a page."""

    def ranked(lexical_query: str, query_vector: np.ndarray) -> np.ndarray:
        lexical = np.array(bm25_scores(texts, lexical_query, stem=True))
        wanted = candidates_of(lexical, CANDIDATES)
        vecs, owner, _ = vectors.passage_vectors(model, texts, cache, wanted=wanted)
        semantic = semantic_scores(vecs, owner, query_vector, len(texts))
        return reranked(lexical, semantic, wanted, ("mix", tuned().weight))

    lexical, dense = x.queries(question, passage)
    alone, expanded = model.encode_query(question), model.encode_query(dense)
    hyde = alone + model.encode([passage])[0]
    return {
        "question": ranked(question, alone),
        "query2doc": ranked(lexical, expanded),
        "bm25-n1": ranked(f"{question} {passage}", expanded),
        "bm25-n3": ranked(" ".join([question] * 3 + [passage]), expanded),
        "bm25-only": ranked(lexical, alone),
        "dense-only": ranked(question, expanded),
        "hyde": ranked(question, hyde / np.linalg.norm(hyde)),
    }


def written(path: Path) -> tuple[dict, list[Path], str]:
    """The passages of ``write``'s file, or those kvcli wrote in a run of benchmarks/heldout_answers.py
    with ``pages:expand=N`` (each row's ``read.expansion``): {(document, question, wording): passage},
    the question files, and which model wrote them."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    if rows and "passage" in rows[0]:
        about = f"{data['model']}, at most {data['tokens']} tokens"
        return {(r["document"], r["question"], r["wording"]): r["passage"] for r in rows}, data["set"], about
    passages = {
        (r["document"], r["question"], r["wording"]): r["read"]["expansion"]
        for r in rows
        if (r.get("read") or {}).get("expansion") is not None
    }
    files = sorted({r["file"] for r in rows})
    return passages, files, f"kvcli's own, in {data['command']}"


def rank(args) -> None:
    passages, files, about = written(args.written)
    model = embed.embedder(embed.setting())
    rows = []
    for spec, texts, pages in documents([ROOT / p for p in files], args.pdf_dir):
        for q in spec["questions"]:
            if q.get("page") is None:
                continue
            gold = {q["page"], *q.get("also", [])}
            for wording in WORDINGS:
                passage = passages.get((spec["name"], q["q"], wording))
                if passage is None:
                    continue
                for name, scores in variants(model, texts, q[wording], passage, args.cache_dir).items():
                    best = [pages[i] for i in top(scores, 3)]
                    rows.append({"document": spec["name"], "question": q["q"], "wording": wording, "method": name,
                                 "top3": best, "hit1": best[0] in gold, "hit3": any(p in gold for p in best)})  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"command": scrub(" ".join(sys.argv)), "rows": rows}, indent=1))
    print(f"passages: {portable(args.written)} ({about})\n")
    print("| ranking | wording | questions | hit@1 | hit@3 |\n|---|---|---:|---:|---:|")
    for wording in WORDINGS:
        for name in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == name and r["wording"] == wording]
            print(
                f"| {name} | {wording} | {len(mine)} | {sum(r['hit1'] for r in mine)} | {sum(r['hit3'] for r in mine)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="the passages a model writes for each question")
    w.add_argument("--set", type=Path, nargs="+", default=SET)
    w.add_argument("--model", default="qwen2.5-coder-1.5b")
    w.add_argument("--tokens", type=int, default=48)
    w.add_argument("--docs", default="", help="only these documents (names, comma-separated)")
    w.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("rank", help="the answer's page found by each ranking, given the written passages")
    r.add_argument("written", type=Path)
    r.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-retrieval-bench")
    r.add_argument("--out", type=Path)
    for p in (w, r):
        p.add_argument("--pdf-dir", type=Path, default=PDFS)
    args = ap.parse_args()
    write(args) if args.cmd == "write" else rank(args)


if __name__ == "__main__":
    main()
