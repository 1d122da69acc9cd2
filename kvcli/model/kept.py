"""8-bit weights kept on disk: a converted model (an embedded one, a user's GGUF) quantised once
on the CPU (:func:`.cpu_quant.quantize_model`) is saved beside its converted folder, and a later
process builds the model's skeleton on the meta device and loads the int8 codes straight into it:
no float32 copy of the weights in memory (the 1.5B's 6.2 GB), nothing quantised again.

The folder ``<cache>/models/<converted folder>.int8-<dtype>-v<FORMAT>/`` holds ``weights.safetensors``
(every parameter and buffer of the quantised model by its module path, the non-persistent ones
too: the rotary tables) and ``kept.json`` (what it was made from), written into a temporary
folder and renamed into place: data, never code; concurrent processes either see the whole
folder or none. The name holds everything that changes the bytes (the converted folder's own name
carries the GGUF's sha256; the activations' dtype; :data:`FORMAT`, raised whenever the quantiser
or the layout changes); ``kept.json`` repeats the source it was made from, checked on load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..files import share_like_umask
from .cpu_quant import quantize_model

FORMAT = 1
_WEIGHTS, FACTS = "weights.safetensors", "kept.json"


def kept_folder(source: Path, dtype: torch.dtype) -> Path:
    """Where the 8-bit weights of the converted folder ``source`` are kept."""
    return source.parent / f"{source.name}.int8-{str(dtype).removeprefix('torch.')}-v{FORMAT}"


def save(model: torch.nn.Module, source: Path, dtype: torch.dtype) -> Path | None:
    """Keep ``model``'s quantised weights (best effort: a cache that cannot take them costs only
    quantising again next time). Returns the folder, or None when nothing was written."""
    from safetensors.torch import save_file

    target = kept_folder(source, dtype)
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
        save_file(tensors, str(tmp / _WEIGHTS), metadata={"format": f"kvcli-int8-v{FORMAT}"})
        facts = {"format": FORMAT, "source": source.name, "dtype": str(dtype), "tensors": len(tensors)}
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


def load(source: Path, config: Any, dtype: torch.dtype, attn_impl: str) -> torch.nn.Module | None:
    """The quantised model from its kept weights, or None when none are kept (or they do not fit
    this model's skeleton: then the caller quantises again and keeps anew)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = kept_folder(source, dtype)
    try:
        facts = json.loads((folder / FACTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if facts.get("format") != FORMAT or facts.get("source") != source.name:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_impl, dtype=torch.float32)
    quantize_model(model, 8, dtype)  # the quantised layers, empty
    slots = _slots(model)
    try:
        with safe_open(str(folder / _WEIGHTS), framework="pt") as f:
            if set(f.keys()) != set(slots):
                return None
            for name, (module, attr, is_param) in slots.items():
                t = aligned(f.get_tensor(name))
                if is_param:
                    module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
                else:
                    module._buffers[attr] = t
    except (OSError, RuntimeError, ValueError):
        return None
    if any(t.is_meta for t in _named_tensors(model).values()):
        return None
    return model


# Bytes a kept tensor's data starts on. safetensors places tensors 8 bytes apart, and PyTorch's int8
# CPU kernel (torch 2.13, AVX-512) crashes with a segmentation fault on codes that do not start on
# 64 bytes once 4 or more rows come in (a Xeon with AVX-512 and AMX; AVX2 CPUs read them unaligned).
ALIGN = 64


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it in PyTorch's own (64-byte aligned) memory where it starts off :data:`ALIGN`."""
    return t.clone() if t.data_ptr() % ALIGN else t


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
