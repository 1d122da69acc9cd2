"""Texts kvcli ships, each with one owner here: the passkey-retrieval filler.

The filler of Mohtashami & Jaggi (2023, "Landmark Attention"), which RULER also uses as its noise
haystack: the needle documents of ``kvcli bench`` (``--haystack filler``), RULER's repeated-noise
tasks and DuoAttention's head calibration read it.
"""

from __future__ import annotations

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def filler_text(repeats: int = 2000) -> str:
    """The filler sentence repeated ``repeats`` times (~48k tokens at the default)."""
    return " ".join([FILLER] * repeats)
