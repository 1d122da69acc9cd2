"""Finding the answer's page: the pages' ranking alone, no language model (the answer in the user's words).

    python benchmarks/retrieval.py rank                          # the tuning set (both wordings)
    python benchmarks/retrieval.py rank --set FILE.json ...       # any question file, e.g. the held-out one
    python benchmarks/retrieval.py nomatch                        # "no signal": answerable vs unanswerable
    python benchmarks/retrieval.py rank --methods cand:30 --dtype bfloat16 --out B.json   # the model in bfloat16
    python benchmarks/retrieval.py compare A.json B.json          # two rankings' pages, question by question
    python benchmarks/retrieval.py speed                          # windows a second, float32 and bfloat16

Each question file is docs/bench/cite/questions.json's layout: documents (Debian PDFs, fetched with
``apt-get download`` + ``dpkg -x`` and sha256 checked, as benchmarks/books.py does), each with
questions: ``q`` (the manual's words), optionally ``user`` (the same fact asked in a user's words),
``page`` (1-based PDF page that states the answer; null: no page does) and ``also`` (other pages that
do). The tuning set is docs/bench/cite/questions.json + docs/bench/books/questions.json.

``rank``: for each method, the answer's page first (hit@1) and among the top three (hit@3), per
wording. Methods: ``bm25`` (plain words: what pages ranked by before), ``bm25-stem`` (Snowball
stems), ``embed`` (the sentence embedding's best 100-word window (``--window``) of each page), ``rrf:K`` (BM25 on
stems and the embedding by reciprocal rank, constant K) and ``mix:W``
(W · BM25 / its best + (1 - W) · cosine, a weighted sum); kvcli's own is
the model's weight in kvcli/retrieval/embedders.json; ``cand:N``: kvcli's fusion over BM25's best N pages only,
the others after them in BM25's order (kvcli's ranking with ``-c pages:candidates=N``; 0: every
page, as ``mix:0.3``), e.g. ``--methods cand:0,cand:10,cand:20,cand:30``. Rows to ``--out`` (JSON).

``nomatch``: the best page's BM25 (stems) and best cosine for the answerable questions, for the
file's questions that no page answers, and for each question asked of every *other* document of
the files (answers absent); how many of each kvcli's rule (:attr:`kvcli.retrieval.Ranking.matched`)
calls matched.

Vectors go to ``--cache-dir`` (default: a ``kvcli-retrieval-bench`` folder in the temporary directory),
so a second run reads them; ``KVCLI_EMBED_MODEL`` picks the model as in kvcli.
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

from books import fetch_pdf  # noqa: E402

from kvcli.documents import load_document  # noqa: E402
from kvcli.retrieval import embed, embedders, vectors  # noqa: E402
from kvcli.retrieval.bm25 import bm25_scores  # noqa: E402
from kvcli.retrieval.ranking import (  # noqa: E402
    Ranking,
    candidates_of,
    fuse,
    reranked,
    semantic_scores,
)

TUNE = [ROOT / "docs" / "bench" / "cite" / "questions.json", ROOT / "docs" / "bench" / "books" / "questions.json"]
WORDINGS = ("q", "user")
METHODS = ["bm25", "bm25-stem", "embed", "rrf:10", "rrf:30", "rrf:60", *(f"mix:{w / 10:g}" for w in range(2, 9))]


def tuned() -> embedders.Tuned:
    """What kvcli tuned for the embedding model in use (``$KVCLI_EMBED_MODEL``): its fusion weight, its no-match cosine."""
    return embedders.tuned(embed.setting())


def documents(files: list[Path], pdf_dir: Path):
    """(spec, document, passages' texts, each passage's page) per document of the files."""
    for path in files:
        for spec in json.loads(Path(path).read_text())["documents"]:
            doc = load_document(fetch_pdf(spec, pdf_dir))
            cuts = doc.passages()
            yield spec, [doc.text[a:b] for a, b in cuts], [doc.page_of(a) for a, _ in cuts]


def signals(
    model, texts: list[str], question: str, cache_dir: Path, window: int = vectors.WINDOW_WORDS, methods=()
) -> dict:
    """The signals of every page; where every method is ``cand:N`` (N > 0) only BM25's best N pages
    are embedded, as kvcli embeds them (the others' cosine -1, never read by those methods)."""
    stems = np.array(bm25_scores(texts, question, stem=True))
    counts = [int(m.partition(":")[2]) for m in methods if m.startswith("cand:")]
    wanted = None
    if methods and len(counts) == len(methods) and all(counts):
        wanted = sorted({i for n in counts for i in candidates_of(stems, n)})
    vecs, owner, _ = vectors.passage_vectors(model, texts, cache_dir, window, wanted=wanted)
    return {
        "bm25": np.array(bm25_scores(texts, question)),
        "bm25-stem": stems,
        "embed": semantic_scores(vecs, owner, model.encode_query(question), len(texts)),
    }


def model_name() -> str:
    """The embedding model in use: ``KVCLI_EMBED_MODEL``'s, else kvcli's order (as kvcli picks it)."""
    return embed.setting() or embed.DEFAULT


def model_of(dtype: str = "auto"):
    """The embedding model in use (:func:`model_name`) as kvcli loads it (``auto``), or in ``dtype``."""
    name = model_name()
    if dtype == "auto":
        return embed.embedder(name)
    return embed.Embedder(embed.model_dir(name), dtype)


def scores_of(method: str, s: dict) -> np.ndarray:
    if method in s:
        return s[method]
    name, _, arg = method.partition(":")
    if name in ("rrf", "mix"):
        return fuse(s["bm25-stem"], s["embed"], (name, float(arg)))
    if name == "cand":  # kvcli's ranking: the fusion over BM25's best N only (0: every page)
        return reranked(s["bm25-stem"], s["embed"], candidates_of(s["bm25-stem"], int(arg)), ("mix", tuned().weight))
    raise SystemExit(f"unknown method {method}")


def matched(method: str, s: dict) -> bool:
    """kvcli's "a page matched" for this method's ranking (:attr:`Ranking.matched`): over the
    pages it embeds (``cand:N``: BM25's best N), else over every page."""
    name, _, arg = method.partition(":")
    semantic = s["embed"]
    if name == "cand":
        wanted = candidates_of(s["bm25-stem"], int(arg))
        semantic = np.where(np.isin(np.arange(len(semantic)), wanted), semantic, -1.0)
    return Ranking(s["bm25-stem"], s["bm25-stem"], semantic, "", tuned().no_match_cosine).matched


def top(scores: np.ndarray, k: int) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def rank(args) -> None:
    model = model_of(args.dtype)
    print(f"the embedding model's dtype: {model.dtype}", file=sys.stderr)
    rows = []
    for spec, texts, pages in documents(args.set, args.pdf_dir):
        for q in spec["questions"]:
            if q.get("page") is None:
                continue
            gold = {q["page"], *q.get("also", [])}
            for wording in WORDINGS:
                if not q.get(wording):
                    continue
                s = signals(model, texts, q[wording], args.cache_dir, args.window, args.methods)
                for method in args.methods:
                    best = [pages[i] for i in top(scores_of(method, s), 3)]
                    rows.append(
                        {
                            "document": spec["name"],
                            "question": q["q"],
                            "wording": wording,
                            "method": method,
                            "gold": sorted(gold),
                            "top3": best,
                            "hit1": best[0] in gold,
                            "hit3": any(p in gold for p in best),
                            "matched": matched(method, s),
                        }  # fmt: skip
                    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(f"kvcli's fusion for this model: mix:{tuned().weight:g}\n")
    print("| method | wording | questions | hit@1 | hit@3 | matched |\n|---|---|---:|---:|---:|---:|")
    for wording in WORDINGS:
        for method in args.methods:
            mine = [r for r in rows if r["wording"] == wording and r["method"] == method]
            if mine:
                n, h1, h3 = len(mine), sum(r["hit1"] for r in mine), sum(r["hit3"] for r in mine)
                m = sum(r["matched"] for r in mine)
                print(f"| {method} | {wording} | {n} | {h1} ({h1 / n:.0%}) | {h3} ({h3 / n:.0%}) | {m} |")
    every = {(r["document"], r["question"], r["wording"]): r["top3"] for r in rows if r["method"] == "cand:0"}
    if every:  # what -c pages reads (its best three) against the ranking over every page
        print("\n| method | questions whose top three are cand:0's |\n|---|---:|")
        for method in args.methods:
            mine = [r for r in rows if r["method"] == method]
            same = sum(r["top3"] == every[(r["document"], r["question"], r["wording"])] for r in mine)
            print(f"| {method} | {same}/{len(mine)} |")


def nomatch(args) -> None:
    model = model_of(args.dtype)
    docs = list(documents(args.set, args.pdf_dir))
    groups: dict[str, list[tuple[float, float, bool]]] = {"answerable": [], "no page answers": [], "other document": []}
    for d, (_, texts, _) in enumerate(docs):
        for other, (ospec, _, _) in enumerate(docs):
            for q in ospec["questions"]:
                for wording in WORDINGS:
                    if not q.get(wording):
                        continue
                    group = "other document" if other != d else "answerable" if q.get("page") else "no page answers"
                    s = signals(model, texts, q[wording], args.cache_dir)
                    r = Ranking(s["bm25-stem"], s["bm25-stem"], s["embed"], "", tuned().no_match_cosine)
                    groups[group].append((float(s["bm25-stem"].max()), float(s["embed"].max()), r.matched))
    print(f"the model's no-match cosine: {tuned().no_match_cosine}")
    print("| questions | n | BM25 all zero | best cosine p5 / p50 / p95 | matched |\n|---|---:|---:|---|---:|")
    for name, vals in groups.items():
        if not vals:
            continue
        bm, cos, hit = (np.array(x) for x in zip(*vals))
        p = np.percentile(cos, [5, 50, 95])
        print(
            f"| {name} | {len(vals)} | {int((bm == 0).sum())} | {p[0]:.3f} / {p[1]:.3f} / {p[2]:.3f} | {int(hit.sum())} |"
        )
        zero = cos[bm == 0]
        if len(zero):
            print(
                f"|   of them BM25 all zero | {len(zero)} | | best cosine max {zero.max():.3f} | {int(hit[bm == 0].sum())} |"
            )
    print("\nbest cosine under T, per group (what a cosine threshold alone would call unmatched):\n")
    names = [n for n, v in groups.items() if v]
    print("| T | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    for t in np.arange(0.20, 0.51, 0.025):
        cells = []
        for name in names:
            cos = np.array([c for _, c, _ in groups[name]])
            cells.append(f"{int((cos < t).sum())}/{len(cos)} ({(cos < t).mean():.0%})")
        print(f"| {t:.3f} | " + " | ".join(cells) + " |")


def compare(args) -> None:
    """Two ``rank --out`` files row by row: the questions whose three best pages (what ``-c pages``
    reads first), whose best page and whose "no page matched" verdict are the same, and the hits."""
    a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
    key = lambda r: (r["document"], r["question"], r["wording"], r["method"])  # noqa: E731
    theirs = {key(r): r for r in b}
    pairs = [(r, theirs[key(r)]) for r in a if key(r) in theirs]
    print(
        f"| method | wording | questions | same top three | same first | same no-match verdict "
        f"| hit@3 {args.a.name} -> {args.b.name} |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for method in dict.fromkeys(r["method"] for r, _ in pairs):
        for wording in WORDINGS:
            mine = [(r, t) for r, t in pairs if r["method"] == method and r["wording"] == wording]
            if mine:
                same3 = sum(r["top3"] == t["top3"] for r, t in mine)
                same1 = sum(r["top3"][:1] == t["top3"][:1] for r, t in mine)
                verdict = sum(r["matched"] == t["matched"] for r, t in mine)
                h_a, h_b = sum(r["hit3"] for r, _ in mine), sum(t["hit3"] for _, t in mine)
                print(f"| {method} | {wording} | {len(mine)} | {same3} | {same1} | {verdict} | {h_a} -> {h_b} |")
    for r, t in pairs:
        if r["top3"] != t["top3"]:
            print(f"- {r['document']} ({r['wording']}) {r['question'][:70]!r}: {r['top3']} -> {t['top3']}")


KVCLI_BATCHES = embed.batches  # kvcli's batcher (speed swaps embed.batches)


def rows_of(n: int, chars: list[int]):
    """kvcli's batching before :func:`kvcli.retrieval.embed.batches`, for ``speed --batching
    rows:N``: ``n`` texts a pass whatever their tokens, in the order of their ``chars`` (the
    texts' lengths in characters; kvcli's was 32 a pass)."""

    def batches(lengths: list[int], tokens: int) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: chars[i])
        return [order[i : i + n] for i in range(0, len(order), n)]

    return batches


def batching(spec: str, chars: list[int]):
    """``tokens:N`` (kvcli's batches of at most N tokens) or ``rows:N`` (:func:`rows_of`): (the
    batcher, the token budget it is given)."""
    how, _, n = spec.partition(":")
    if how not in ("tokens", "rows") or not n.isdigit():
        raise SystemExit(f"--batching takes tokens:N or rows:N, not {spec!r}")
    return (KVCLI_BATCHES, int(n)) if how == "tokens" else (rows_of(int(n), chars), 0)


def speed(args) -> None:
    """Windows a second for the embedding model in each setting of ``--dtypes`` x ``--batching``
    (how windows are batched), alternated ``--reps`` times on the same windows (``--windows`` of
    ``--document``'s 100-word windows from passage ``--first-page``, each after the passage
    prompt), and how far the first and the last setting's vectors are apart (cosine). ``--out``:
    the rates as JSON."""
    import time

    import torch

    docs = documents(args.set, args.pdf_dir)
    spec, texts, _ = next(d for d in docs if args.document in (None, d[0]["name"]))
    windows = [w for t in texts[args.first_page :] for w in vectors.windows(t)][: args.windows]
    models = {d: model_of(d) for d in args.dtypes}
    settings = [(d, b) for d in models for b in args.batching]
    rates: dict[tuple, list[float]] = {s: [] for s in settings}
    out = {}
    for m in models.values():
        m.encode(windows[:32])  # warm: oneDNN's kernels made once
    for _ in range(args.reps):
        for d, b in settings:
            embed.batches, embed.BATCH_TOKENS = batching(b, [len(w) for w in windows])
            start = time.perf_counter()
            out[d, b] = models[d].encode(windows)
            rates[d, b].append(len(windows) / (time.perf_counter() - start))
    cos = (out[settings[0]] * out[settings[-1]]).sum(1)
    threads = torch.get_num_threads()
    print(f"{model_name()}, {spec['name']}: {len(windows)} windows from passage {args.first_page}, {threads} threads")
    for setting, r in rates.items():
        all_ = ", ".join(f"{x:.2f}" for x in r)
        print(f"  {', '.join(setting)}: {max(r):.2f} windows a second (best of {len(r)}; all: {all_})")
    print(f"  cosine between {settings[0]} and {settings[-1]}: min {cos.min():.5f}, median {np.median(cos):.5f}")
    if args.out:
        rows = [{"dtype": d, "batching": b, "windows_per_s": [round(x, 2) for x in r]} for (d, b), r in rates.items()]
        about = {"model": model_name(), "document": spec["name"], "first_passage": args.first_page}
        about |= {"windows": len(windows), "threads": threads, "command": " ".join(["python", *sys.argv])}
        args.out.write_text(json.dumps({**about, "rates": rows}, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("rank", "nomatch"):
        s = sub.add_parser(name)
        s.add_argument("--set", type=Path, nargs="+", default=TUNE, help="question files (default: the tuning set)")
        s.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
        s.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-retrieval-bench")
        s.add_argument("--out", type=Path)
        s.add_argument(
            "--dtype",
            choices=("auto", "float32", "bfloat16"),
            default="auto",
            help="the embedding model's (auto: as kvcli runs it on this CPU)",
        )
        if name == "rank":
            s.add_argument("--methods", type=lambda x: x.split(","), default=METHODS)
            s.add_argument("--window", type=int, default=vectors.WINDOW_WORDS, help="words a window (kvcli: 100)")
    s = sub.add_parser("speed")
    s.add_argument("--set", type=Path, nargs="+", default=[TUNE[0]], help="question files (--document picks one)")
    s.add_argument("--pdf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvcli-books-pdfs")
    s.add_argument("--document", help="the document of --set whose windows are embedded (default: its first)")
    s.add_argument("--first-page", type=int, default=0, help="its passage (a PDF's page, from 0) the windows start at")
    s.add_argument("--windows", type=int, default=160)
    s.add_argument("--reps", type=int, default=3)
    s.add_argument("--dtypes", type=lambda x: x.split(","), default=["float32", "bfloat16"])
    s.add_argument(
        "--batching",
        type=lambda x: x.split(","),
        default=[f"tokens:{embed.BATCH_TOKENS}"],
        help="tokens:N (kvcli's: at most N tokens a pass), rows:N (N windows a pass), comma-separated",
    )
    s.add_argument("--out", type=Path)
    s = sub.add_parser("compare")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    args = p.parse_args()
    {"rank": rank, "nomatch": nomatch, "compare": compare, "speed": speed}[args.cmd](args)


if __name__ == "__main__":
    main()
