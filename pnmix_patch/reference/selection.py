"""Pair selection at prefill (``docs/method.md``, "Pair selection: once, at prefill").

For each sequence ``b``, KV head ``h`` and RoPE pair ``i``::

    sigma[b, h, i] = mean_{query heads g of h}( E_t |q_{g,i}(t)| ) * E_t |k_{h,i}(t)|

``E_t`` averages over the sequence's real prompt tokens (padding excluded). The top
``round(r * D/2)`` pairs by ``sigma`` get the high bit width; the selection is a
``[B, H, D/2]`` mask reused for the whole decode.

Pairing follows the model's RoPE: ``"half"`` (Hugging Face ``rotate_half``: pair
``i`` is channels ``(i, i + D/2)``) or ``"interleaved"`` (channels ``(2i, 2i+1)``).
Pair norms are rotation invariant, so post-RoPE vectors give the pre-RoPE scores.

The key-only criteria of the paper's comparison are here too. Channel criteria
(``k_magnitude``: mean |k_c|, ``k_range``: max - min of k_c) score a pair as the
sum of its two channels' scores, since storage selects whole pairs.

Per-group re-selection (the paper's online ablation, and Kitty) scores every
``G``-token key group on its own keys: :func:`group_channel_masks`. Its query
statistic for ``qk_pair_norm`` is supplied by the caller (the cache keeps a
running mean of the query pair norms of the tokens it has seen).
"""

from __future__ import annotations

import torch

PAIRINGS = ("half", "interleaved")


