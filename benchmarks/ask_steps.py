"""Where one ``kvcli ask``'s wait goes: the command run in this process with its steps stamped on
the wall clock (seconds since the process started), from importing PyTorch to the answer printed.

    python benchmarks/ask_steps.py --out steps.json -- BOOK.pdf "QUESTION" -m qwen2.5-coder-0.5b --cache-dir DIR

Everything after ``--`` is ``kvcli ask``'s arguments. Each step is a function of kvcli's (or an
import) wrapped to stamp its start and end; nothing else changes. A step inside another counts in
both (the model's tokenizer inside ``read_model``). Time it alone on the machine: a later question
in a new process is the process a user waits for (run the book's first question before, with the
same ``--cache-dir``, to have its page vectors and model kept).
"""

from __future__ import annotations

import time

START = time.monotonic()  # before anything heavy is imported

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from portable import scrub  # noqa: E402

STEPS = [  # (module, attribute path, what it is)
    ("kvcli.documents", "load_document", "the document read (a PDF's text extracted)"),
    ("kvcli.model.load", "load_model", "the language model loaded"),
    ("kvcli.model.load", "read_model", "its config, weights and tokenizer read"),
    ("kvcli.model.kept", "load", "its kept quantised weights mapped"),
    ("kvcli.api", "Session.ask", "the question, start to answer"),
    ("kvcli.answer.prompt", "build_prompt", "the prompt built (the document tokenized)"),
    ("kvcli.retrieval.bm25", "bm25_scores", "BM25"),
    ("kvcli.retrieval.embed", "embedder", "the ranking model loaded"),
    ("kvcli.retrieval.vectors", "passage_vectors", "the candidates' windows embedded (or read back)"),
    ("kvcli.answer.pipeline", "_prefill", "the prompt read (prefill)"),
    ("kvcli.answer.pipeline", "_decode", "the answer decoded"),
]


def stamp(log: list, what: str) -> None:
    log.append((round(time.monotonic() - START, 3), what))


def wrap(log: list, module: str, attr: str, label: str) -> None:
    """Stamp the start and end of ``module.attr`` (a function, or a method as ``Class.name``)."""
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def stamped(*args, **kwargs):
        stamp(log, f"{label}: start")
        try:
            return fn(*args, **kwargs)
        finally:
            stamp(log, f"{label}: end")

    setattr(owner, name, stamped)
    for other in list(sys.modules.values()):  # names imported with "from module import fn"
        if other is not None and getattr(other, name, None) is fn and other is not owner:
            setattr(other, name, stamped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("ask", nargs="+", help="kvcli ask's arguments, after --")
    args = p.parse_args()
    log: list = []
    stamp(log, "python started")
    import torch  # noqa: F401

    stamp(log, "torch imported")
    import transformers  # noqa: F401

    stamp(log, "transformers imported")
    from kvcli.cli import main as kvcli_main

    stamp(log, "kvcli's command imported")
    for module, attr, label in STEPS:
        wrap(log, module, attr, label)
    stamp(log, "the steps' modules imported")
    sys.argv = ["kvcli", "ask", *args.ask]
    code = 0
    try:
        kvcli_main()
    except SystemExit as e:
        code = e.code or 0
    stamp(log, "exit")
    for t, what in log:
        print(f"{t:8.2f}  {what}", file=sys.stderr)
    if args.out:
        out = {"command": scrub(shlex.join(["python", "benchmarks/ask_steps.py", "--", *args.ask])), "exit": code}
        args.out.write_text(json.dumps({**out, "steps": [{"t_s": t, "step": w} for t, w in log]}, indent=1) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
