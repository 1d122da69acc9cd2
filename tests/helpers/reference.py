"""Reference queries and keys computed the Hugging Face way, independently of kvcli's engine.

Tests compare each method's selection with the paper's arithmetic written out plainly on these.
"""

from __future__ import annotations

import inspect

import torch


def reference_qk(lm, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """Per layer ``(q, k, attn)``: HF's own forward gives the hidden states; q and k are recomputed
    from each layer's input (q_norm/k_norm where the family has them, e.g. qwen3), RoPE applied,
    keys repeated for GQA. q, k: (1, n_heads, n, head_dim); ``attn`` is the layer's attention module."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = lm.model
    dev = lm.device  # every tensor of the reference where the model runs
    n = ids.numel()
    out = []
    with torch.inference_mode():
        hs = model(ids.view(1, -1).to(dev), output_hidden_states=True).hidden_states
        pos = torch.arange(n, device=dev).view(1, -1)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hs[i])
            q = attn.q_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(1, n, -1, attn.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = model.model.rotary_emb(h, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out.append((q, repeat_kv(k, attn.num_key_value_groups), attn))
    return out


def causal_softmax(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """(1, H, n, d) x (1, H, n, d) -> (1, H, n, n) float32 causal attention weights."""
    n = q.shape[2]
    w = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    return w.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf")).softmax(-1)


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-4) -> None:
    """Step-by-step logits (vocab,) equal within ``tol``, and the same greedy tokens."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)
    assert [int(g.argmax()) for g in got] == [int(w.argmax()) for w in want]


def neighbour_max(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each score replaced by the largest within ``kernel // 2`` positions either side (SnapKV's
    max-pool clustering, written out); kernel 1 returns the scores."""
    r = kernel // 2
    n = scores.shape[-1]
    return torch.stack([scores[..., max(0, i - r) : i + r + 1].max(dim=-1).values for i in range(n)], dim=-1)


def finch_reference(lm, ids: torch.Tensor, n_question: int, chunk: int, target: int, kernel: int = 1, follow=None):
    """Finch (Corallo & Papotti 2024, section 5.1) written out on transformers' own forward.

    The context (``ids`` less its last ``n_question`` tokens) is cut into ceil(P / chunk) balanced
    chunks; each step runs chunk + user prompt through HF's model on top of a ``DynamicCache``
    holding, per layer, the kept keys at slots 0..m-1; per layer, q / k / v of the new tokens are
    recomputed from HF's hidden states (RoPE at positions m..), the question rows' causal softmax
    over cache + chunk + question is summed over heads, each row times the keys it sees / the
    step's length, summed over rows, max-pooled over ``kernel`` neighbours, and the top
    ceil(target · seen / P) kept. A kept key's pre-RoPE vector is rotated by HF's own RoPE at its
    new slot (the model's key at that position). Finally the user prompt runs on the target cache.

    ``follow``: per compressing step, per layer, the candidate indices the method chose; the
    reference checks each is a top-k of its own scores (ties within 1e-5 of the scale may break
    either way) and continues with it, so one near-tie cannot make the two diverge. Returns
    ``(kept, keys, values, logits, steps)``: per layer original positions (m,), keys and values
    (1, n_kv, m, d) at slots 0..m-1, the first answer logits, and the number of compressing steps."""
    import math

    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = lm.model
    dev = lm.device  # every tensor of the reference where the model runs (kept positions included)
    ids = ids.to(dev)
    layers = model.model.layers
    n = ids.numel()
    n_context = n - n_question
    count = math.ceil(n_context / chunk)
    edges = [round(i * n_context / count) for i in range(count + 1)]
    state = [dict(pos=torch.zeros(0, dtype=torch.long, device=dev), pre=None, v=None) for _ in layers]

    def rope(x, positions):
        cos, sin = model.model.rotary_emb(x, positions.view(1, -1))
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    def run(step_ids, start):
        """HF forward of ``step_ids`` at positions start.. on the kept cache; per layer (q, k_pre, v)
        of the new tokens, k_pre before RoPE."""
        past = DynamicCache(config=model.config)
        slots = torch.arange(start, device=dev)
        for l, s in enumerate(state):
            if start:
                past.update(rope(s["pre"], slots), s["v"], l)
        positions = torch.arange(start, start + step_ids.numel(), device=dev)
        # the model's cache keyword: ``cache`` from transformers 5.24 on (``past_key_values`` warns there)
        kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(
            step_ids.view(1, -1),
            **{kwarg: past if start else None},
            position_ids=positions.view(1, -1),
            output_hidden_states=True,
            use_cache=True,
        )
        qkv = []
        for l, layer in enumerate(layers):
            attn = layer.self_attn
            h = layer.input_layernorm(out.hidden_states[l])
            shape = (1, h.shape[1], -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            qkv.append((rope(q, positions), k, v, attn))
        return qkv, out.logits[0, -1].float()

    steps = 0
    with torch.inference_mode():
        question = ids[n_context:]
        for start, end in zip(edges[:-1], edges[1:]):
            m = state[0]["pos"].numel()
            c = end - start
            keep = min(end, math.ceil(target * end / n_context))
            assert keep < m + c, "every chunk of the reference compresses"
            qkv, _ = run(torch.cat([ids[start:end], question]), m)
            kv_len = m + c + n_question
            for l, (q, k_pre, v, attn) in enumerate(qkv):
                s = state[l]
                pre = k_pre[:, :, :c] if s["pre"] is None else torch.cat([s["pre"], k_pre[:, :, :c]], dim=2)
                vals = v[:, :, :c] if s["v"] is None else torch.cat([s["v"], v[:, :, :c]], dim=2)
                keys = torch.cat(
                    [
                        rope(pre, torch.arange(m + c, device=dev)),
                        rope(k_pre[:, :, c:], torch.arange(m + c, kv_len, device=dev)),
                    ],
                    dim=2,
                )
                keys = repeat_kv(keys, attn.num_key_value_groups)
                logits = torch.matmul(q[:, :, -n_question:], keys.transpose(-1, -2)).float() * attn.scaling
                rows = torch.arange(m + c, kv_len, device=dev)[:, None]
                logits = logits.masked_fill(torch.arange(kv_len, device=dev)[None, :] > rows, float("-inf"))
                weights = logits.softmax(-1)[0].sum(0)  # heads summed: (n_question, kv_len)
                sees = (rows[:, 0] + 1).float()  # keys each question row sees
                scores = neighbour_max((weights[:, : m + c] * (sees / kv_len)[:, None]).sum(0), kernel)
                if follow is None:
                    chosen = torch.topk(scores, keep).indices.sort().values
                else:
                    chosen = follow[steps][l].to(dev).sort().values
                    assert chosen.numel() == keep and chosen.unique().numel() == keep, (steps, l)
                    mask = torch.zeros(m + c, dtype=torch.bool, device=dev)
                    mask[chosen] = True
                    slack = 1e-5 * float(scores.abs().max())
                    assert float(scores[mask].min()) >= float(scores[~mask].max()) - slack, (steps, l, "not a top-k")
                s["pos"] = torch.cat([s["pos"], torch.arange(start, end, device=dev)])[chosen]
                s["pre"], s["v"] = pre[:, :, chosen], vals[:, :, chosen]
            steps += 1
        m = state[0]["pos"].numel()
        _, logits = run(question, m)
        slots = torch.arange(m, device=dev)
        kept = [s["pos"] for s in state]
        keys = [rope(s["pre"], slots) for s in state]
        values = [s["v"] for s in state]
    return kept, keys, values, logits, steps


def hf_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    """Reference: transformers' own forward with its own sdpa kernel (no kvcli attention; eager
    for a family that refuses sdpa, Gemma 2)."""
    model = lm.model
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa" if getattr(type(model), "_supports_sdpa", True) is not False else "eager"
    try:
        with torch.inference_mode():
            return model(ids.view(1, -1).to(lm.device)).logits[0].float()
    finally:
        model.config._attn_implementation = saved