def split_pairs(x: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two channels of every pair: ``x[..., D]`` -> ``(first, second)``, each ``[..., D/2]``."""
    half = x.shape[-1] // 2
    if pairing == "half":
        return x[..., :half], x[..., half:]
    if pairing == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    raise ValueError(f"pairing={pairing!r} is invalid: allowed {PAIRINGS}")


def pair_norms(x: torch.Tensor, pairing: str) -> torch.Tensor:
    """Euclidean norm of every RoPE pair: ``[..., D]`` -> float32 ``[..., D/2]``.

    One reduction over a view of ``x`` (no float32 copy of ``x``: at a 16K prompt the
    query of one layer is 128 MB in bf16, and this runs on every layer at prefill).
    """
    half = x.shape[-1] // 2
    if pairing == "half":
        return torch.linalg.vector_norm(x.unflatten(-1, (2, half)), dim=-2, dtype=torch.float32)
    if pairing == "interleaved":
        return torch.linalg.vector_norm(x.unflatten(-1, (half, 2)), dim=-1, dtype=torch.float32)
    raise ValueError(f"pairing={pairing!r} is invalid: allowed {PAIRINGS}")


def pairs_to_channels(pair_mask: torch.Tensor, pairing: str) -> torch.Tensor:
    """Expand a pair mask ``[..., D/2]`` to the channel mask ``[..., D]`` (both channels of a pair)."""
    if pairing == "half":
        return torch.cat([pair_mask, pair_mask], dim=-1)
    if pairing == "interleaved":
        return pair_mask.repeat_interleave(2, dim=-1)
    raise ValueError(f"pairing={pairing!r} is invalid: allowed {PAIRINGS}")


def token_mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x [B, heads, T, P]`` over the valid tokens ``valid [B, T]`` (None: all)."""
    if valid is None:
        return x.mean(2)
    mask = valid[:, None, :, None]
    count = mask.sum(2).clamp_min(1)
    # where, not a 0/1 weight: padding may hold inf or NaN, and 0 * inf is NaN.
    return torch.where(mask, x, 0.0).sum(2) / count


def pair_scores(query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None, criterion: str, pairing: str) -> torch.Tensor:
    """Sensitivity score of every pair, float32 ``[B, H, D/2]``.

    Args:
        query: ``[B, Hq, T, D]`` (Hq a multiple of H).
        key: ``[B, H, T, D]``.
        valid: bool ``[B, T]``, False for padding, or None when every token is real.
        criterion: ``qk_pair_norm`` | ``k_pair_norm`` | ``k_magnitude`` | ``k_range``.
    """
    batch, kv_heads = key.shape[:2]
    if criterion in ("qk_pair_norm", "k_pair_norm"):
        score = token_mean(pair_norms(key, pairing), valid)
        if criterion == "qk_pair_norm":
            query_mean = token_mean(pair_norms(query, pairing), valid)
            # GQA: average the query heads that share a KV head before the product.
            score = score * query_mean.view(batch, kv_heads, -1, score.shape[-1]).mean(2)
        return score
    if criterion == "k_magnitude":
        channel_score = token_mean(key.float().abs(), valid)
    elif criterion == "k_range":
        if valid is None:
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
        mask = valid[:, None, :, None]
        keys = key.float()
        high = torch.where(mask, keys, -torch.inf).amax(2)
        low = torch.where(mask, keys, torch.inf).amin(2)
        channel_score = torch.where(valid.any(1)[:, None, None], high - low, torch.zeros_like(high))
    else:
        raise ValueError(f"criterion={criterion!r} is invalid: allowed qk_pair_norm, k_pair_norm, k_magnitude, k_range")
    first, second = split_pairs(channel_score, pairing)
    return first + second


def group_channel_masks(
    keys: torch.Tensor,
    criterion: str,
    unit: str,
    pairing: str,
    num_high_channels: int,
    query_pair_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """High-precision channels of every key group, chosen from that group's own keys.

    Args:
        keys: ``[B, H, groups, G, D]``.
        criterion: one of ``qk_pair_norm``, ``k_pair_norm``, ``k_magnitude``, ``k_range``.
        unit: ``"pair"`` (both channels of the best pairs) or ``"channel"`` (best single channels;
            channel criteria only).
        pairing: the model's RoPE pairing.
        num_high_channels: channels per head and group to select (even for ``unit="pair"``).
        query_pair_mean: float32 ``[B, H, D/2]``, mean query pair norms (GQA-averaged), needed by
            ``qk_pair_norm``.
    Returns:
        bool ``[B, H, groups, D]`` with ``num_high_channels`` True per group.
    """
    keys = keys.float()
    if criterion in ("qk_pair_norm", "k_pair_norm"):
        if unit != "pair":
            raise ValueError(f"criterion={criterion!r} ranks pairs: allowed unit='pair', got {unit!r}")
        scores = pair_norms(keys, pairing).mean(3)
        if criterion == "qk_pair_norm":
            if query_pair_mean is None:
                raise ValueError("criterion='qk_pair_norm' needs query_pair_mean [B, H, D/2]")
            scores = scores * query_pair_mean[:, :, None]
    elif criterion in ("k_magnitude", "k_range"):
        channel_scores = keys.abs().mean(3) if criterion == "k_magnitude" else keys.amax(3) - keys.amin(3)
        if unit == "channel":
            return select_top_pairs(channel_scores, num_high_channels)
        first, second = split_pairs(channel_scores, pairing)
        scores = first + second
    else:
        raise ValueError(f"criterion={criterion!r} is invalid: allowed qk_pair_norm, k_pair_norm, k_magnitude, k_range")
    if unit not in ("pair", "channel"):
        raise ValueError(f"unit={unit!r} is invalid: allowed 'pair', 'channel'")
    return pairs_to_channels(select_top_pairs(scores, num_high_channels // 2), pairing)


def select_top_pairs(scores: torch.Tensor, num_selected: int) -> torch.Tensor:
    """Bool mask ``[..., P]`` with the ``num_selected`` highest-scoring pairs (or channels) True.

    Non-finite scores (from non-finite keys) rank lowest, so the choice stays defined.
    """
    scores = scores.float()
    scores = torch.where(torch.isfinite(scores), scores, -torch.inf)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if num_selected:
        mask.scatter_(-1, scores.topk(num_selected, dim=-1).indices, True)
    return mask


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask ``[..., P]`` into int32 words ``[..., ceil(P/32)]`` (bit j%32 of word j//32)."""
    words = -(-mask.shape[-1] // 32)
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, words * 32 - mask.shape[-1]))
    positions = torch.arange(32, device=mask.device)
    packed = (padded.view(*mask.shape[:-1], words, 32) << positions).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_mask(packed: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: bool ``[..., size]``."""
    positions = torch.arange(32, device=packed.device)
    bits = (packed.to(torch.int64).unsqueeze(-1) >> positions) & 1
    return bits.flatten(-2)[..., :size].bool()
