"""RULER at 4 bits with a variant of kvcli's KV codec patched in (docs/kv-bits.md, "Accuracy"):
the variants docs/kv-bits.md compares, run through ``kvcli bench ruler`` unchanged otherwise.

    python benchmarks/kv_bits_variants.py VARIANT [kvcli bench ruler arguments...]

    VARIANT: g32           groups of 32 channels, rotated (0.31x the bytes instead of 0.28x)
             g32-plain     groups of 32, not rotated
             g64-plain     groups of 64, not rotated (kvcli's 4-bit codec before the rotation)
             recent16      kvcli's codec for the document; the question's and the answer's KV in
                           16 bits (KIVI's full-precision window of recent tokens, as wide as they are)

e.g. ``python benchmarks/kv_bits_variants.py g32 --methods full --ratios none --lengths 1024,2048,4096
--tasks niah_single_2,niah_single_3,niah_multikey_1 --samples 2 --kv-bits 4 --out /tmp/ruler-g32``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.answer import pipeline, prefix  # noqa: E402
from kvcli.caches import quant  # noqa: E402
from kvcli.cli import main  # noqa: E402


def recent16() -> None:
    """Decode on the quantized prefix given back in 16 bits (Prefix.take's dense()), so what is
    appended after it — the question, the answer — stays 16-bit."""
    pipeline.Pipeline.small_kv = lambda self, cache, bits: cache
    init = prefix.Prefix.__init__

    def dense_taker(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.quantized = False

    prefix.Prefix.__init__ = dense_taker


VARIANTS = {
    "g32": lambda: setattr(quant, "GROUP", 32),
    "g32-plain": lambda: (setattr(quant, "GROUP", 32), setattr(quant, "ROTATED", ())),
    "g64-plain": lambda: setattr(quant, "ROTATED", ()),
    "recent16": recent16,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: kv_bits_variants.py {{{','.join(VARIANTS)}}} [kvcli bench ruler arguments...]")
    VARIANTS[sys.argv[1]]()
    sys.argv = ["kvcli", "bench", "ruler", *sys.argv[2:]]
    main()
