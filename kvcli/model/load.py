"""``load_model``: any of the model sources, on the chosen device, dtype, kernel and quantisation,
checked to be a decoder kvcli can run layer by layer, with its fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, UsageError, one_line
from ..runtime.measure import malloc_trim
from .cpu_quant import quantize_model
from .device import (
    check_attn,
    check_cpu_quant,
    quant_config,
    requested_dtype,
    require_bitsandbytes,
    resolve_device,
    resolve_dtype,
)
from .embedded import EMBEDDED_MODEL, embedded_gguf_file, ensure_converted
from .facts import ATTNS, QUANTS, LoadedModel, spelled
from .fingerprint import compute_fingerprint, weights_identity
from .ggufs import GEMMA_MODEL, ensure_gemma_converted, ensure_gguf_converted, gguf_linear_types
from .hub import check_local_folder, hub_load, hub_snapshot_dir, looks_like_path
from .quiet import quiet_load


def check_structure(model: Any, name: str, config: Any) -> None:
    """kvcli runs the decoder layer by layer: it needs a llama-style decoder.

    That is ``model.get_decoder()`` with ``embed_tokens``, ``layers``, ``norm`` and
    ``rotary_emb`` (llama, mistral, qwen2, qwen3, phi3, gemma, ... have them; gpt2 does not).
    """
    try:
        base = model.get_decoder()
    except Exception:
        base = None
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if base is None or missing:
        raise ModelError(
            f"cannot use model '{name}': kvcli does not support the '{config.model_type}' "
            "architecture (it needs a llama-style decoder, e.g. llama, mistral, qwen2, qwen3, phi3)"
        )


def load_model(
    spec: str | None = None,
    *,
    device: str = "auto",
    quant: str = "auto",
    attn: str = "sdpa",
    dtype: str | torch.dtype = "auto",
    cache_dir: Path | str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: None or :data:`EMBEDDED_MODEL` for the embedded SmolLM2-135M-Instruct (converted
    once into ``cache_dir``, see :func:`embedded_model_path`); an existing local folder; or a
    Hugging Face hub id (loaded from the local HF cache, else downloaded).

    ``device``: see :func:`resolve_device`. ``quant``: "none"; "4bit" / "8bit": on the CPU
    PyTorch's int4 / int8 CPU kernels with bfloat16 activations (:mod:`.cpu_quant`), on CUDA
    bitsandbytes (nf4 / int8); "auto" (the default): "8bit" on the CPU for a GGUF whose layers are
    Q4_1 blocks — the embedded model's — when ``dtype`` is auto or bfloat16, else "none": 8bit
    scored at least as well as float32 on every accuracy measure kept (RULER slice, the books'
    oracle), 4bit 1-2 instances below 8bit on each; 4bit decodes 3-10% faster (docs/cpu.md).
    ``attn``: "sdpa", "eager", or "flash" (CUDA + flash-attn only).
    ``dtype``: "auto" (float32 on CPU, bfloat16 with --quant there; bfloat16 on CUDA when
    supported, else float16), "float32", "bfloat16" or "float16".

    Every failure a user can cause raises :class:`ModelError` (or :class:`UsageError` for a bad
    option value) with a one-line message.
    """
    # --- options
    quant = (quant or "auto").strip().lower()
    if quant not in QUANTS:
        raise UsageError(
            f"quant must be auto, none, 4bit or 8bit (load_model's names of --quant 4 and 8), not '{quant}'"
        )
    attn = (attn or "sdpa").strip().lower()
    if attn not in ATTNS:
        raise UsageError(f"--attn must be sdpa, eager or flash, not '{attn}'")
    dev = resolve_device(device)
    name = EMBEDDED_MODEL if spec is None or spec.strip() == "" else spec.strip()
    cache = Path(cache_dir) if cache_dir is not None else None
    if quant == "auto":
        quant = auto_quant(name, dev, dtype, cache)
    cpu_quant = quant != "none" and dev.type == "cpu"
    torch_dtype = check_cpu_quant(quant, dtype) if cpu_quant else resolve_dtype(dtype, dev)
    attn_impl = check_attn(attn, dev, torch_dtype)
    if quant != "none" and not cpu_quant:
        if dev.type != "cuda":
            raise ModelError(f"--quant {spelled(quant)} works on cpu and cuda only, not on {dev.type}")
        require_bitsandbytes(quant)

    # --- where from
    hub = False
    if name.lower() in (EMBEDDED_MODEL, GEMMA_MODEL):
        convert = ensure_converted if name.lower() == EMBEDDED_MODEL else ensure_gemma_converted
        folder, gguf_sha = convert(cache)
        source = str(folder)
        weights_id: Any = {"gguf_sha256": gguf_sha}
    else:
        local = Path(name).expanduser()
        if local.is_file() and local.suffix.lower() == ".gguf":
            # a GGUF of a supported family (llama.cpp's, ollama's): converted once, keyed by its sha256
            folder, gguf_sha = ensure_gguf_converted(local, cache)
            source = str(folder)
            weights_id = {"gguf_sha256": gguf_sha}
        elif local.exists():
            check_local_folder(name, local)
            source = str(local.resolve())
            weights_id = None  # computed below from the folder
        elif local.suffix.lower() == ".gguf":
            raise ModelError(f"cannot load model '{name}': no such file")
        elif looks_like_path(name):
            raise ModelError(f"cannot load model '{name}': no such directory")
        else:
            source = name
            hub = True
            weights_id = None

    # --- load
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    def call(fn, what: str, **kw):
        if hub:
            return hub_load(fn, source, what, **kw)
        return fn(source, **kw)

    try:
        with quiet_load():
            config = call(AutoConfig.from_pretrained, "the config", trust_remote_code=trust_remote_code)
            auto_map = getattr(config, "auto_map", None) or {}
            if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (
                trust_remote_code and "AutoModelForCausalLM" in auto_map
            ):
                hint = " (it has custom code: add --trust-remote-code)" if "AutoModelForCausalLM" in auto_map else ""
                raise ModelError(
                    f"cannot load model '{name}': model type '{config.model_type}' is not a "
                    f"causal language model that transformers can run{hint}"
                )
            kwargs: dict[str, Any] = {
                "config": config,
                # 4/8-bit on the CPU: quantised from the float32 weights (the GGUF's exact values)
                "dtype": torch.float32 if cpu_quant else torch_dtype,
                "attn_implementation": attn_impl,
                "trust_remote_code": trust_remote_code,
            }
            model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
            if attn_impl == "sdpa" and model_cls is not None and getattr(model_cls, "_supports_sdpa", True) is False:
                # Gemma 2 refuses sdpa (its soft-capped scores); kvcli runs its own attention anyway
                # (kvcli.runtime.attention.install), which soft-caps, so load it with eager
                kwargs["attn_implementation"] = "eager"
            qc = None if cpu_quant else quant_config(quant, torch_dtype)
            if qc is not None:
                kwargs["quantization_config"] = qc
            if dev.type != "cpu":
                kwargs["device_map"] = {"": str(dev)}
            model = call(AutoModelForCausalLM.from_pretrained, "the weights", **kwargs)
            tokenizer = call(AutoTokenizer.from_pretrained, "the tokenizer", trust_remote_code=trust_remote_code)
    except ModelError:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"cannot load model '{name}' on {dev}: out of GPU memory; try --quant 4") from e
    except MemoryError as e:
        raise ModelError(f"cannot load model '{name}': not enough memory") from e
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, TypeError, AttributeError) as e:
        msg = one_line(e)
        if "trust_remote_code" in msg:
            msg = "it contains custom code; add --trust-remote-code if you trust it"
        raise ModelError(f"cannot load model '{name}': {msg}") from e

    check_structure(model, name, config)
    if cpu_quant:
        quantize_model(model, 4 if quant == "4bit" else 8, torch_dtype)
        malloc_trim()  # the float32 weights it was made from, freed in pieces glibc would keep (~250 MB)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    if weights_id is None:
        snapshot = Path(source) if not hub else hub_snapshot_dir(source)
        weights_id = weights_identity(snapshot) if snapshot is not None else {"hub_id": source}
        if not weights_id:
            weights_id = {"folder": source}

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        family=str(getattr(config, "model_type", "") or type(config).__name__),
        fingerprint=compute_fingerprint(model, tokenizer, weights_id, torch_dtype, quant),
        device=dev,
        dtype=torch_dtype,
        quant=quant,
        attn=attn,
        source=source,
    )


def auto_quant(name: str, device: torch.device, dtype: str | torch.dtype | None, cache_dir: Path | None = None) -> str:
    """What ``--quant auto`` runs: "8bit" on the CPU for a GGUF whose decoder matrices are all Q4_1
    (the embedded SmolLM2's: RULER 72.2 against float32's 70.1, 4bit 69.4; docs/cpu.md) when the
    dtype is auto or bfloat16; "none" everywhere else (a model measured in no lower precision). The
    GGUF's matrix types are read once per file (memoised in ``cache_dir``)."""
    if device.type != "cpu" or requested_dtype(dtype) not in (None, torch.bfloat16):
        return "none"
    if name.lower() == EMBEDDED_MODEL:
        try:
            gguf = embedded_gguf_file()
        except ModelError:
            return "none"  # the load says what is missing
    elif name.lower().endswith(".gguf") and Path(name).expanduser().is_file():
        gguf = Path(name).expanduser()
    else:
        return "none"
    return "8bit" if gguf_linear_types(gguf, cache_dir) == {"Q4_1"} else "none"
