"""ChanMix's key format: per-channel bit widths by channel class, chosen once per sequence at prefill.

The ChanMix baseline (``docs/method.md``, "Baselines in other key formats"). Every channel of a
(sequence, layer, KV head) falls in one of four classes (:data:`~pnmix_patch.config.CHANNEL_CLASSES`),
assigned in this order from the sequence's real prompt tokens:

1. **retrieval**: the channels that carry the most of the query-key logit, by
   ``mean_g(E_t |q_{g,c}|) * E_t |k_c|`` (query heads ``g`` sharing the KV head averaged);
2. **outlier**: of the rest, the channels of the widest key range ``max_t k_c - min_t k_c``;
3. **subnormal**: of the rest, the channels of the smallest mean key magnitude ``E_t |k_c|``;
4. **normal**: all others.

Each class has a fixed count per head (``PNMixConfig.class_counts``), so the packed tensors stay
rectangular across a batch. Keys are quantized per channel, asymmetric min-max over groups of ``G``
tokens as in the per-channel format, each class at its own width.

Storage, per layer (channels stored class by class, each class in increasing channel order; plain
bit planes along tokens, :func:`~.quantize.pack_key_codes`):

=====================  ==========================================  =======
tensor                 shape                                       dtype
=====================  ==========================================  =======
codes of class ``k``   ``[B, H, groups, bits_k, G/32, count_k]``   int32
key scale / zero       ``[B, H, groups, D]`` (stored order)        16-bit
channel classes        ``[B, H, 2, ceil(D/32)]``: two bit planes   int32
=====================  ==========================================  =======
"""

from __future__ import annotations

import torch

from .quantize import decode, encode, minmax_params, pack_key_codes, scale_dtype_for, unpack_key_codes
from .selection import pack_mask, token_mean, unpack_mask

RETRIEVAL, OUTLIER, NORMAL, SUBNORMAL = range(4)


def classify_channels(
    query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None, counts: tuple[int, int, int, int]
) -> torch.Tensor:
    """Class of every channel (module docstring), int64 ``[B, H, D]``: 0 retrieval, 1 outlier, 2 normal, 3 subnormal.

    Args:
        query: ``[B, Hq, T, D]`` post-RoPE queries (``Hq`` a multiple of ``H``).
        key: ``[B, H, T, D]`` post-RoPE keys.
        valid: bool ``[B, T]``, False for padding, or None when every token is real.
        counts: channels per head of each class (``PNMixConfig.class_counts``).
    """
    batch, heads, tokens, head_dim = key.shape
    if valid is None:
        valid = torch.ones(batch, tokens, dtype=torch.bool, device=key.device)
    keys = key.float()
    magnitude = token_mean(keys.abs(), valid)
    query_magnitude = token_mean(query.float().abs(), valid).view(batch, heads, -1, head_dim).mean(2)
    mask = valid[:, None, :, None]
    key_range = torch.where(mask, keys, -torch.inf).amax(2) - torch.where(mask, keys, torch.inf).amin(2)
    classes = torch.full((batch, heads, head_dim), NORMAL, dtype=torch.int64, device=key.device)
    taken = torch.zeros(batch, heads, head_dim, dtype=torch.bool, device=key.device)
    for label, score, count in (
        (RETRIEVAL, query_magnitude * magnitude, counts[0]),
        (OUTLIER, key_range, counts[1]),
        (SUBNORMAL, -magnitude, counts[3]),
    ):
        # Non-finite scores rank below every finite one but above the channels already taken,
        # so each class gets exactly its count.
        ranked = torch.where(taken, -torch.inf, torch.where(torch.isfinite(score), score, torch.finfo(torch.float32).min))
        chosen = torch.zeros_like(taken).scatter_(-1, ranked.topk(count, dim=-1).indices, True) if count else torch.zeros_like(taken)
        classes = torch.where(chosen, label, classes)
        taken = taken | chosen
    return classes


def class_order(classes: torch.Tensor) -> torch.Tensor:
    """Storage order of a head's channels: class by class, each ascending (``stored = x.gather(-1, order)``)."""
    return torch.argsort(classes, dim=-1, stable=True)


def pack_classes(classes: torch.Tensor) -> torch.Tensor:
    """Channel classes ``[..., D]`` (0..3) as two bit planes of int32 words ``[..., 2, ceil(D/32)]``."""
    return torch.stack([pack_mask((classes >> bit) & 1 == 1) for bit in range(2)], -2)


def unpack_classes(words: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_classes`: int64 ``[..., D]``."""
    return sum(unpack_mask(words[..., bit, :], head_dim).to(torch.int64) << bit for bit in range(2))


def quantize_class_keys(
    keys: torch.Tensor,
    classes: torch.Tensor,
    counts: tuple[int, ...],
    bits: tuple[int, ...],
    group_size: int,
    midpoint_correction: bool,
) -> tuple[torch.Tensor, ...]:
    """Quantize keys ``[B, H, T, D]`` (``T`` a multiple of ``group_size``) per channel, each class at its width.

    ``classes`` is int64 ``[B, H, D]`` with ``counts[k]`` channels of class ``k`` per head. Returns the
    four classes' codes ``[B, H, T/G, bits_k, G/32, counts_k]``, then ``scale`` and ``zero``
    ``[B, H, T/G, D]`` in :func:`class_order`.
    """
    batch, heads, tokens, head_dim = keys.shape
    order = class_order(classes)
    stored = keys.gather(-1, order.unsqueeze(2).expand(-1, -1, tokens, -1)).reshape(
        batch, heads, tokens // group_size, group_size, head_dim
    )
    scale_dtype = scale_dtype_for(keys.dtype)
    codes, scales, zeros, start = [], [], [], 0
    for count, width in zip(counts, bits):
        part = stored[..., start : start + count]
        scale, zero = minmax_params(part, width, 3, midpoint_correction, scale_dtype)
        codes.append(pack_key_codes(encode(part, scale, zero, width), width))
        scales.append(scale.squeeze(3))
        zeros.append(zero.squeeze(3))
        start += count
    return (*codes, torch.cat(scales, -1), torch.cat(zeros, -1))


def dequantize_class_keys(codes: tuple[torch.Tensor, ...], scale: torch.Tensor, zero: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Float32 keys ``[B, H, groups*G, D]`` in channel order from :func:`quantize_class_keys` output."""
    parts, start = [], 0
    for words in codes:
        count = words.shape[-1]
        parts.append(decode(unpack_key_codes(words), scale[..., None, start : start + count], zero[..., None, start : start + count]))
        start += count
    stored = torch.cat(parts, -1)
    batch, heads, groups, group_size, head_dim = stored.shape
    stored = stored.reshape(batch, heads, groups * group_size, head_dim)
    order = class_order(classes).unsqueeze(2).expand(-1, -1, groups * group_size, -1)
    return torch.empty_like(stored).scatter_(-1, order, stored)
