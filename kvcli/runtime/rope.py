"""Moving cached keys to other positions: RoPE re-rotation.

A key cached at position ``p`` holds ``s · R(θ·p) k`` (``s``: the rotary embedding's
``attention_scaling``, 1 for plain RoPE; ``R``: the rotation of each dimension pair by its angle).
The same key at position ``q`` is ``s · R(θ·q) k = R(θ·(q - p)) · (s · R(θ·p) k)``: one rotation by
the angle *difference*, no need for the pre-RoPE key. kvcli computes that delta rotation from the
model's own rotary embedding (``engine.rotary_emb``, which returns ``s·cos`` and ``s·sin``):

    cos(a - b) = (cos_q cos_p + sin_q sin_p) / s²      sin(a - b) = (sin_q cos_p - cos_q sin_p) / s²
    with s² = cos_p² + sin_p²

so whatever the rope variant computes its angles with (linear / dynamic / yarn / llama3 / longrope
frequencies, ``attention_scaling``) the result is the key that variant computes at ``q``. Partial
rotary embeddings (phi3 ``partial_rotary_factor`` < 1) rotate only the first ``cos.shape[-1]``
dimensions of the head; the rest pass through, as in the models' ``apply_rotary_pos_emb``.

Assumes the "rotate_half" (non-interleaved) pairing that llama, mistral, qwen2/3 and phi3 use.
Variants whose frequencies depend on the sequence length (dynamic NTK, longrope's short/long
factors) are evaluated at the largest position passed in one call.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(rotary_emb, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the model's rotary embedding at ``positions`` (n,): each (n, rot_dim) float32,
    ``attention_scaling`` included (as the model applies them)."""
    pos = positions.to(like.device, torch.long).view(1, -1)
    x = torch.zeros(1, 1, 1, dtype=torch.float32, device=like.device)
    with torch.inference_mode():
        cos, sin = rotary_emb(x, pos)
    return cos[0].to(torch.float32), sin[0].to(torch.float32)


def delta_rotation(cos_p, sin_p, cos_q, sin_q) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angle difference (q - p), per entry; inputs (n, rot_dim) as returned by
    :func:`rope_cos_sin` (scaled by ``attention_scaling``; the scale cancels)."""
    scale2 = (cos_p * cos_p + sin_p * sin_p).clamp_min(1e-30)
    cos_d = (cos_q * cos_p + sin_q * sin_p) / scale2
    sin_d = (sin_q * cos_p - cos_q * sin_p) / scale2
    return cos_d, sin_d


def apply_rotation(key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``key`` (..., n, head_dim) by (cos, sin) (n, rot_dim); dims past rot_dim pass through.
    Computed in float32, returned in ``key``'s dtype."""
    rot = cos.shape[-1]
    k = key.to(torch.float32)
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    out = k_rot * cos + rotate_half(k_rot) * sin
    if k_pass.shape[-1]:
        out = torch.cat((out, k_pass), dim=-1)
    return out.to(key.dtype)


def rerotate(key: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, rotary_emb) -> torch.Tensor:
    """Keys (batch, n_kv, n, head_dim) cached after RoPE at ``old_positions`` (n,) -> the same keys
    at ``new_positions`` (n,). Values carry no position and never need this."""
    old_positions = old_positions.view(-1)
    new_positions = new_positions.view(-1)
    if old_positions.numel() != key.shape[-2] or new_positions.numel() != key.shape[-2]:
        raise ValueError(f"{old_positions.numel()} / {new_positions.numel()} positions for {key.shape[-2]} keys")
    if key.shape[-2] == 0 or torch.equal(old_positions.cpu(), new_positions.cpu()):
        return key
    both = torch.cat([old_positions, new_positions])
    cos, sin = rope_cos_sin(rotary_emb, both, key)  # one call: same frequencies for both
    n = old_positions.numel()
    cos_d, sin_d = delta_rotation(cos[:n], sin[:n], cos[n:], sin[n:])
    return apply_rotation(key, cos_d, sin_d)


def rerotate_table(
    key: torch.Tensor, old_index: torch.Tensor, new_index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """:func:`rerotate` with a precomputed (cos, sin) table of :func:`rope_cos_sin` over positions
    0..L-1: ``old_index``/``new_index`` (n,) index into it. For many layers moved in one step."""
    cos_d, sin_d = delta_rotation(cos[old_index], sin[old_index], cos[new_index], sin[new_index])
    return apply_rotation(key, cos_d, sin_d)
