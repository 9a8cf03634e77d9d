"""PolarQuant's key format: every RoPE pair of a key as a quantized radius and angle.

The PolarQuant baseline (``docs/method.md``, "Baselines in other key formats"). RoPE rotates a key's
pair ``i`` (channels ``(first_i, second_i)`` of the model's pairing) as one 2-D vector, so the pair is
stored in polar form::

    radius = |(first, second)|,   angle = atan2(second, first) in [0, 2 pi)

Both are quantized per pair over groups of ``G`` tokens: the group's range ``[min, max]`` is cut into
``2**b`` equal bins and a value is read back at the centre of its bin::

    step = (max - min) / 2**b,  zero = min + step / 2,  scale = step
    code = clamp(round((x - zero) / scale), 0, 2**b - 1),   x_hat = zero + code * scale

so every reader reconstructs with the same ``zero + code * scale`` as the per-channel format, and a
value is at most ``step / 2`` from its reconstruction (plus the rounding of the 16-bit zero and
scale). At one bit these are the midpoint-corrected levels of the per-channel format. The pair then
reads back as ``radius_hat * (cos angle_hat, sin angle_hat)``; its error is at most
``|radius - radius_hat| + radius_hat * |angle - angle_hat|``.

Storage, per layer (``P = D / 2`` pairs; plain bit planes along tokens, :func:`~.quantize.pack_key_codes`):

=====================  ==========================================  =======
tensor                 shape                                       dtype
=====================  ==========================================  =======
radius codes           ``[B, H, groups, b_r, G/32, P]``            int32
angle codes            ``[B, H, groups, b_a, G/32, P]``            int32
key scale / zero       ``[B, H, groups, D]``: radii's, then angles  16-bit
=====================  ==========================================  =======

Decoding by table lookup (:func:`polar_key_logits`): a query pair ``(a, b)`` and a key pair of
radius ``r`` and angle ``t`` give ``r * (a cos t + b sin t)``. Within a group a pair's angle takes one
of ``2**b_a`` levels, so each query builds, per group and pair, the table ``a cos t_l + b sin t_l`` of
its levels once, and a key's logit is the sum over pairs of its radius times the table entry its angle
code selects: no key is rebuilt.
"""

from __future__ import annotations

import math

import torch

from .quantize import decode, encode, pack_key_codes, scale_dtype_for, unpack_key_codes
from .selection import split_pairs


