"""``load_model``: any of the model sources, on the chosen device, dtype, kernel and quantisation,
checked to be a decoder kvcli can run layer by layer, with its fingerprint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, UsageError, one_line
from ..files import cache_folder
from ..runtime.measure import keep_freed_memory, malloc_trim
from . import kept
from .catalog import EmbeddedModel, embedded, ensure_chunked_converted
from .cpu_quant import quantize_model, use_int8_rows
from .device import (
    check_attn,
    check_cpu_quant,
    quant_config,
    requested_dtype,
    require_bitsandbytes,
    resolve_device,
    resolve_dtype,
)
from .embedded import EMBEDDED_MODEL, ensure_converted
from .facts import ATTNS, QUANTS, LoadedModel, spelled
from .fingerprint import compute_fingerprint, weights_identity
from .ggufs import ensure_gguf_converted, gguf_linear_types
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
    once into ``cache_dir``, see :func:`embedded_model_path`; the commands' default is
    :func:`kvcli.model.catalog.default_model`, the best installed); another embedded model's name
    (:data:`kvcli.model.catalog.CATALOG`); a GGUF file; an existing local folder; or a Hugging
    Face hub id (loaded from the local HF cache, else downloaded).

    ``device``: see :func:`resolve_device`. ``quant``: "none"; "4bit" / "8bit": on the CPU
    PyTorch's int4 / int8 CPU kernels with bfloat16 activations (:mod:`.cpu_quant`), on CUDA
    bitsandbytes (nf4 / int8); "auto" (the default): :func:`auto_quant`. 8-bit weights of a
    conversion in the cache are kept beside it once quantised (:mod:`.kept`).
    ``attn``: "sdpa", "eager", or "flash" (CUDA + flash-attn only).
    ``dtype``: "auto" (float32 on CPU, bfloat16 with --quant there; bfloat16 on CUDA when
    supported, else float16), "float32", "bfloat16" or "float16".

    Every failure a user can cause raises :class:`ModelError` (or :class:`UsageError` for a bad
    option value) with a one-line message.
    """
    keep_freed_memory()  # for the rest of the process: a prefill's buffers reused, not faulted in again
    name = EMBEDDED_MODEL if spec is None or spec.strip() == "" else spec.strip()
    cache = Path(cache_dir) if cache_dir is not None else None
    what = Asked.of(name)
    opts = resolve_options(what, device, quant, attn, dtype, cache)
    src = where_from(what, cache)
    keep = src.converted and opts.cpu_quant  # the quantised weights kept beside the conversion

    config, model, tokenizer, quantized = read_model(src, opts, trust_remote_code, keep)

    check_structure(model, src.name, config)
    if opts.cpu_quant and not quantized:
        quantize_model(model, opts.cpu_bits, opts.dtype)
        malloc_trim()  # the float32 weights it was made from, freed in pieces glibc would keep (~250 MB)
        if keep:
            kept.save(model, Path(src.source), opts.dtype, opts.cpu_bits)
    rows_kernel = use_int8_rows(model, cache) if opts.cpu_quant else None  # (mode, instructions)
    rounds = rows_kernel[1] if rows_kernel and rows_kernel[0] == "8bit" else None  # 8-bit activations' logits
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    weights_id = src.weights_id
    if weights_id is None:
        snapshot = Path(src.source) if not src.hub else hub_snapshot_dir(src.source)
        weights_id = weights_identity(snapshot) if snapshot is not None else {"hub_id": src.source}
        if not weights_id:
            weights_id = {"folder": src.source}

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=src.name,
        family=str(getattr(config, "model_type", "") or type(config).__name__),
        fingerprint=compute_fingerprint(model, tokenizer, weights_id, opts.dtype, opts.quant, rounds),
        device=opts.device,
        dtype=opts.dtype,
        quant=opts.quant,
        attn=attn,
        int8_kernel=f"{rows_kernel[0]}, {rows_kernel[1]}" if rows_kernel else None,
        source=src.source,
        cpu_prefill_chunk=what.known.cpu_prefill_chunk if what.known is not None else None,
        check_threshold=what.known.check_threshold if what.known is not None else None,
        check_asked=what.known.check_asked if what.known is not None else None,
    )


