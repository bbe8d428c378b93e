"""RoPE helpers for policies that move post-RoPE queries and keys between positions.

Keys and queries reach a policy with RoPE applied (``x_p = R(p) x``, ``rotate_half`` layout over
the first ``rotary_dim`` dims of a head). Rotations compose, so ``R(t - p) x_p`` is ``x`` rotated to
position ``t`` and ``R(-p) x_p`` the pre-RoPE vector; nothing needs the model's projection weights.
"""

from __future__ import annotations

import torch


def inverse_frequencies(module: torch.nn.Module) -> torch.Tensor | None:
    """``[rotary_dim // 2]`` float32 RoPE inverse frequencies of an attention module's layer, or None.

    Read from ``module.config`` (``rope_parameters``, ``head_dim``, ``partial_rotary_factor``); a model
    whose layers differ (Gemma 3's sliding and full layers, ``config.layer_types``) gets the entry of
    ``module.layer_idx``'s type. Non-default RoPE types use transformers' own init functions; their
    ``attention_scaling`` is a common factor on every rotated dim, which the rotations here preserve.
    """
    config = getattr(module, "config", None)
    if config is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    layer_type = layer_types[layer] if layer_types and layer is not None and layer < len(layer_types) else None
    params = getattr(config, "rope_parameters", None)
    if params is None:
        theta = getattr(config, "rope_theta", None)
        params = None if theta is None else {"rope_type": "default", "rope_theta": theta}
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    else:
        layer_type = None
    if not isinstance(params, dict) or "rope_theta" not in params and params.get("rope_type", "default") == "default":
        return None
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        dim = int(head_dim * partial)
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    try:
        inv_freq, _ = init(config, None, layer_type=layer_type)
    except TypeError:
        inv_freq, _ = init(config, None)
    return inv_freq.float()


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., r, d]`` by RoPE angles ``[..., r, rotary_dim // 2]`` (dims past ``rotary_dim`` pass)."""
    half = angles.shape[-1]
    rot = 2 * half
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x_rot = x[..., :rot]
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated_half * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE vectors from post-RoPE ``x [..., r, d]`` at ``positions [..., r]`` (float32)."""
    angles = -positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device)
    return rotate(x.float(), angles)


def mean_rotation_coefficients(start: int, count: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[rotary_dim]``: ``mean_t cos(t w)`` and ``mean_t sin(t w)`` over ``t = start .. start + count - 1``.

    Closed form (a Dirichlet kernel, in float64): ``mean_t e^{i t w} = e^{i (start + (count - 1) / 2) w}
    sin(count w / 2) / (count sin(w / 2))``, so the cost does not grow with ``count``. Laid out as
    ``cat(freqs, freqs)``, like transformers' ``cos``/``sin``.
    """
    w = inv_freq.double()
    half_w = w / 2
    ratio = torch.where(half_w.sin().abs() > 1e-300, (count * half_w).sin() / (count * half_w.sin()),
                        torch.ones_like(w))
    centre = (start + (count - 1) / 2) * w
    cos, sin = (centre.cos() * ratio).float(), (centre.sin() * ratio).float()
    return torch.cat([cos, cos]), torch.cat([sin, sin])


def mean_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R @ x`` for ``x [..., d]`` with the averaged rotation ``R = diag(cos) + diag(sin) P`` (see below)."""
    half = cos.shape[0] // 2
    rot = 2 * half
    x_rot = x[..., :rot]
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos.to(x.device) + rotated_half * sin.to(x.device)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def mean_rotation(start: int, count: int, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[d, d]`` the RoPE rotation matrix averaged over positions ``start .. start + count - 1``.

    kvpress's ``apply_avg_rope``: ``R = mean_t (diag(cos_t) + diag(sin_t) P)`` with ``P`` the
    ``rotate_half`` matrix, so ``R @ x`` is the average of ``x`` rotated to each of those positions.
    Dims past ``rotary_dim`` keep the identity.
    """
    cos, sin = mean_rotation_coefficients(start, count, inv_freq)
    half = inv_freq.shape[0]
    rot = 2 * half
    R = torch.eye(head_dim, dtype=torch.float32)
    P = torch.zeros(rot, rot)
    P[half:, :half], P[:half, half:] = torch.eye(half), -torch.eye(half)
    R[:rot, :rot] = torch.diag(cos) + sin.unsqueeze(1) * P
    return R
