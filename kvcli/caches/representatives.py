"""A block of keys and what stands for it: the partition of a prompt into Initial, whole blocks
and Local, each block's representative keys (Quest's element-wise bounds, InfLLM's best-scored
tokens, ...) and a query's score of each block by them.

Shared by the two layouts that retrieve blocks: the block cache of block-sparse attention
(:mod:`kvcli.caches.blocks`) and InfLLM's stored book (:mod:`kvcli.caches.book`); their methods
(:mod:`kvcli.compressors.blocksparse`, :mod:`kvcli.compressors.infllm`) pick the kinds.
"""

from __future__ import annotations

import torch

REPRESENTATIVES = ("max", "mean", "quest", "dynamic", "infllm", "fixed")
SCORED = ("dynamic", "infllm")  # representatives picked by a per-token score
HEAD_SELECT = ("shared", "separate")


# --------------------------------------------------------------------------- partition


def partition(n: int, initial: int, local: int, block_size: int) -> tuple[int, int, int]:
    """(initial, n_blocks, ctx_end) of a prompt of ``n`` tokens: Initial is ``[0, initial)``, the
    Context ``[initial, ctx_end)`` is ``n_blocks`` whole blocks, Local is the rest (at least
    ``local`` tokens: what the blocks leave over joins it)."""
    initial = min(max(int(initial), 0), n)
    local = min(max(int(local), 0), n - initial)
    n_blocks = (n - initial - local) // int(block_size)
    return initial, n_blocks, initial + n_blocks * int(block_size)


# --------------------------------------------------------------------------- representatives