def bin_center_params(x: torch.Tensor, bits: int, dim: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (``dim`` kept, size 1) of ``2**bits`` equal bins over ``[min, max]`` of ``x`` along
    ``dim``, read back at their centres (module docstring). A group holding inf or NaN gets NaN (it reads
    back NaN as a whole); a constant group reads back its value."""
    x = x.float()
    low = x.amin(dim, keepdim=True)
    step = (x.amax(dim, keepdim=True) - low) / 2**bits
    finite = torch.isfinite(x).all(dim, keepdim=True)
    nan = torch.tensor(float("nan"), device=x.device)
    return torch.where(finite, step, nan).to(scale_dtype), torch.where(finite, low + 0.5 * step, nan).to(scale_dtype)


def polar_coordinates(keys: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 radius and angle in ``[0, 2 pi)`` of every RoPE pair: ``[..., D]`` -> two ``[..., D/2]``."""
    first, second = split_pairs(keys.float(), pairing)
    return torch.hypot(first, second), torch.remainder(torch.atan2(second, first), 2 * math.pi)


def from_polar(radius: torch.Tensor, angle: torch.Tensor, pairing: str) -> torch.Tensor:
    """Keys ``[..., D]`` from pair radii and angles ``[..., D/2]`` (inverse of :func:`polar_coordinates`)."""
    first, second = radius * torch.cos(angle), radius * torch.sin(angle)
    if pairing == "half":
        return torch.cat([first, second], -1)
    return torch.stack([first, second], -1).flatten(-2)


def quantize_polar_keys(
    keys: torch.Tensor, group_size: int, radius_bits: int, angle_bits: int, pairing: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize keys ``[B, H, T, D]`` (``T`` a multiple of ``group_size``) pair by pair in polar form.

    Returns ``(radius_codes [B, H, T/G, b_r, G/32, D/2], angle_codes [B, H, T/G, b_a, G/32, D/2],
    scale [B, H, T/G, D], zero [B, H, T/G, D])``; scale and zero hold the radii's first, then the angles'.
    """
    batch, heads, tokens, head_dim = keys.shape
    scale_dtype = scale_dtype_for(keys.dtype)
    codes, scales, zeros = [], [], []
    for part, bits in zip(polar_coordinates(keys, pairing), (radius_bits, angle_bits)):
        part = part.reshape(batch, heads, tokens // group_size, group_size, head_dim // 2)
        scale, zero = bin_center_params(part, bits, 3, scale_dtype)
        codes.append(pack_key_codes(encode(part, scale, zero, bits), bits))
        scales.append(scale.squeeze(3))
        zeros.append(zero.squeeze(3))
    return codes[0], codes[1], torch.cat(scales, -1), torch.cat(zeros, -1)


def _polar_parts(radius_codes, angle_codes, scale, zero) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reconstructed radii ``[B, H, groups, G, P]``, angle codes ``[B, H, groups, G, P]`` and the angle
    scale and zero ``[B, H, groups, 1, P]``."""
    pairs = radius_codes.shape[-1]
    radius = decode(unpack_key_codes(radius_codes), scale[..., None, :pairs], zero[..., None, :pairs])
    return radius, unpack_key_codes(angle_codes), scale[..., None, pairs:].float(), zero[..., None, pairs:].float()


def dequantize_polar_keys(radius_codes, angle_codes, scale, zero, pairing: str) -> torch.Tensor:
    """Float32 keys ``[B, H, groups*G, D]`` from :func:`quantize_polar_keys` output."""
    radius, angle_codes, angle_scale, angle_zero = _polar_parts(radius_codes, angle_codes, scale, zero)
    keys = from_polar(radius, decode(angle_codes, angle_scale, angle_zero), pairing)
    batch, heads, groups, group_size, head_dim = keys.shape
    return keys.reshape(batch, heads, groups * group_size, head_dim)


def polar_key_logits(query: torch.Tensor, radius_codes, angle_codes, scale, zero, pairing: str) -> torch.Tensor:
    """Unscaled logits ``query . key`` of every stored key, by table lookup over the angle levels.

    Args:
        query: ``[B, Hq, T, D]`` (``Hq`` a multiple of the ``H`` KV heads).
        radius_codes, angle_codes, scale, zero: :func:`quantize_polar_keys` output.
    Returns:
        float32 ``[B, Hq, T, groups*G]``.

    Per (query, group, pair) the table ``a cos t_l + b sin t_l`` holds the ``2**b_a`` angle levels
    ``t_l = zero + l * scale``; a key's logit is ``sum_pairs radius_hat * table[angle code]``. The
    lookup is written as a product with the keys' one-hot angle codes weighted by their radii, so its
    memory does not grow with the number of queries.
    """
    batch, query_heads, tokens, _ = query.shape
    heads, groups, levels = radius_codes.shape[1], radius_codes.shape[2], 2 ** angle_codes.shape[3]
    radius, codes, angle_scale, angle_zero = _polar_parts(radius_codes, angle_codes, scale, zero)
    angles = angle_zero + torch.arange(levels, device=query.device).view(levels, 1) * angle_scale  # [B, H, groups, L, P]
    first, second = (q.reshape(batch, heads, query_heads // heads, tokens, -1) for q in split_pairs(query.float(), pairing))
    table = torch.einsum("bhrtp,bhglp->bhrtglp", first, torch.cos(angles)) + torch.einsum("bhrtp,bhglp->bhrtglp", second, torch.sin(angles))
    # a NaN group (non-finite keys) keeps its NaN through the radius, not through a NaN code
    picks = torch.nn.functional.one_hot(codes.long(), levels).to(radius.dtype) * radius.unsqueeze(-1)  # [B, H, groups, G, P, L]
    logits = torch.einsum("bhrtglp,bhgspl->bhrtgs", table, picks)
    return logits.reshape(batch, query_heads, tokens, groups * radius.shape[3])
