"""Quantised weights kept on disk: a converted model (an embedded one, a user's GGUF) quantised once
on the CPU (:func:`.cpu_quant.quantize_model`, 8 bits or ``--quant 4``'s 4) is saved beside its
converted folder, and a later process builds the model's skeleton on the meta device and loads the
codes straight into it: no float32 copy of the weights in memory (the 1.5B's 6.2 GB), nothing
quantised again (at 4 bits that is every group's grid found again: the 1.5B's first load 234 s,
a later one 9 s, docs/cpu.md).

The folder ``<cache>/models/<converted folder>.int8-<dtype>-v<FORMAT>/`` (``.int4-<dtype>-torch<version>-v<FORMAT>``
at 4 bits: the packed 4-bit codes are in PyTorch's own CPU layout, so another PyTorch keeps its own)
holds ``weights.safetensors`` (every parameter and buffer of the quantised model by its module
path, the non-persistent ones too: the rotary tables) and ``kept.json`` (what it was made from; at
4 bits the matrices left in int8), written into a temporary folder and renamed into place: data,
never code; concurrent processes either see the whole folder or none. The name holds everything
that changes the bytes (the converted folder's own name carries the GGUF's sha256; the bits; the
activations' dtype; :data:`FORMAT`, raised whenever the quantiser or the layout changes);
``kept.json`` repeats the source it was made from, checked on load.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..files import share_like_umask
from .cpu_quant import int8_paths, quantize_model

FORMAT = 1
_WEIGHTS, FACTS = "weights.safetensors", "kept.json"


def kept_folder(source: Path, dtype: torch.dtype, bits: int = 8) -> Path:
    """Where the ``bits``-bit weights of the converted folder ``source`` are kept."""
    dt = str(dtype).removeprefix("torch.")
    kind = f"int8-{dt}" if bits == 8 else f"int4-{dt}-torch{torch.__version__}"
    return source.parent / f"{source.name}.{kind}-v{FORMAT}"


def save(model: torch.nn.Module, source: Path, dtype: torch.dtype, bits: int = 8) -> Path | None:
    """Keep ``model``'s quantised weights (best effort: a cache that cannot take them costs only
    quantising again next time). Returns the folder, or None when nothing was written."""
    from safetensors.torch import save_file

    target = kept_folder(source, dtype, bits)
    if (target / FACTS).is_file():
        return target
    tensors, storages = {}, set()
    for name, t in _named_tensors(model).items():  # safetensors refuses two names on one storage: copy
        t = t.detach().contiguous()
        tensors[name] = t.clone() if t.untyped_storage().data_ptr() in storages else t
        storages.add(t.untyped_storage().data_ptr())
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        save_file(tensors, str(tmp / _WEIGHTS), metadata={"format": f"kvcli-int{bits}-v{FORMAT}"})
        facts = {"format": FORMAT, "source": source.name, "dtype": str(dtype), "tensors": len(tensors), "bits": bits}
        if bits == 4:
            facts["int8"] = int8_paths(model)
        (tmp / FACTS).write_text(json.dumps(facts, indent=1), encoding="utf-8")
        share_like_umask(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / FACTS).is_file():
                raise
    except (OSError, RuntimeError):
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(source: Path, config: Any, dtype: torch.dtype, attn_impl: str, bits: int = 8) -> torch.nn.Module | None:
    """The ``bits``-bit quantised model from its kept weights, or None when none are kept (or they
    do not fit this model's skeleton: then the caller quantises again and keeps anew)."""
    from transformers import AutoModelForCausalLM

    folder = kept_folder(source, dtype, bits)
    try:
        facts = json.loads((folder / FACTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if facts.get("format") != FORMAT or facts.get("source") != source.name or facts.get("bits", 8) != bits:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_impl, dtype=torch.float32)
    int8 = set(facts.get("int8", ())) if bits == 4 else None
    quantize_model(model, bits, dtype, int8=int8)  # the quantised layers, empty
    slots, gathered = _slots(model), _gathered(model)
    embedding = model.get_input_embeddings()
    try:
        with open(folder / _WEIGHTS, "rb") as f:
            index = _index(f)
            if set(index) != set(slots):
                return None
            read = _read_all(folder / _WEIGHTS, {n: info for n, info in index.items() if n not in gathered})
            for name, (module, attr, is_param) in slots.items():
                t = _mapped(f, index[name], embedding) if name in gathered else read[name]
                if is_param:
                    module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
                else:
                    module._buffers[attr] = t
    except (OSError, RuntimeError, ValueError):
        return None
    if any(t.is_meta for t in _named_tensors(model).values()):
        return None
    return model


# Kept tensors are read into PyTorch's own memory, which starts every tensor on 64 bytes, not mapped
# from the file: safetensors places tensors 8 bytes apart, and PyTorch's int8 CPU kernel (torch 2.13,
# AVX-512) crashes with a segmentation fault on codes that do not start on 64 bytes once 4 or more
# rows come in (a Xeon with AVX-512 and AMX; AVX2 CPUs read them unaligned). Copying mapped tensors
# instead held the file's read pages and the copies at once (the 1.5B's load: 3.9 GB resident). The one
# exception, :func:`_gathered`'s table, is mapped: no kernel reads it, rows are gathered from it.
ALIGN = 64
_DTYPES = {
    "I8": torch.int8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def _index(f: Any) -> dict[str, dict]:
    """A safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"} (from after its header)."""
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    for info in header.values():
        info["start"] = 8 + size + info["data_offsets"][0]
    return header


READERS = 2  # threads reading a kept file: the 1.5B's 1.5 GB in 0.46 s against 0.79 s with one (2 cores)


def _read_all(path: Path, index: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every tensor of ``index`` read from ``path`` (:func:`_read`), by :data:`READERS` threads,
    each on its own file handle: a read copies from the page cache into new memory whose pages fault
    in one by one, which two cores do in about half the time (the copy leaves Python's lock)."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(index)

    def share(i: int) -> dict[str, torch.Tensor]:
        with open(path, "rb") as f:
            return {n: _read(f, index[n]) for n in names[i::READERS]}

    with ThreadPoolExecutor(READERS) as pool:
        return {n: t for part in pool.map(share, range(READERS)) for n, t in part.items()}


def _read(f: Any, info: dict) -> torch.Tensor:
    """One tensor of :func:`_index` read from ``f`` into a new (aligned) tensor."""
    t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
    f.seek(info["start"])
    if f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != info["data_offsets"][1] - info["data_offsets"][0]:
        raise ValueError("a kept tensor is cut short")
    return t


def _mapped(f: Any, info: dict, embedding: torch.nn.Module) -> torch.Tensor:
    """The codes of ``embedding``'s table (:func:`_index`'s ``info``) mapped from ``f``, privately
    (never written back), not read; after each lookup the mapped pages are handed back
    (``MADV_DONTNEED``: they stay in the page cache, not in the process), since this kernel maps a
    file's pages in large folios around each row looked up (1,293 rows of the 0.5B's table: 80 MB)."""
    start, end = info["start"], info["start"] + info["data_offsets"][1] - info["data_offsets"][0]
    page = start - start % mmap.ALLOCATIONGRANULARITY
    if os.fstat(f.fileno()).st_size < end:
        raise ValueError("a kept tensor is cut short")
    view = mmap.mmap(f.fileno(), end - page, offset=page, access=mmap.ACCESS_COPY)
    embedding.after_lookup = functools.partial(view.madvise, mmap.MADV_DONTNEED)
    flat = torch.frombuffer(view, dtype=torch.uint8, count=end - start, offset=start - page)
    return flat.view(_DTYPES[info["dtype"]]).view(info["shape"])


def _gathered(model: torch.nn.Module) -> set[str]:
    """The tensors only ever gathered by row: an untied token embedding's own int8 codes (a tied
    table is the LM head, read whole each step), which :func:`load` maps from the file instead of
    reading them (the 0.5B's GGUF has an output matrix of its own: its 130 MB table is not held)."""
    table = getattr(model.get_input_embeddings(), "table", None)
    if not hasattr(mmap, "MADV_DONTNEED"):  # no pages to hand back (Windows): read it
        return set()
    names = [name for name, module in model.named_modules() if module is table]
    return {f"{names[0]}.codes"} if names else set()


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by its module path."""
    out: dict[str, torch.Tensor] = {}
    for name, (module, attr, is_param) in _slots(model).items():
        out[name] = (module._parameters if is_param else module._buffers)[attr]
    return out


def _slots(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """name -> (module, attribute, is a parameter) of every tensor the model's modules hold."""
    slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}
    for mod_name, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for attr, t in store.items():
                if t is None:
                    continue
                slots[f"{mod_name}.{attr}" if mod_name else attr] = (module, attr, is_param)
    return slots