@dataclass(frozen=True)
class Options:
    """The options of a load, checked and resolved (:func:`resolve_options`)."""

    device: torch.device
    quant: str  # none, 4bit or 8bit (auto resolved)
    cpu_quant: bool  # whether it runs on the CPU's int4 / int8 kernels
    dtype: torch.dtype
    attn_impl: str  # the attention kernel transformers is asked for

    @property
    def cpu_bits(self) -> int:
        """The bits of the CPU's quantised weights (:func:`.cpu_quant.quantize_model`): 4 or 8."""
        return 4 if self.quant == "4bit" else 8


@dataclass(frozen=True)
class Source:
    """Where a model's files are (:func:`where_from`)."""

    name: str  # the model's name
    source: str  # what transformers loads: a folder, or a hub id
    hub: bool  # ``source`` is a hub id
    weights_id: Any  # what identifies its weights (None: computed from the folder once loaded)
    converted: bool  # a conversion in the kvcli cache


def read_model(src: Source, opts: Options, trust_remote_code: bool, keep: bool) -> tuple[Any, Any, Any, bool]:
    """(config, model, tokenizer, whether the weights came quantised: kept 8-bit weights) read by
    transformers; every failure a one-line :class:`ModelError`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, dev, torch_dtype = src.name, opts.device, opts.dtype

    def call(fn, what: str, **kw):
        if src.hub:
            return hub_load(fn, src.source, what, **kw)
        return fn(src.source, **kw)

    try:
        with quiet_load():
            config = checked_config(
                call(AutoConfig.from_pretrained, "the config", trust_remote_code=trust_remote_code),
                name,
                trust_remote_code,
            )
            kwargs = weights_options(config, opts, trust_remote_code)
            attn = kwargs["attn_implementation"]
            model = kept.load(Path(src.source), config, torch_dtype, attn, opts.cpu_bits) if keep else None
            quantized = model is not None
            if model is None:
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
    return config, model, tokenizer, quantized


@dataclass(frozen=True)
class Asked:
    """What ``-m name`` names, looked at once: an embedded model (``known``), a GGUF file
    (``gguf``), or neither (a folder or a hub id)."""

    name: str
    known: EmbeddedModel | None
    gguf: Path | None
    local: Path  # the name read as a path (``~`` expanded), whether or not anything is there

    @classmethod
    def of(cls, name: str) -> Asked:
        known, local = embedded(name), Path(name).expanduser()
        is_gguf = known is None and local.suffix.lower() == ".gguf" and local.is_file()
        return cls(name, known, local if is_gguf else None, local)


def resolve_options(
    what: Asked, device: str, quant: str, attn: str, dtype: str | torch.dtype, cache: Path | None
) -> Options:
    """The options asked, checked, ``auto`` resolved (:func:`auto_quant`)."""
    quant = (quant or "auto").strip().lower()
    if quant not in QUANTS:
        raise UsageError(
            f"quant must be auto, none, 4bit or 8bit (load_model's names of --quant 4 and 8), not '{quant}'"
        )
    attn = (attn or "sdpa").strip().lower()
    if attn not in ATTNS:
        raise UsageError(f"--attn must be sdpa, eager or flash, not '{attn}'")
    dev = resolve_device(device)
    if quant == "auto":
        quant = auto_quant(what, dev, dtype, cache)
    cpu_quant = quant != "none" and dev.type == "cpu"
    torch_dtype = check_cpu_quant(quant, dtype) if cpu_quant else resolve_dtype(dtype, dev)
    attn_impl = check_attn(attn, dev, torch_dtype)
    if quant != "none" and not cpu_quant:
        if dev.type != "cuda":
            raise ModelError(f"--quant {spelled(quant)} works on cpu and cuda only, not on {dev.type}")
        require_bitsandbytes(quant)
    return Options(dev, quant, cpu_quant, torch_dtype, attn_impl)


def checked_config(config: Any, name: str, trust_remote_code: bool) -> Any:
    """``config``, if it is of a causal LM transformers runs; else a one-line ModelError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    auto_map = getattr(config, "auto_map", None) or {}
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (
        trust_remote_code and "AutoModelForCausalLM" in auto_map
    ):
        hint = " (it has custom code: add --trust-remote-code)" if "AutoModelForCausalLM" in auto_map else ""
        raise ModelError(
            f"cannot load model '{name}': model type '{config.model_type}' is not a "
            f"causal language model that transformers can run{hint}"
        )
    return config


