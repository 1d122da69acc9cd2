"""The attention kernels, by name: PyTorch SDPA (default), eager (a materialised softmax, for
checking) and flash-attn (CUDA only). The attention function (:mod:`kvcli.runtime.attention`) and the
cache layouts that attend themselves (:class:`kvcli.runtime.attention.LayerView`) run them through
:func:`attend`.

Shapes: query (1, n_heads, q_len, head_dim); key, value (1, n_kv_heads, kv_len, head_dim), GQA
never expanded in the cache (SDPA's ``enable_gqa``; eager repeats KV heads for its own matmul
only); returns (1, q_len, n_heads, head_dim). The new queries are always the last ``q_len``
entries of the key sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import accelerator, native
from .buffers import finite_room, widened


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Boolean (q_len, kv_len) mask, True where attending is allowed; None when plain causal SDPA fits.

    Query i sits at key index ``kv_len - q_len + i``; it sees every key up to and including itself,
    and with a sliding window only the last ``sliding_window`` of them.
    """
    if (sliding_window is None or sliding_window >= kv_len) and (q_len == 1 or q_len == kv_len):
        return None  # q_len == 1 sees everything; square means the standard causal triangle
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(kv_len, device=device)[None, :]
    allowed = cols <= rows
    if sliding_window is not None:
        allowed &= cols > rows - sliding_window
    return allowed


KEY_CHUNK = 8192  # keys upcast to float32 at a time by the scorers, where they are not float32 already


def by_keys(keys: torch.Tensor, fn):
    """``fn(keys in float32)`` -> (..., n_keys) scores, for the scorers: float32 keys (the CPU) in
    one call, as always; keys of another dtype (bfloat16 / float16 on a GPU) upcast and scored
    :data:`KEY_CHUNK` at a time (``keys``: (..., n_keys, d)), so no float32 copy of a whole layer
    is made. ``fn`` must score each key independently of the others (a q·k, a norm)."""
    n = keys.shape[-2]
    if keys.dtype == torch.float32 or n <= KEY_CHUNK:
        return fn(keys.to(torch.float32))
    out = None
    for a in range(0, n, KEY_CHUNK):
        part = fn(keys[..., a : a + KEY_CHUNK, :].to(torch.float32))
        if out is None:
            out = part.new_empty(*part.shape[:-1], n)
        out[..., a : a + part.shape[-1]] = part
    return out


def causal_lower_right(q_len: int, kv_len: int):
    """PyTorch's lower-right ``CausalBias``, imported when first made: its module imports
    ``torch._dynamo`` (~2 s of every kvcli process's start on a CPU, which never makes one)."""
    from torch.nn.attention.bias import causal_lower_right as make

    return make(q_len, kv_len)


def causal(q_len: int, kv_len: int, sliding_window: int | None, device):
    """What :func:`sdpa` is handed for causal attention of the last ``q_len`` of ``kv_len`` keys:
    None (plain causal SDPA fits), the boolean :func:`causal_mask` on the CPU or with a window, or
    else — a query block on top of a longer KV (a question on a stored prefix, a prefill chunk) —
    PyTorch's lower-right :class:`CausalBias` (``causal_lower_right``), no dense mask: CUDA runs it
    with its flash kernel (bottom-right causal, GQA as it is) where the dtype allows, instead of
    the math backend (float32 scores, K/V repeated to every query head). On the CPU the boolean
    mask stays: the CPU's fused kernel takes it, and a CausalBias would only materialise it."""
    plain = sliding_window is None or sliding_window >= kv_len
    if plain and 1 < q_len < kv_len and accelerator.on_accelerator(device):
        return causal_lower_right(q_len, kv_len)
    return causal_mask(q_len, kv_len, sliding_window, device)


# Query rows up to which a 16-bit attention on the CPU runs :func:`grouped` instead of PyTorch's
# fused kernel: that kernel runs a bfloat16 decoding step 4-8x slower than float32 (measured, torch
# 2.13, 1k-8k keys), the two batched matmuls of grouped 2x faster than float32 (half the bytes)
GROUPED_ROWS = 16


KEY_BUCKET = 64  # a decoding step's key count rounded up to this, where the cache's buffer has the room


