"""How far a quantized KV moves the model's next-token distribution, codec by codec (issue 40:
why kvcli's KV codec turns each group by a Hadamard rotation; docs/kv-bits.md, "The format").

    python benchmarks/kv_bits_codecs.py [TOKENS] [DOCUMENT]    # default: 3500  examples/lighthouse.md x4
    pdftotext -l 12 /tmp/kvcli-books-pdfs/R-intro.pdf r.txt    # the PDF as benchmarks/books.py fetches it
    python benchmarks/kv_bits_codecs.py 3500 r.txt

The embedded model reads TOKENS tokens of DOCUMENT once; its KV is then rounded by each codec
(every layer, keys and values) and the next 512 tokens of the document and a question are read on
top of it. Printed per codec: the KL divergence of those tokens' next-token distributions from the
16-bit ones (mean) and the share of their top tokens that stay the same. Codecs:

- ``rows``: kvcli's layout without the rotation (each row's groups of 64 channels, min/max),
  llama.cpp's q8_0/q4_1 shape;
- ``rows g32``: the same with groups of 32 (more scales: 0.31x the bytes at 4 bits);
- ``rows+hadamard``: each group turned by a Hadamard rotation first: kvcli's 4-bit codec
  (:mod:`kvcli.caches.quant`; its 8-bit codec is ``rows``);
- ``rows+hadamard g32``: the same with groups of 32;
- ``kivi``: KIVI's keys per channel over groups of 64 tokens, values per row.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.caches import quant  # noqa: E402
from kvcli.model.embedded import embedded_model_path  # noqa: E402

QUESTION = "\nQuestion: What is the combination for the oil store padlock? Answer:"


def rows(x: torch.Tensor, bits: int, group: int = quant.GROUP, rotate: bool = True) -> torch.Tensor:
    """``x`` through kvcli's codec with ``group`` channels a scale, the rotation on or off (kvcli
    turns 4-bit groups only: :data:`kvcli.caches.quant.ROTATED`)."""
    old_group, old_rotated = quant.GROUP, quant.ROTATED
    quant.GROUP, quant.ROTATED = group, ((8, 4) if rotate else ())
    try:
        return quant.dequantize(quant.quantize(x, bits), x.shape[-1], x.dtype)
    finally:
        quant.GROUP, quant.ROTATED = old_group, old_rotated


def kivi_keys(x: torch.Tensor, bits: int, tokens: int = 64) -> torch.Tensor:
    """KIVI's keys: each channel over groups of ``tokens`` tokens its own min/max (an odd tail as it is)."""
    y = x.transpose(-1, -2).contiguous()  # (..., d, t): a channel's tokens form a row
    out = y.clone()
    for a in range(0, y.shape[-1] - 1, tokens):
        seg = y[..., a : a + tokens].contiguous()
        if seg.shape[-1] % 2 == 0:
            out[..., a : a + tokens] = rows(seg, bits, group=seg.shape[-1], rotate=False)
    return out.transpose(-1, -2)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3500
    text = Path(sys.argv[2]).read_text() if len(sys.argv) > 2 else (ROOT / "examples/lighthouse.md").read_text() * 4
    torch.manual_seed(0)
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    all_ids = tok(text, return_tensors="pt").input_ids
    ids = all_ids[:, :n]
    q = torch.cat([all_ids[:, n : n + 512], tok(QUESTION, return_tensors="pt").input_ids], dim=1)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        ref = model(q, past_key_values=copy.deepcopy(cache), use_cache=True).logits.float().log_softmax(-1)
    codecs = {
        "rows": lambda k, v, b: (rows(k, b, rotate=False), rows(v, b, rotate=False)),
        "rows g32": lambda k, v, b: (rows(k, b, 32, rotate=False), rows(v, b, 32, rotate=False)),
        "rows+hadamard": lambda k, v, b: (rows(k, b), rows(v, b)),
        "rows+hadamard g32": lambda k, v, b: (rows(k, b, 32), rows(v, b, 32)),
        "kivi": lambda k, v, b: (kivi_keys(k, b), rows(v, b, rotate=False)),
    }
    print(f"{ids.shape[1]} tokens quantized, {q.shape[1]} read on top; KL from 16 bits (mean), top-1 the same")
    print("| codec | bits | KL | top-1 same |\n|---|---|---|---|")
    for bits in (8, 4):
        for name, codec in codecs.items():
            c = copy.deepcopy(cache)
            for layer in c.layers:
                layer.keys, layer.values = codec(layer.keys, layer.values, bits)
            with torch.no_grad():
                got = model(q, past_key_values=c, use_cache=True).logits.float().log_softmax(-1)
            kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
            same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"| {name} | {bits} | {kl:.4f} | {same:.0%} |", flush=True)


if __name__ == "__main__":
    main()
