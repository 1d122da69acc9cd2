"""Reference queries and keys computed the Hugging Face way, independently of kvcli's engine.

Tests compare each method's selection with the paper's arithmetic written out plainly on these.
"""

from __future__ import annotations

import torch


def reference_qk(lm, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """Per layer ``(q, k, attn)``: HF's own forward gives the hidden states; q and k are recomputed
    from each layer's input (q_norm/k_norm where the family has them, e.g. qwen3), RoPE applied,
    keys repeated for GQA. q, k: (1, n_heads, n, head_dim); ``attn`` is the layer's attention module."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = lm.model
    n = ids.numel()
    out = []
    with torch.inference_mode():
        hs = model(ids.view(1, -1), output_hidden_states=True).hidden_states
        pos = torch.arange(n).view(1, -1)
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
    return w.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-4) -> None:
    """Step-by-step logits (vocab,) equal within ``tol``, and the same greedy tokens."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)
    assert [int(g.argmax()) for g in got] == [int(w.argmax()) for w in want]
