"""Full attention: the baseline every method is measured against.

Every prompt token goes through every layer and stays in the KV cache; nothing is selected or
evicted. (Vaswani et al., 2017, "Attention Is All You Need".)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Compressor


@dataclass
class FullAttention(Compressor):
    """Full attention (no compression): the reference all methods must reproduce when told to keep everything."""

    name: ClassVar[str] = "full"
    paper: ClassVar[str] = "Vaswani et al. 2017, Attention Is All You Need"
    keep_all: ClassVar[str] = ""  # nothing is ever dropped
    short_document_spec: ClassVar[str] = "full"
    holds_every_token: ClassVar[bool] = True
    title: ClassVar[str] = "full attention"
    acts: ClassVar[str] = "—"
    positions: ClassVar[str] = "original"
    disk_cache: ClassVar[str] = "prefix KV, all layers"
    auto_kv_bits: ClassVar[int] = 8  # its layout is quantized: --kv-bits auto holds it in 8 bits (docs/kv-bits.md)
