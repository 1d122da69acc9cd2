"""Retrieval-head profiles: which attention heads read the whole context (RazorAttention, §3.3).

Tang et al. 2024 ("RazorAttention: Efficient KV Cache Compression Through Retrieval Heads",
arXiv:2407.15891) identify the heads that must keep their full KV cache with a data-free probe:

1. draw K random tokens (the paper: K = 2500) and repeat them 4 times: ``x x x x`` — random tokens
   carry no semantics, so only copy/recall behaviour can explain where a head looks;
2. run the model once over those 4K tokens and, for every head and every token of repeats 2-4,
   read two attention weights (softmax of the head's own ``q·k`` row, causal):

   * the **echo score**: attention to the previous occurrences of the current token
     (positions i-K, i-2K, ...; an *echo head* looks back at the same token);
   * the **induction score**: attention to the token that followed those occurrences
     (positions i-K+1, i-2K+1, ...; an *induction head* looks at what came next last time);

   each averaged over the 3K query tokens;
3. protect the top 14% of query heads by induction score and the top 1% by echo score (knobs);
   with GQA a KV head is protected when any query head of its group is (§4.1.1, Llama3-8B).

The attention rows are computed here from the queries and keys handed to a layer observer
(:mod:`kvcli.runtime.attention`) in float32, 256 query rows at a time; no attention matrix of the model is
ever asked for (no ``output_attentions``).

The scores are a property of the model, not of a document, so they are computed once per model
and kept in ``<cache_dir>/heads/<fingerprint>-K<k>-s<seed>.safetensors`` (the two score tables
plus a JSON header; written to a temporary file and ``os.replace``d; no pickle). The protection
fractions are applied when the profile is used, so changing them needs no new profile.

ALiBi models would use the paper's closed form (Theorem 1, the per-head scope L_h) instead; kvcli
only runs RoPE decoders, and says so for an ALiBi model.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import notices
from ..errors import ModelError, UsageError

FORMAT_VERSION = 1
PAPER_TOKENS = 2500  # K of the paper
REPEATS = 4  # the K tokens are repeated 4 times
DEFAULT_SEED = 0
_META_KEY = "kvcli_heads"
_CHUNK_ROWS = 256


# --------------------------------------------------------------------------- parameters


def n_parameters(lm) -> int:
    return sum(p.numel() for p in lm.model.parameters())


def default_tokens(lm) -> int:
    """K for ``lm``: the paper's 2500, fewer for small models, and 4K must fit in the context.

    The probe costs O((4K)^2) per head; small models on a CPU get K = 512 (< 1B parameters) or
    1024 (< 4B). On SmolLM2-135M the protected set at K = 512 and K = 1024 is nearly the same
    (see the RazorAttention notes in the report), so the cheaper probe loses nothing.
    """
    params = n_parameters(lm)
    k = 512 if params < 1e9 else 1024 if params < 4e9 else PAPER_TOKENS
    limit = (lm.max_context - 1) // REPEATS if lm.max_context else k
    return max(2, min(k, limit))


def uses_alibi(lm) -> bool:
    cfg = lm.text_config
    return bool(
        getattr(cfg, "alibi", False)
        or getattr(cfg, "position_embedding_type", "") == "alibi"
        or getattr(cfg, "model_type", "") in ("bloom", "mpt", "baichuan")
    )


def check_rope_model(lm, who: str = "razor") -> None:
    if uses_alibi(lm):
        raise ModelError(
            f"{who}: {lm.name} uses ALiBi; RazorAttention handles ALiBi models with the paper's closed form "
            "(Theorem 1, per-head scope L_h), which kvcli does not implement — only RoPE models are profiled"
        )


def probe_ids(lm, tokens: int, seed: int) -> torch.Tensor:
    """The probe: ``tokens`` distinct random non-special token ids, repeated 4 times -> (4K,) int64.

    Distinct ids make "the previous occurrence" of a token unambiguous. Deterministic for a seed
    (a private CPU generator; the global RNG is left alone).
    """
    vocab = min(len(lm.tokenizer), lm.model.get_input_embeddings().num_embeddings)  # int8 tables too
    special = set(getattr(lm.tokenizer, "all_special_ids", []) or [])
    allowed = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    if tokens > allowed.numel():
        raise UsageError(f"heads: {tokens} distinct random tokens asked for, the vocabulary has {allowed.numel()}")
    gen = torch.Generator().manual_seed(int(seed))
    block = allowed[torch.randperm(allowed.numel(), generator=gen)[:tokens]]
    return block.repeat(REPEATS)


# --------------------------------------------------------------------------- scores


def echo_induction_scores(
    query: torch.Tensor, key: torch.Tensor, period: int, scaling: float, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Echo and induction scores of one layer for a sequence of period ``period`` (the probe).

    query: (1, n_heads, n, d) after RoPE; key: (1, n_kv_heads, n, d) (GQA: query head h reads KV
    head h // (n_heads / n_kv_heads)). Returns two (n_heads,) float32 tensors: the attention weight
    of rows i >= period on columns {i - j*period} (echo) and {i - j*period + 1} (induction),
    j >= 1, averaged over those rows.
    """
    _, n_heads, n, d = query.shape
    n_kv = key.shape[1]
    group = n_heads // n_kv
    q = query[0].to(torch.float32).reshape(n_kv, group, n, d)
    k = key[0].to(torch.float32)  # (n_kv, n, d)
    # accumulated on the query's device (float64 where the device has it; MPS has not)
    acc = torch.float32 if query.device.type == "mps" else torch.float64
    echo = torch.zeros(n_heads, dtype=acc, device=query.device)
    induction = torch.zeros(n_heads, dtype=acc, device=query.device)
    n_back = (n - 1) // period  # most previous occurrences any row has
    for start in range(period, n, _CHUNK_ROWS):
        stop = min(n, start + _CHUNK_ROWS)
        rows = torch.arange(start, stop, device=query.device)
        cols = torch.arange(stop, device=query.device)
        scores = torch.matmul(q[:, :, start:stop], k[:, None, :stop].transpose(-1, -2)) * scaling
        allowed = cols[None, :] <= rows[:, None]
        if sliding_window is not None:
            allowed &= cols[None, :] > rows[:, None] - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (n_kv, group, c, 1)
        back = rows[:, None] - period * torch.arange(1, n_back + 1, device=query.device)[None, :]  # (c, n_back)
        for offset, total in ((0, echo), (1, induction)):
            idx = back + offset
            valid = (back >= 0) & allowed.gather(1, idx.clamp(min=0))
            picked = scores.gather(
                -1, idx.clamp(min=0)[None, None].expand(n_kv, group, -1, -1)
            )  # (n_kv, group, c, n_back)
            weights = torch.exp(picked - lse).masked_fill(~valid, 0.0)
            total += weights.sum(dim=(-1, -2)).reshape(n_heads).to(acc)
    n_rows = n - period
    return (echo / n_rows).to(torch.float32), (induction / n_rows).to(torch.float32)


