"""Where and how the model runs: the device (``auto``/cpu/cuda/mps), the dtype, the attention
kernel, and 4/8-bit weights (bitsandbytes), each checked with a one-line error."""

from __future__ import annotations

import importlib.util
import re

import torch

from ..errors import ModelError, UsageError, one_line
from .facts import DTYPES, spelled
from .quiet import quiet_load


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cpu``; ``cuda`` / ``cuda:N``; ``mps``."""
    d = (device or "auto").strip().lower()
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d == "cpu":
        return torch.device("cpu")
    if d == "cuda" or re.fullmatch(r"cuda:\d+", d):
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device}: no CUDA GPU is available on this machine")
        dev = torch.device(d)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: this machine has only {torch.cuda.device_count()} CUDA GPU(s)")
        return dev
    if d == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ModelError("--device mps: no Apple GPU (MPS) is available on this machine")
        return torch.device("mps")
    raise UsageError(f"--device must be auto, cpu, cuda, cuda:N or mps, not '{device}'")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype}")
        return dtype
    key = (dtype or "auto").strip().lower()
    if key not in DTYPES:
        raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, not '{dtype}'")
    resolved = DTYPES[key]
    if resolved is not None:
        return resolved
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def requested_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype ``--dtype`` asks for, checked as :func:`resolve_dtype` checks it; None for auto
    (the device decides)."""
    if not isinstance(dtype, torch.dtype) and (dtype or "auto").strip().lower() == "auto":
        return None
    return resolve_dtype(dtype, torch.device("cpu"))  # an explicit dtype does not depend on the device


def check_cpu_quant(quant: str, dtype: str | torch.dtype | None) -> torch.dtype:
    """The activations' dtype of ``--quant 4|8`` on the CPU (bfloat16: PyTorch's int4/int8
    CPU kernels run 10-40x slower with float32 activations), or a one-line error: a dtype it cannot
    run with, or a PyTorch without the kernel on this CPU."""
    from .cpu_quant import DTYPE, kernel_error

    asked = requested_dtype(dtype) or DTYPE
    if asked != DTYPE:
        raise UsageError(
            f"--quant {spelled(quant)} on the CPU runs with bfloat16 activations (its int4/int8 kernels); "
            f"use --dtype auto or bfloat16, or --quant none for {str(asked).removeprefix('torch.')}"
        )
    why = kernel_error(4 if quant == "4bit" else 8)
    if why is not None:
        other = "--quant 8 or --quant none" if quant == "4bit" else "--quant none"
        raise ModelError(
            f"--quant {spelled(quant)}: this PyTorch has no {spelled(quant)}-bit CPU kernel on this machine ({why}); "
            f"use {other}"
        )
    return DTYPE


def require_bitsandbytes(quant: str) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(
            f"--quant {spelled(quant)} needs bitsandbytes: run `pip install bitsandbytes` "
            "(or `pip install kvcli[quant]`), or use --quant none"
        )
    try:
        with quiet_load():
            importlib.import_module("bitsandbytes")
    except Exception as e:
        raise ModelError(
            f"--quant {spelled(quant)}: bitsandbytes is installed but cannot be imported "
            f"({one_line(e)}); reinstall it or use --quant none"
        ) from e


def check_attn(attn: str, device: torch.device, dtype: torch.dtype) -> str:
    """Validate the attention kernel; return the transformers ``attn_implementation``."""
    if attn == "eager":
        return "eager"
    if attn == "sdpa":
        return "sdpa"
    # flash
    if device.type != "cuda":
        raise ModelError(f"--attn flash needs a CUDA GPU (the device is {device.type}); use --attn sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise ModelError("--attn flash needs the flash-attn package (pip install flash-attn); use --attn sdpa")
    if dtype == torch.float32:
        raise ModelError("--attn flash needs --dtype bfloat16 or float16; use --attn sdpa for float32")
    return "flash_attention_2"


def quant_config(quant: str, dtype: torch.dtype):
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)
