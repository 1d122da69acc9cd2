"""One kvcli measurement (see common.py): ``python worker_kvcli.py CASE SPEC [--store DIR]``.

SPEC is a kvcli compressor spec (``full``, ``snapkv:budget=0.25`` ...); the model is the case's
``model`` (an embedded model's name, as ``-m NAME``; None: the default). ``--store DIR``: use the
disk KV store in DIR (the repeat-question rows: a first process fills it, a second one reads it);
without it the store is off (cold runs). The answer is forced to the case's ``new_tokens`` tokens
(``force_tokens``: decode speed over a fixed length); the answer compared is the part before the
first stop token. The environment variable ``KVCLI_SRC`` selects which kvcli tree is measured (run.py's
``--before``); ``KVCLI_LOW_MEMORY=1`` runs with ``--low-memory``, ``KVCLI_QUANT=Q`` with ``--quant Q``,
``KVCLI_LOOKUP=N`` with ``--lookup N``."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("KVCLI_SRC"):  # measure another kvcli tree: bypass the editable install's finder
    sys.meta_path = [f for f in sys.meta_path if "editable" not in str(f)]
    sys.path.insert(0, os.environ["KVCLI_SRC"])
import torch  # noqa: E402
from common import Clock, emit, read_case, reset_peak  # noqa: E402

import kvcli  # noqa: E402
from kvcli.api import AskOptions, QuestionOptions, Session, parse_pipeline  # noqa: E402
from kvcli.documents import document_from_text  # noqa: E402
from kvcli.store import KVStore  # noqa: E402


def main() -> None:
    case, spec, extra = read_case()
    store = Path(extra[extra.index("--store") + 1]) if "--store" in extra else None
    options = {"low_memory": True} if os.environ.get("KVCLI_LOW_MEMORY") else {}
    if os.environ.get("KVCLI_QUANT"):  # run.py --quants: a precision other than the default
        options["quant"] = os.environ["KVCLI_QUANT"]
    if os.environ.get("KVCLI_LOOKUP"):  # run.py --lookups: drafts from the text read, other than the default
        options["lookup"] = int(os.environ["KVCLI_LOOKUP"])
    session = Session.open(AskOptions(model=case.get("model"), use_cache=False, **options))  # None: the default
    if store is not None:
        session = dataclasses.replace(session, store=KVStore.open(store))
    doc = document_from_text(case["document"])
    # warm-up on a short prompt: one-time costs (kernels, allocator) are not the method's
    warm = document_from_text(case["document"][:1500])
    try:
        session.ask(warm, case["question"], parse_pipeline(spec), QuestionOptions(max_new_tokens=4, use_store=False))
    except Exception:
        session.ask(warm, case["question"], parse_pipeline("full"), QuestionOptions(max_new_tokens=4, use_store=False))
    reset_peak()
    clock = Clock()
    result = session.ask(
        doc,
        case["question"],
        parse_pipeline(spec),
        QuestionOptions(
            on_token=lambda _t: clock.token(),  # decoding ends at the last token, not after the sources
            max_new_tokens=case["new_tokens"],
            force_tokens=True,
            use_store=store is not None,
        ),
    )
    clock.done()
    if result.prompt.ids.tolist() != case["ids"]:
        raise SystemExit("kvcli built other prompt ids than the case's")
    emit(
        case,
        clock,
        result.answer_ids,
        kvcli_src=os.path.dirname(kvcli.__file__),
        compression_ratio=round(result.compression_ratio, 3) if hasattr(result, "compression_ratio") else None,
        cache=(result.extra.get("cache") or {}).get("status"),
        own_decode_tokens_per_s=result.decode_tokens_per_s,  # kvcli's own clock, first to last token
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
