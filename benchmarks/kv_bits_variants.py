"""RULER at 4 bits with a variant of kvcli's KV codec patched in (docs/kv-bits.md, "Accuracy"):
the variants docs/kv-bits.md compares, run through ``kvcli bench ruler`` unchanged otherwise.

    python benchmarks/kv_bits_variants.py VARIANT [kvcli bench ruler arguments...]

    VARIANT: g32           groups of 32 channels, rotated (0.31x the bytes instead of 0.28x)
             g32-plain     groups of 32, not rotated
             g64-plain     groups of 64, not rotated (kvcli's 4-bit codec before the rotation)
             recent16      kvcli's codec for the document; the question's and the answer's KV in
                           16 bits (KIVI's full-precision window of recent tokens, as wide as they are)
             k8v4, k4v8    keys in 8 bits and values in 4, or the reverse (where the 4-bit loss is:
                           a diagnosis, 0.41x the bytes; a plain cache quantizes a key, then its value)

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


def mixed(key_bits: int, value_bits: int) -> None:
    """Each key in ``key_bits`` and each value in ``value_bits``: QuantKVCache quantizes a layer's
    keys, then its values (kvcli/caches/qkv.py), so the calls alternate."""
    real = quant.quantize
    calls = [0]

    def quantize(x, bits):
        calls[0] += 1
        return real(x, key_bits if calls[0] % 2 else value_bits)

    quant.quantize = quantize


VARIANTS = {
    "k8v4": lambda: mixed(8, 4),
    "k4v8": lambda: mixed(4, 8),
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