def profile_scores(engine, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the probe through ``engine``; returns (echo, induction), each (n_layers, n_heads) float32."""
    lm = engine.lm
    ids = probe_ids(lm, tokens, seed)
    echo = torch.zeros(engine.n_layers, lm.n_heads)
    induction = torch.zeros(engine.n_layers, lm.n_heads)

    def observer(layer: int):
        attn = engine.layers[layer].self_attn
        scaling = getattr(attn, "scaling", None) or 1.0 / math.sqrt(lm.head_dim)
        window = engine.windows.attention_window(layer)

        def observe(query: torch.Tensor, key: torch.Tensor) -> None:
            e, i = echo_induction_scores(query, key, tokens, scaling, window)
            echo[layer], induction[layer] = e.cpu(), i.cpu()

        return observe

    observers = {layer: [observer(layer)] for layer in range(engine.n_layers)}
    # the last layer's attention output and MLP are not needed: stop once it is scored
    last = engine.n_layers - 1

    def stop(query, key):
        from ..runtime.attention import StopForward

        raise StopForward

    observers[last].append(stop)
    engine.forward(ids, torch.arange(ids.numel()), None, observers=observers)
    return echo, induction


# --------------------------------------------------------------------------- the profile


def top_fraction(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Boolean mask (same shape) of the ceil(fraction * numel) highest ``scores`` (stable ties)."""
    flat = scores.flatten()
    count = min(flat.numel(), math.ceil(fraction * flat.numel() - 1e-9)) if fraction > 0 else 0
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    if count:
        order = torch.argsort(flat, descending=True, stable=True)
        mask[order[:count]] = True
    return mask.view(scores.shape)


@dataclass
class HeadProfile:
    """Echo and induction scores of every query head of one model (see the module docstring)."""

    fingerprint: str
    model_name: str
    n_kv_heads: int
    tokens: int  # K
    seed: int
    echo: torch.Tensor  # (n_layers, n_heads) float32
    induction: torch.Tensor  # (n_layers, n_heads) float32
    compute_s: float = 0.0
    path: Path | None = None  # where it is stored (None: not stored)
    loaded: bool = False  # True when read from disk rather than computed in this process

    @property
    def n_layers(self) -> int:
        return self.echo.shape[0]

    @property
    def n_heads(self) -> int:
        return self.echo.shape[1]

    def protected_query_heads(self, induction: float, echo: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(by_induction, by_echo): boolean (n_layers, n_heads) masks of the protected query heads."""
        return top_fraction(self.induction, induction), top_fraction(self.echo, echo)

    def protected_kv_heads(self, induction: float, echo: float, full_layers: list[int] | None = None) -> torch.Tensor:
        """Boolean (n_layers, n_kv_heads): a KV head is protected if any of its query heads is.

        ``full_layers``: on a hybrid model (Gemma 2 / 3), the layers that attend to the whole
        context: the retrieval heads are the top fractions of *their* heads (a sliding layer cannot
        retrieve past its window), and every head of a sliding layer is "protected": it keeps its
        KV under its own window mask, exactly as full attention does (never counted as compressed
        by RazorAttention)."""
        if full_layers is None or len(full_layers) == self.n_layers:
            by_ind, by_echo = self.protected_query_heads(induction, echo)
            q = by_ind | by_echo
            return q.view(self.n_layers, self.n_kv_heads, -1).any(dim=-1)
        rows = torch.tensor(full_layers, dtype=torch.long)
        q = torch.ones(self.n_layers, self.induction.shape[1], dtype=torch.bool)
        q[rows] = top_fraction(self.induction[rows], induction) | top_fraction(self.echo[rows], echo)
        return q.view(self.n_layers, self.n_kv_heads, -1).any(dim=-1)

    def identity(self) -> dict:
        """What the profile is, as JSON-able facts (for store keys)."""
        digest = hashlib.sha256(
            self.echo.contiguous().numpy().tobytes() + self.induction.contiguous().numpy().tobytes()
        ).hexdigest()[:16]
        return {"tokens": self.tokens, "seed": self.seed, "scores": digest}

    # --- disk ---------------------------------------------------------------------------------
    def header(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "model_name": self.model_name,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "tokens": self.tokens,
            "seed": self.seed,
            "compute_s": round(self.compute_s, 3),
            "paper": "Tang et al. 2024, RazorAttention, arXiv:2407.15891, §3.3",
        }

    def save(self, path: Path) -> None:
        """Write atomically (see :func:`kvcli.files.save_safetensors_atomic`)."""
        from ..files import save_safetensors_atomic

        path = Path(path)
        save_safetensors_atomic(
            path,
            {"echo": self.echo.contiguous(), "induction": self.induction.contiguous()},
            {_META_KEY: json.dumps(self.header(), sort_keys=True)},
        )
        self.path = path

    @classmethod
    def load(cls, path: Path, lm=None) -> HeadProfile:
        """Read a profile; ValueError if it is damaged or (with ``lm``) belongs to another model."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(_META_KEY, "null"))
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open is not iterable)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own errors for truncated files
            raise ValueError(f"unreadable head profile: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise ValueError("not a kvcli head profile of this version")
        if set(tensors) != {"echo", "induction"}:
            raise ValueError("unexpected tensors in the head profile")
        shape = (int(meta["n_layers"]), int(meta["n_heads"]))
        for name, t in tensors.items():
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not torch.isfinite(t).all():
                raise ValueError(f"head profile tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        if shape[1] % int(meta["n_kv_heads"]):
            raise ValueError("head profile: heads are not a multiple of the KV heads")
        if lm is not None and (
            meta["fingerprint"] != lm.fingerprint
            or shape != (lm.n_layers, lm.n_heads)
            or int(meta["n_kv_heads"]) != lm.n_kv_heads
        ):
            raise ValueError("head profile belongs to another model")
        return cls(
            fingerprint=meta["fingerprint"],
            model_name=meta.get("model_name", ""),
            n_kv_heads=int(meta["n_kv_heads"]),
            tokens=int(meta["tokens"]),
            seed=int(meta["seed"]),
            echo=tensors["echo"],
            induction=tensors["induction"],
            compute_s=float(meta.get("compute_s", 0.0)),
            path=Path(path),
            loaded=True,
        )


def profile_path(cache_dir: Path, fingerprint: str, tokens: int, seed: int) -> Path:
    return Path(cache_dir) / "heads" / f"{fingerprint}-K{tokens}-s{seed}.safetensors"


def compute_profile(engine, tokens: int | None = None, seed: int = DEFAULT_SEED) -> HeadProfile:
    """Profile the model of ``engine`` now (nothing read or written)."""
    lm = engine.lm
    check_rope_model(lm, "heads")
    tokens = default_tokens(lm) if tokens is None else int(tokens)
    if tokens < 2:
        raise UsageError(f"heads: the probe needs at least 2 random tokens, got {tokens}")
    if lm.max_context and REPEATS * tokens > lm.max_context:
        raise UsageError(
            f"heads: {REPEATS} x {tokens} probe tokens exceed the {lm.max_context:,}-token window of {lm.name}; "
            f"use at most {lm.max_context // REPEATS}"
        )
    t0 = time.perf_counter()
    echo, induction = profile_scores(engine, tokens, seed)
    return HeadProfile(
        fingerprint=lm.fingerprint,
        model_name=lm.name,
        n_kv_heads=lm.n_kv_heads,
        tokens=tokens,
        seed=int(seed),
        echo=echo.contiguous(),
        induction=induction.contiguous(),
        compute_s=time.perf_counter() - t0,
    )


def load_or_compute(
    engine,
    tokens: int | None = None,
    seed: int = DEFAULT_SEED,
    cache_dir: Path | str | None = None,
    recompute: bool = False,
) -> HeadProfile:
    """The profile of ``engine.lm`` for (K, seed): read from ``<cache_dir>/heads/`` when there,
    else computed and stored there. A damaged or foreign file is a warning and is recomputed; an
    unwritable cache directory is a warning (the profile is still returned)."""
    from ..files import cache_folder

    lm = engine.lm
    check_rope_model(lm, "heads")
    tokens = default_tokens(lm) if tokens is None else int(tokens)
    cache_dir = cache_folder(cache_dir)
    path = profile_path(cache_dir, lm.fingerprint, tokens, seed)
    if path.is_file() and not recompute:
        try:
            return HeadProfile.load(path, lm)
        except (ValueError, KeyError, TypeError, OSError) as e:
            notices.warn(f"head profile {path} is damaged ({e}); recomputing it")
    profile = compute_profile(engine, tokens, seed)
    try:
        profile.save(path)
    except OSError as e:
        notices.warn(
            f"cannot store the head profile in {path.parent} ({e.strerror or e}); it will be recomputed next time"
        )
    return profile


# --------------------------------------------------------------------------- terminal view


def summary(profile: HeadProfile, induction: float, echo: float) -> dict:
    by_ind, by_echo = profile.protected_query_heads(induction, echo)
    kv = profile.protected_kv_heads(induction, echo)
    q = by_ind | by_echo
    return {
        "n_query_heads": q.numel(),
        "n_protected_query_heads": int(q.sum()),
        "n_by_induction": int(by_ind.sum()),
        "n_by_echo": int(by_echo.sum()),
        "n_kv_heads": kv.numel(),
        "n_protected_kv_heads": int(kv.sum()),
        "protected_kv_fraction": float(kv.float().mean()),
    }


def to_json(profile: HeadProfile, induction: float, echo: float) -> dict:
    by_ind, by_echo = profile.protected_query_heads(induction, echo)
    kv = profile.protected_kv_heads(induction, echo)
    return {
        "model": profile.model_name,
        "fingerprint": profile.fingerprint,
        "n_layers": profile.n_layers,
        "n_heads": profile.n_heads,
        "n_kv_heads": profile.n_kv_heads,
        "tokens": profile.tokens,
        "seed": profile.seed,
        "induction_fraction": induction,
        "echo_fraction": echo,
        "path": None if profile.path is None else str(profile.path),
        "loaded": profile.loaded,
        "compute_s": round(profile.compute_s, 3),
        **summary(profile, induction, echo),
        "protected_by_induction": [[l, h] for l, h in torch.nonzero(by_ind).tolist()],
        "protected_by_echo": [[l, h] for l, h in torch.nonzero(by_echo).tolist()],
        "protected_kv_heads": [[l, g] for l, g in torch.nonzero(kv).tolist()],
        "induction": [[round(x, 5) for x in row] for row in profile.induction.tolist()],
        "echo": [[round(x, 5) for x in row] for row in profile.echo.tolist()],
    }
