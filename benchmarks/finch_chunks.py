"""Finch's chunk size on the embedded model: the default (1024, the paper's range) vs the old
automatic chunk (window - target - 512 = 6,656 tokens: one chunk for most documents).

    PYTHONPATH=. python benchmarks/finch_chunks.py                       # ~5 min on 2 shared CPU cores
    PYTHONPATH=. python benchmarks/finch_chunks.py --specs "finch;finch:chunk=6656" --needles 3000,6000

Runs the five lighthouse questions (examples/questions.txt; answers checked by keyword, as
benchmarks/lazyllm_schedules.py) and passkey documents of the given lengths (filler haystack,
needle at depth 0.5), one process, no disk cache. Finch protects every token after the document
(``Prompt.n_after_document``: the instructions, the question, the generation prompt); until the
pipeline passes that count itself, ``--protect after-document`` (the default) passes it to Finch's
prefill here. TTFT is wall time on a shared machine: compare rows of one run, expect ~20% jitter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcli.api import AskOptions, Session, read_document
from kvcli.bench.needle import make_case
from kvcli.documents import document_from_text
from kvcli.pipeline import Pipeline
from kvcli.prompt import build_prompt

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ["4-7-1-9", "Penhallow", "two white flashes", "Tobias Wren", "412|four hundred and twelve"]


def protect_after_document(pipeline: Pipeline, prompt) -> None:
    owner = pipeline.owner("prefill")
    if owner is None:
        return
    original = owner.prefill
    owner.prefill = lambda engine, ids, prefix=None, protected=0: original(engine, ids, prefix, prompt.n_after_document)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", default="full;finch;finch:chunk=6656", help="';'-separated method specs")
    ap.add_argument("--needles", default="3000,6000", help="passkey document lengths (tokens); '' for none")
    ap.add_argument("--no-lighthouse", action="store_true", help="only the passkey documents")
    ap.add_argument("--protect", default="after-document", choices=["after-document", "pipeline"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    session = Session.open(AskOptions(use_cache=False, max_new_tokens=args.max_new_tokens))
    lm = session.lm
    lighthouse = read_document(ROOT / "examples" / "lighthouse.pdf")
    lines = (ROOT / "examples" / "questions.txt").read_text().splitlines()
    cases = [(lighthouse, q.strip(), e) for q, e in zip([q for q in lines if q.strip() and not q.startswith("#")], EXPECTED)]
    if args.no_lighthouse:
        cases = []
    for i, n in enumerate(int(x) for x in args.needles.split(",") if x.strip()):
        case = make_case(lm.tokenizer, n, 0.5, seed=i, haystack="filler")
        cases.append((document_from_text(case.text, source=f"needle-{n}"), case.question, case.key))
    for spec in [s.strip() for s in args.specs.split(";") if s.strip()]:
        for document, question, expected in cases:
            prompt = build_prompt(lm.tokenizer, document.text, question, session.template)
            pipeline = Pipeline.parse(spec)
            if args.protect == "after-document":
                protect_after_document(pipeline, prompt)
            result = session.ask(document, question, pipeline)
            good = any(x.lower() in result.answer.lower().replace(" ", "") or x.lower() in result.answer.lower() for x in expected.split("|"))
            print(
                f"{spec:22s} {document.source[-16:]:>16s} {prompt.n_tokens:6,d} tok  {'+' if good else '-'}  "
                f"TTFT {result.ttft_s:6.2f} s  KV {result.extra['kv_cache_bytes'] / 2**20:6.1f} MiB  "
                f"{' '.join(result.answer.split())[:70]!r}",
                flush=True,
            )


if __name__ == "__main__":
    main()