def _bucketed(key, value, mask, q_len: int):
    """``key``/``value`` widened to the next multiple of :data:`KEY_BUCKET` rows where a cache's
    buffer holds finite rows there (:func:`kvcli.runtime.buffers.finite_room`), for one query row
    without a mask; else as they are. oneDNN makes (JIT-compiles) and caches one primitive per
    matrix shape: a key count that grows by one every step made two new ones per step, ~0.6 MB each,
    kept in its cache of 1,024 (measured: +380 MB of resident memory over 300 steps of 30 layers,
    and the compilation's time in every step). Rounded up, the shapes change every 64 steps."""
    kv_len = key.shape[2]
    padded = -(-kv_len // KEY_BUCKET) * KEY_BUCKET
    if (
        q_len != 1
        or mask is not None
        or key.shape[0] != 1
        or padded == kv_len
        or not (finite_room(key, padded) and finite_room(value, padded))
    ):
        return key, value
    return widened(key, padded), widened(value, padded)


def grouped(query, key, value, mask, scaling):
    """Attention as two batched matmuls per KV head over the query heads of its GQA group (the KV
    never repeated): q·kᵀ in the KV's dtype (float32 accumulation, the product rounded to it), the
    softmax in float32, its weights back to the KV's dtype times v; where this CPU emulates the KV's
    dtype (:func:`kvcli.runtime.native.native_gemm`: AVX2 with bfloat16) both products in float32
    on the KV made float32 for the call, the output in the KV's dtype. ``mask``: None (causal, the
    queries the last keys), boolean (q_len, kv_len) or per head (1 or n_heads, q_len, kv_len).
    One query row per head without a mask over a bfloat16 KV (with AMX any KV's dtype):
    :func:`group_rows` (:func:`kvcli.runtime.native.fused_decoding`)."""
    b, n_heads, q_len, d = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    if q_len == 1 and mask is None and b == 1 and native.fused_decoding(key.dtype):
        return group_rows(query, key, value, scaling)
    # the products' dtype: the KV's where the CPU multiplies it natively, else float32 (the KV made
    # float32 for the step: 11x faster than oneDNN's emulated bfloat16 at 4.7k keys, native.py)
    work = key.dtype if native.native_gemm(key.dtype) else torch.float32
    key, value = _bucketed(key, value, mask, q_len)  # rows past kv_len: weighed by zero below
    group = n_heads // n_kv
    q = (query * scaling).to(work).reshape(b, n_kv, group * q_len, d)
    if b == 1 and not key.is_contiguous():
        # a cache's view of the first entries of a buffer with room (caches.base.append_rows): the
        # batched matmul would copy the whole layer's keys first (3.5x slower at 8k, measured); one
        # matrix product per KV head reads them in place
        scores = q.new_empty(1, n_kv, group * q_len, key.shape[2])
        for h in range(n_kv):
            torch.mm(q[0, h], key[0, h].to(work).transpose(0, 1), out=scores[0, h])
    else:
        scores = torch.matmul(q, key.to(work).transpose(-1, -2))
    scores = scores.to(torch.float32)
    if key.shape[2] > kv_len:
        scores[..., kv_len:] = float("-inf")
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, kv_len, None, query.device)
    if mask is not None:
        allowed = mask.expand(b, n_heads, q_len, kv_len)  # (q_len, kv_len) or per head
        scores = scores.masked_fill(~allowed.reshape(b, n_kv, group * q_len, kv_len), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(work)
    out = torch.matmul(weights, value.to(work)).to(value.dtype)  # (b, n_kv, group * q_len, dv)
    return out.reshape(b, n_heads, q_len, -1).transpose(1, 2).contiguous()


def group_rows(query, key, value, scaling, mask=None):
    """One decoding query per head, attending all keys (1, n_heads, 1, d): the query heads of each
    KV head as the rows of one PyTorch attention call (its fused CPU kernel: no score matrix, no
    ``enable_gqa``, the KV read in place however the cache strides it). On a CPU with AMX
    (:func:`kvcli.runtime.native.amx`) 2-2.4x faster than :func:`grouped`'s matrix products (a
    Xeon with AMX, 2 threads, 4,700 bfloat16 keys a layer: 20.9 against 50.1 ms over the 1.5B
    Qwen's 28 layers, 10.6 against 21.1 over the 0.5B's 24; docs/cpu.md); on an AVX2-only CPU,
    where :func:`grouped` makes the bfloat16 KV float32 for its products, 2.9-3.1x faster (an AMD
    EPYC, 2 threads, the 1.5B's shape: 30-31 against 87-97 ms); on a Xeon with AVX512-BF16 and no
    AMX 1.8x (22.1 against 40.0 ms; 3.2x at 1,024 keys). ``mask``: (kv_len,) bool, the keys
    attended (:func:`padded`'s), None: all."""
    b, n_heads, _, d = query.shape
    n_kv = key.shape[1]
    q = query.reshape(b, n_kv, n_heads // n_kv, d)
    bias = None if mask is None else mask.view(1, 1, 1, -1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scaling)
    return out.reshape(b, n_heads, 1, -1).transpose(1, 2).contiguous()


def sdpa(query, key, value, mask, scaling):
    q_len = query.shape[2]
    if q_len <= GROUPED_ROWS and query.device.type == "cpu" and key.dtype in (torch.bfloat16, torch.float16):
        return grouped(query, key, value, mask, scaling)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=mask is None and q_len > 1,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def padded(kernel: str, query, key, value, allowed, scaling):
    """One decoding step's attention over buffers of a fixed size, ``allowed`` (kv_len,) bool: the
    rows it attends (the entries so far; the rest weighed by zero). What a step captured as a CUDA
    graph (:mod:`kvcli.runtime.graphs`) runs: its shapes never change. The query heads of a GQA
    group are one KV head's query rows (the KV never repeated, no ``enable_gqa``, which PyTorch's
    masked CUDA kernel does not take); eager (a materialised softmax) and a 16-bit KV on the CPU
    (:func:`grouped`) as :func:`attend` runs them. query (1, n_heads, 1, d); key, value (1, n_kv,
    kv_len, d); returns (1, 1, n_heads, d)."""
    mask = allowed.view(1, -1)
    if kernel == "eager":
        return eager(query, key, value, mask, scaling)
    if query.device.type == "cpu" and key.dtype in (torch.bfloat16, torch.float16):
        return grouped(query, key, value, mask, scaling)
    return group_rows(query, key, value, scaling, allowed)


def eager(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, kv_len, None, query.device)
        if mask is None:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        weights = weights.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


SOFTCAP_ROWS = 1024  # query rows whose soft-capped scores are materialised at once (Gemma 2)


def softcapped(query, key, value, mask, scaling, softcap: float):
    """Attention with soft-capped scores, ``softcap · tanh(q·k · scaling / softcap)`` before the
    softmax (Gemma 2's ``attn_logit_softcapping``), which no fused kernel computes: the scores of
    :data:`SOFTCAP_ROWS` query rows at a time, GQA as it is (query heads grouped over their KV head,
    the KV never repeated). ``mask``: boolean (q_len, kv_len) or per head (1 or 1, n_heads, q_len,
    kv_len), True where allowed; None: causal
    (the last q_len keys are the queries)."""
    b, n_heads, q_len, d = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    if mask is None:
        mask = causal_mask(q_len, kv_len, None, query.device)
        if mask is None and q_len > 1:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if mask is not None and mask.dim() == 4:  # per head (1 or n_heads, q_len, kv_len): grouped as the queries
        mask = mask.expand(b, n_heads, q_len, kv_len).reshape(b, n_kv, group, q_len, kv_len)
    q = query.reshape(b, n_kv, group, q_len, d)
    out = query.new_empty(b, n_kv, group, q_len, value.shape[-1])
    for a in range(0, q_len, SOFTCAP_ROWS):
        e = min(q_len, a + SOFTCAP_ROWS)
        s = (
            torch.matmul(q[:, :, :, a:e].to(torch.float32), key.to(torch.float32).unsqueeze(2).transpose(-1, -2))
            * scaling
        )
        s = torch.tanh(s / softcap) * softcap
        if mask is not None:
            s = s.masked_fill(~(mask[..., a:e, :]), float("-inf"))
        w = torch.softmax(s, dim=-1)
        out[:, :, :, a:e] = torch.matmul(w, value.to(torch.float32).unsqueeze(2)).to(out.dtype)
    return out.reshape(b, n_heads, q_len, -1).transpose(1, 2).contiguous()


def flash(module, query, key, value, scaling, sliding_window):
    """flash-attn's own ``flash_attn_func``, called directly (transformers' ``flash_attention_forward``
    looks the implementation up by the config's name, which is ``"kvcli"``). Its causal mode is
    aligned to the bottom right (query i sits at key ``kv_len - q_len + i``), as kvcli's queries
    are, and it takes GQA as it is (fewer KV heads than query heads), so no mask is ever built.
    Layout: (batch, seq, heads, head_dim) in, the same out — what the attention function returns."""
    from flash_attn import flash_attn_func

    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=scaling,
        causal=True,
        window_size=window,
    )


KERNELS = {"sdpa": sdpa, "eager": eager, "flash": flash}


def window_block(sliding_window: int) -> int:
    """Query rows a sliding-window layer attends at a time in a long pass (:func:`_by_query_blocks`)."""
    return max(1024, sliding_window)


def _by_query_blocks(kernel: str, module, query, key, value, scaling: float, sliding_window: int) -> torch.Tensor:
    """A sliding-window layer's attention over many queries, :func:`window_block` query rows at a
    time, each block against the keys its window reaches: the block's keys and the ``w - 1``
    before them. One mask of all queries × all keys would be q_len × kv_len (a 32k-token prompt:
    1 GiB of booleans, and the kernel's float copy of it), nearly all of it False, and its product
    computed for nothing; per block it is block × (block + w - 1). The same softmax over the same
    keys for every query."""
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len  # query i is key offset + i
    block = window_block(sliding_window)
    out = query.new_empty(query.shape[0], q_len, query.shape[1], value.shape[-1])
    for a in range(0, q_len, block):
        e = min(q_len, a + block)
        first = max(0, offset + a - sliding_window + 1)  # the earliest key the block's first query sees
        out[:, a:e] = attend(
            kernel,
            module,
            query[:, :, a:e],
            key[:, :, first : offset + e],
            value[:, :, first : offset + e],
            scaling,
            sliding_window,
        )
    return out


def attend(
    kernel: str,
    module,
    query,
    key,
    value,
    scaling: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (sliding-window) attention with ``kernel``; ``mask``: an explicit boolean mask,
    True where allowed (broadcast over heads), which flash-attn cannot take: SDPA runs it then.
    A layer with soft-capped scores (``module.kvcli_softcap``, set by :func:`kvcli.runtime.attention.install`
    for Gemma 2) runs :func:`softcapped` whatever the kernel."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if (
        mask is None
        and sliding_window is not None
        and kernel != "flash"
        and sliding_window < kv_len
        and (q_len > 2 * window_block(sliding_window) or (q_len > 1 and kv_len - q_len > sliding_window))
    ):
        # a long pass; or a few queries (a prefill chunk, a question) on a prefix longer than the
        # window: only the keys the window reaches, not a q_len x kv_len mask over all of them
        # (measured: Gemma 3 270M, 17k tokens in chunks of 2,048 on one thread: TTFT 155 -> 62 s)
        return _by_query_blocks(kernel, module, query, key, value, scaling, sliding_window)
    softcap = getattr(module, "kvcli_softcap", None)
    if softcap is not None:
        if mask is None:
            mask = causal_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return softcapped(query, key, value, mask, scaling, softcap)
    if mask is None:
        if kernel == "flash":
            return flash(module, query, key, value, scaling, sliding_window)
        if kernel == "eager":
            return eager(
                query, key, value, causal_mask(query.shape[2], key.shape[2], sliding_window, query.device), scaling
            )
        mask = causal(query.shape[2], key.shape[2], sliding_window, query.device)
    return (eager if kernel == "eager" else sdpa)(query, key, value, mask, scaling)


# --- attention over disjoint key sets, merged into one softmax (InfLLM's book: Local + Memory)
try:  # PyTorch's fused CPU attention, which also returns each row's log-sum-exp
    _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
except (AttributeError, RuntimeError):  # pragma: no cover - older PyTorch
    _FLASH_CPU = None


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scaling: float, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` (1, n_kv, rows, d) over ``k``, ``v`` (1, n_kv, keys, d), with an
    additive ``bias`` (rows, keys) or None: (output (1, n_kv, rows, d), log-sum-exp of each row's
    scaled scores (1, n_kv, rows) float32), so that attentions over disjoint key sets merge into
    one softmax (:func:`merge_lse`). On the CPU PyTorch's fused kernel (no score matrix held);
    elsewhere, or ``fused=False``, the scores of the rows (bounded by a pass) written out."""
    if fused and _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, attn_mask=bias, scale=scaling)
        return out, lse.to(torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(torch.float32) * scaling
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def merge_lse(*parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One softmax over the union of the parts' keys, from each part's (output, log-sum-exp)."""
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    return sum(out * torch.exp(lse - total)[..., None].to(out.dtype) for out, lse in parts)