def weights_options(config: Any, opts: Options, trust: bool) -> dict[str, Any]:
    """The keywords of ``from_pretrained`` for these choices."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    dev, quant, cpu_quant, torch_dtype, attn_impl = opts.device, opts.quant, opts.cpu_quant, opts.dtype, opts.attn_impl

    kwargs: dict[str, Any] = {
        "config": config,
        # 4/8-bit on the CPU: quantised from the float32 weights (the GGUF's exact values)
        "dtype": torch.float32 if cpu_quant else torch_dtype,
        "attn_implementation": attn_impl,
        "trust_remote_code": trust,
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
    return kwargs


def where_from(what: Asked, cache: Path | None) -> Source:
    """Where ``-m name``'s files are; embedded models and GGUFs converted first."""
    name, known, local = what.name, what.known, what.local
    if known is not None or what.gguf is not None:
        if known is not None:
            name = known.name
            folder, gguf_sha = ensure_chunked_converted(known, cache) if known.parts else ensure_converted(cache)
        else:  # a GGUF of a supported family (llama.cpp's, ollama's): converted once, keyed by its sha256
            folder, gguf_sha = ensure_gguf_converted(what.gguf, cache)
        in_cache = folder.parent == cache_folder(cache) / "models"
        return Source(name, str(folder), False, {"gguf_sha256": gguf_sha}, in_cache)
    if local.exists():
        check_local_folder(name, local)
        return Source(name, str(local.resolve()), False, None, False)
    if local.suffix.lower() == ".gguf":
        raise ModelError(f"cannot load model '{name}': no such file")
    if looks_like_path(name):
        raise ModelError(f"cannot load model '{name}': no such directory")
    return Source(name, name, True, None, False)


# GGUF block types of 4 to 6 bits: int8 per row over their dequantised values adds an error well
# below theirs (the GGUF's own rounding), so --quant auto runs such a file in 8-bit on the CPU
LOW_BIT_BLOCKS = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"})


def auto_quant(
    what: Asked, device: torch.device, dtype: str | torch.dtype | None, cache_dir: Path | None = None
) -> str:
    """What ``--quant auto`` runs: "none" off the CPU, or for a dtype other than auto or bfloat16;
    on the CPU, an embedded model's measured choice (:attr:`EmbeddedModel.auto_quant`: 8bit for
    SmolLM2, RULER 72.2 against float32's 70.1, docs/cpu.md; 8bit for the Qwen2.5-Coder models,
    docs/bench/qwen), and "8bit" for a user's GGUF whose decoder matrices are all
    :data:`LOW_BIT_BLOCKS` (read once per file, memoised in ``cache_dir``); "none" for the rest."""
    if device.type != "cpu" or requested_dtype(dtype) not in (None, torch.bfloat16):
        return "none"
    if what.known is not None:
        return what.known.auto_quant if what.known.installed() else "none"  # the load says what is missing
    if what.gguf is not None:
        types = gguf_linear_types(what.gguf, cache_dir)
        return "8bit" if types and types <= LOW_BIT_BLOCKS else "none"
    return "none"