def quest_upper_bound(query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """Quest's criticality bound (Tang et al. 2024, Algorithm 1): per block,
    ``sum_c max(q_c * kmax_c, q_c * kmin_c)`` — for every channel the larger product, which is
    ``q_c * kmax_c`` when ``q_c >= 0`` and ``q_c * kmin_c`` otherwise, so it is at least ``q · k``
    for every key k of the block.

    query (..., d), kmax/kmin (..., n_blocks, d) broadcastable -> (..., n_blocks).
    Computed as two products, ``q⁺ · kmax + q⁻ · kmin``, never materialising (blocks x d) terms.
    """
    q = query.to(torch.float32)
    pos, neg = q.clamp(min=0), q.clamp(max=0)
    return (kmax.to(torch.float32) @ pos.unsqueeze(-1)).squeeze(-1) + (
        kmin.to(torch.float32) @ neg.unsqueeze(-1)
    ).squeeze(-1)


def block_representatives(blocks: torch.Tensor, kind: str, num: int, votes: torch.Tensor | None = None) -> torch.Tensor:
    """Representative keys of each block.

    blocks: (n_kv, n_blocks, block_size, d) keys of the Context; votes: (n_kv, n_blocks, block_size)
    the per-token score (``dynamic``: attention accumulated from the last prompt queries;
    ``infllm``: InfLLM's representative score, :func:`infllm_accumulate`). Returns
    (n_kv, n_blocks, R, d) float32:

    * ``max`` / ``mean``: the block cut into ``num`` contiguous pieces, each the element-wise
      max / mean of its keys (``num`` = 1: one vector per block, the article's definition);
    * ``quest``: [element-wise max, element-wise min] (R = 2);
    * ``dynamic`` / ``infllm``: the ``num`` keys with the highest score, in token order;
    * ``fixed``: ``num`` keys at fixed intervals (offsets ``i * block_size // num``).
    """
    b = blocks.to(torch.float32)
    size = b.shape[2]
    if kind == "quest":
        return torch.stack([b.amax(dim=2), b.amin(dim=2)], dim=2)
    if kind in ("max", "mean"):
        pieces = torch.tensor_split(b, num, dim=2)
        return torch.stack([p.amax(dim=2) if kind == "max" else p.mean(dim=2) for p in pieces], dim=2)
    if kind == "fixed":
        offsets = (torch.arange(num) * size) // num
        return b[:, :, offsets.to(b.device)]
    if kind in SCORED:
        if votes is None:
            raise ValueError(f"{kind} representatives need a score per token")
        top = torch.topk(votes.to(b.device), num, dim=-1).indices  # (n_kv, n_blocks, num)
        top = torch.sort(top, dim=-1).values
        return b.gather(2, top[..., None].expand(-1, -1, -1, b.shape[-1]))
    raise ValueError(f"unknown representative {kind!r}")


def infllm_accumulate(
    total: torch.Tensor, query: torch.Tensor, key: torch.Tensor, local: int, row_lo: int, row_hi: int, chunk: int = 256
) -> None:
    """Add the terms of InfLLM's representative score (Xiao et al. 2024, arXiv:2402.04617, §3.2,
    equation 1: ``r_m = 1/l_L sum_{j=1..l_L} q_{m+j} · k_m``) contributed by the query rows of one
    prefill pass to ``total`` (n_kv, >= kv_len) float32, in place: each query row g adds
    ``q_g · k_m`` to the ``local`` tokens m = g - local .. g - 1 before it, averaged over the query
    heads of each KV head's GQA group. Only rows ``row_lo <= g < row_hi`` count (kvcli lets the
    question-agnostic prefix vote, never the question). The division by the number of successors
    is :func:`infllm_scores`'.

    query (1, n_heads, q_len, d): its rows are the last q_len of key (1, n_kv, kv_len, d), after
    RoPE. Computed ``chunk`` rows at a time against only the keys they reach (chunk x (chunk +
    local) products per head): no attention matrix, the cache is never GQA-expanded.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    first = kv_len - q_len  # key index of query row 0
    lo, hi = max(row_lo, first, 1), min(row_hi, kv_len)
    n_heads, d = query.shape[1], query.shape[3]
    n_kv = key.shape[1]
    group = n_heads // n_kv
    for g0 in range(lo, hi, chunk):
        g1 = min(hi, g0 + chunk)
        k0 = max(0, g0 - local)
        k = key[0, :, k0 : g1 - 1].to(torch.float32)  # the keys rows g0..g1-1 reach: k0 .. g1-2
        q = query[0, :, g0 - first : g1 - first].to(torch.float32).reshape(n_kv, group, g1 - g0, d)
        dots = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2))  # (n_kv, group, rows, keys)
        rows = torch.arange(g0, g1, device=key.device)[:, None]
        cols = torch.arange(k0, g1 - 1, device=key.device)[None, :]
        band = (cols < rows) & (cols >= rows - local)
        part = dots.masked_fill(~band, 0.0).sum(dim=2).mean(dim=1)  # (n_kv, keys)
        total[:, k0 : g1 - 1] += part.to(total.device)


def infllm_scores(total: torch.Tensor, local: int, rows: int) -> torch.Tensor:
    """InfLLM's representative score from the sums of :func:`infllm_accumulate` over the query rows
    ``0 <= g < rows``: token m had ``min(local, rows - 1 - m)`` successors voting, and its score is
    their mean (equation 1; fewer than ``local`` only for the last tokens before ``rows``). Tokens
    no row voted for (m >= rows - 1) get -inf. total (n_kv, n) -> (n_kv, n) float32."""
    n = total.shape[-1]
    count = (rows - 1 - torch.arange(n, device=total.device)).clamp(min=0, max=local).to(torch.float32)
    score = total / count.clamp(min=1)
    return score.masked_fill(count == 0, float("-inf"))


def block_scores(query: torch.Tensor, reps: torch.Tensor, kind: str, shared: bool) -> torch.Tensor:
    """Relevance of each block to the current query: (H, n_blocks), H = 1 shared else n_kv.

    query (n_heads, d) — the decode token's queries after RoPE; reps (n_kv, n_blocks, R, d).
    Per query head: InfLLM's equation 2, ``sum_r q · r`` over the representatives (Quest: the upper
    bound of :func:`quest_upper_bound`); summed over the query heads of each KV head's GQA group
    (``separate``) or over every head of the layer (``shared``).
    """
    n_kv, _, _, d = reps.shape
    q = query.to(torch.float32).reshape(n_kv, -1, d)  # (n_kv, group, d): query head h reads KV head h // group
    if kind == "quest":
        s = quest_upper_bound(q, reps[:, None, :, 0], reps[:, None, :, 1])  # (n_kv, g, nb)
    else:
        s = torch.einsum("hgd,hbd->hgb", q, reps.sum(dim=2))
    s = s.sum(dim=1)
    return s.sum(dim=0, keepdim=True) if shared else s
