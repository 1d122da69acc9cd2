"""``--kv-bits``'s vocabulary: the precisions the KV may be held in, ``auto``, the default, its
variable and its help, and the check of a value. It imports nothing (no PyTorch), so that the
options' declarations and ``kvcli --help`` read it at once; kvcli.caches.quant, the codecs, uses it
(and names it as before: ``quant.KV_BITS`` ...)."""

from __future__ import annotations

KV_BITS = (16, 8, 4)  # the precisions of --kv-bits; 16: the model's own dtype (no quantization)
AUTO = "auto"  # --kv-bits auto: each method's own choice (Compressor.auto_kv_bits)
DEFAULT_KV_BITS = AUTO
ENV_KV_BITS = "KVCLI_KV_BITS"
KV_BITS_HELP = (
    "Bits the KV is held in, in memory and in the disk cache: 16 (the model's own dtype), 8 or 4 "
    "(each row's groups of 64 numbers with their scale: 0.53x / 0.28x the bytes; accuracy: docs/kv-bits.md); "
    "methods whose KV layout is not quantized keep 16 and say so"
)


def check_bits(bits, auto: bool = True) -> int | str:
    """``bits`` as one of :data:`KV_BITS`, or :data:`AUTO` (where ``auto``); ValueError naming the
    choices otherwise."""
    if auto and str(bits).strip().lower() == AUTO:
        return AUTO
    try:
        value = int(bits)
    except (TypeError, ValueError):
        value = None
    if value not in KV_BITS:
        choices = ", ".join(map(str, KV_BITS)) + (f" or {AUTO}" if auto else "")
        raise ValueError(f"kv bits must be one of {choices}, not {bits!r}")
    return value
