"""Triton key quantizer: per-channel min-max over G-token groups, packed into bit planes.

Produces exactly :func:`pnmix_patch.reference.quantize.quantize_keys` (same shapes and dtypes,
bit-identical codes, scales and zeros), so the decode kernel and the PyTorch
reference read the same cache. Used when the residual buffer is flushed.

One program quantizes one group (``G`` tokens x all ``D`` channels) of one
(sequence, KV head). Channels are gathered into the stored order (``order``:
selected-pair channels first), so stored channel ``c`` has ``b_H`` bits iff
``c < num_high``. Two passes over the group's tokens:

1. per-channel min, max and non-finite count -> scale and zero (stored 16-bit);
2. codes from the *stored* scale/zero, once per codes tensor (:func:`_pack_key_planes`): the low
   one takes planes ``0 .. b_L - 1`` of every channel, the high one planes ``b_L .. b_H - 1`` of
   the selected channels. For each bit plane ``p`` (its slot of the tensor) the words in the
   operand order of ``quantize.py``: thread-owned words (``G`` a multiple of 64; the launcher
   passes each tensor's tile distance, ``quantize.key_word_distance``, 0 for the other order),
   made from blocks of 128 tokens (64 where ``G`` is not a multiple of 128), each pair of planes
   as two words of 2-bit fields (slot ``p``: the fields of the chunks' half ``p % 2``; a last
   partial chunk's compacted, ``quantize.compact_key_fields``) and an odd last plane as bit ``p``
   of the codes; else per 32-token row one word of bit ``p`` per channel (bit ``t`` is token ``32
   * w + t``), each run of four channels' words byte-transposed.

Layout (from ``quantize.py``): ``codes_high [B, H, groups, b_H - b_L, G/32, C_hi]``,
``codes_low [B, H, groups, b_L, G/32, D]``, ``scale/zero [B, H, groups, D]``.
Limits: ``G`` a multiple of 32, bits <= 8 (any ``D``).

The per-group work is the device function :func:`pack_key_group`, which the static
cache's fused decode append (``decode_append.py``) also calls to flush its residual
buffer in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix_patch.reference.quantize import key_code_shape, quantize_keys, scale_dtype_for

from .common import compacted_field_word, encode, key_word_distances, minmax_scale_zero, nonempty, transpose_byte_quads


@triton.jit
def pack_key_group(
    keys_ptr,
    order_ptr,
    high_ptr,
    low_ptr,
    scale_ptr,
    zero_ptr,
    group,
    group_out,
    s_kt,
    s_kd,
    s_od,
    s_hg,
    s_hp,
    s_hw,
    s_hc,
    s_lg,
    s_lp,
    s_lw,
    s_lc,
    s_sg,
    s_sd,
    NUM_HIGH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G: tl.constexpr,
    PLANES_HIGH: tl.constexpr,
    BITS_LOW: tl.constexpr,
    MIDPOINT: tl.constexpr,
    HIGH_DISTANCE: tl.constexpr,
    LOW_DISTANCE: tl.constexpr,
):
    """Quantize token group ``group`` of one (sequence, KV head) into group slot
    ``group_out``. The pointers are that head's bases; ``PLANES_HIGH``: the selected channels' upper
    planes (their codes have ``PLANES_HIGH + BITS_LOW`` bits); ``HIGH_DISTANCE``, ``LOW_DISTANCE``: the
    codes tensors' ``quantize.key_word_distance``."""
    offs_c = tl.arange(0, BLOCK_D)  # stored channel
    c_mask = offs_c < D
    offs_t = tl.arange(0, 32)  # token within a 32-token word

    # Stored channel c reads original channel order[c].
    order = tl.load(order_ptr + offs_c * s_od, mask=c_mask, other=0)
    row_ptrs = keys_ptr + (group * G + offs_t)[:, None] * s_kt + (order * s_kd)[None, :]

    # Pass 1: per-channel statistics over the group.
    low = tl.full([BLOCK_D], float("inf"), tl.float32)
    high = tl.full([BLOCK_D], float("-inf"), tl.float32)
    nonfinite = tl.zeros([BLOCK_D], tl.int32)
    for w in range(G // 32):
        x = tl.load(row_ptrs + w * 32 * s_kt, mask=c_mask[None, :], other=0.0).to(tl.float32)
        low = tl.minimum(low, tl.min(x, 0))
        high = tl.maximum(high, tl.max(x, 0))
        nonfinite += tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 0)

    levels = tl.where(offs_c < NUM_HIGH, 2 ** (PLANES_HIGH + BITS_LOW) - 1, 2**BITS_LOW - 1).to(tl.float32)
    scale, zero = minmax_scale_zero(low, high, nonfinite, levels, MIDPOINT)
    param_offs = group_out * s_sg + offs_c * s_sd
    scale = scale.to(scale_ptr.dtype.element_ty)
    zero = zero.to(zero_ptr.dtype.element_ty)
    tl.store(scale_ptr + param_offs, scale, mask=c_mask)
    tl.store(zero_ptr + param_offs, zero, mask=c_mask)
    scale = scale.to(tl.float32)
    zero = zero.to(tl.float32)

    # Pass 2, once per codes tensor: the low planes of every channel, the upper ones of the selected.
    _pack_key_planes(
        keys_ptr,
        order,
        low_ptr + group_out * s_lg,
        scale,
        zero,
        levels,
        group,
        s_kt,
        s_kd,
        s_lp,
        s_lw,
        s_lc,
        D,
        0,
        BITS_LOW,
        BLOCK_D,
        G,
        LOW_DISTANCE,
    )
    if PLANES_HIGH > 0 and NUM_HIGH > 0:
        _pack_key_planes(
            keys_ptr,
            order,
            high_ptr + group_out * s_hg,
            scale,
            zero,
            levels,
            group,
            s_kt,
            s_kd,
            s_hp,
            s_hw,
            s_hc,
            NUM_HIGH,
            BITS_LOW,
            PLANES_HIGH,
            BLOCK_D,
            G,
            HIGH_DISTANCE,
        )


@triton.jit
def _pack_key_planes(
    keys_ptr,
    order,
    codes_ptr,
    scale,
    zero,
    levels,
    group,
    s_kt,
    s_kd,
    s_cp,
    s_cw,
    s_cc,
    COUNT: tl.constexpr,
    SHIFT: tl.constexpr,
    PLANES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    G: tl.constexpr,
    DISTANCE: tl.constexpr,
):
    """One codes tensor of :func:`pack_key_group` (``codes_ptr``: its group's first word): planes
    ``SHIFT .. SHIFT + PLANES`` of the codes of stored channels ``0 .. COUNT`` (channel ``c`` of the
    tensor is stored channel ``c``), in the operand order its shape gives it (``DISTANCE``: its
    thread-owned words' tile distance, 0 for byte quads)."""
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < COUNT
    offs_t = tl.arange(0, 32)
    if DISTANCE > 0:
        # Thread-owned words (quantize.py): a block of 2 * DISTANCE tokens is PAIRS word rows; token
        # (tile, tile pair, row half, lane row) of channel (chunk, half, lane column, byte) is, in word
        # (tile pair, 32 chunk + 4 lane row + lane column), a plane's bit 8 byte + 4 tile + 2 half + row
        # half, or a pair's 2-bit field at bits 8 byte + 4 tile + 2 row half (+ 0, 1) of its half's slot.
        PAIRS: tl.constexpr = DISTANCE // 16
        offs_b = tl.arange(0, 2 * DISTANCE)
        half = ((offs_c // 16) % 2)[None, :]
        byte_tile = (8 * (offs_c % 4))[None, :] + (4 * (offs_b // DISTANCE))[:, None]
        plane_position = byte_tile + 2 * half + ((offs_b // 8) % 2)[:, None]
        field_position = byte_tile + (2 * ((offs_b // 8) % 2))[:, None]
        offs_r = tl.arange(0, PAIRS)
        # Where word 32 chunk + 4 lane row + lane column (offs_c) of slot p is stored: in place, but in a
        # last partial chunk compacted (common.compacted_field_word).
        FULL: tl.constexpr = COUNT - COUNT % 32
        PART: tl.constexpr = COUNT % 32
        in_part = (offs_c >= FULL) & (offs_c < FULL + 32)
        block_ptrs = keys_ptr + (group * G + offs_b)[:, None] * s_kt + (order * s_kd)[None, :]
        for block in range(G // (2 * DISTANCE)):
            x = tl.load(block_ptrs + block * 2 * DISTANCE * s_kt, mask=c_mask[None, :], other=0.0).to(tl.float32)
            codes = encode(x, scale[None, :], zero[None, :], levels[None, :]) >> SHIFT
            codes = tl.where(c_mask[None, :], codes, 0)
            for p in tl.static_range(PLANES):
                if p < PLANES - PLANES % 2:  # slot p of pair p // 2: the fields of the channels of half p % 2
                    bits = tl.where(half == p % 2, ((codes >> (p - p % 2)) & 3) << field_position, 0)
                else:
                    bits = ((codes >> p) & 1) << plane_position
                # Distinct bits, so the sums are their OR (bit 31 wraps to the sign, as int32 should).
                bits = tl.reshape(bits, [2, PAIRS, 2, 8, BLOCK_C // 32, 2, 4, 4])
                word = tl.sum(tl.sum(tl.sum(tl.sum(bits, 7), 5), 2), 0)  # [tile pair, lane row, chunk, lane column]
                word = tl.reshape(tl.permute(word, (0, 2, 1, 3)), [PAIRS, BLOCK_C])
                if PART > 0:
                    part_slot, part_column, exists = compacted_field_word(p % 2, offs_c % 32 // 4, offs_c % 4, PART)
                    slot = tl.where(in_part, p - p % 2 + part_slot, p)
                    column = tl.where(in_part, FULL + part_column, offs_c)
                    stored = tl.where(in_part, exists, offs_c < FULL)
                else:
                    slot = p
                    column = offs_c
                    stored = c_mask
                offsets = slot * s_cp + column * s_cc
                tl.store(codes_ptr + offsets[None, :] + (block * PAIRS + offs_r)[:, None] * s_cw, word, mask=stored[None, :])
    else:
        # One 32-token word per channel: the words of each run of four channels byte-transposed, a
        # last run of fewer kept plain.
        in_run = offs_c < 4 * (COUNT // 4)
        row_ptrs = keys_ptr + (group * G + offs_t)[:, None] * s_kt + (order * s_kd)[None, :]
        for w in range(G // 32):
            x = tl.load(row_ptrs + w * 32 * s_kt, mask=c_mask[None, :], other=0.0).to(tl.float32)
            codes = encode(x, scale[None, :], zero[None, :], levels[None, :]) >> SHIFT
            for p in tl.static_range(PLANES):
                # Distinct bits, so the sum is their OR (bit 31 wraps to the sign, as int32 should).
                word = tl.sum(((codes >> p) & 1) << offs_t[:, None], 0)
                word = tl.where(in_run, transpose_byte_quads(word), word)
                tl.store(codes_ptr + p * s_cp + w * s_cw + offs_c * s_cc, word, mask=c_mask)


@triton.jit
def _pack_keys_kernel(
    keys_ptr,
    order_ptr,
    high_ptr,
    low_ptr,
    scale_ptr,
    zero_ptr,
    num_heads,
    s_kb,
    s_kh,
    s_kt,
    s_kd,
    s_ob,
    s_oh,
    s_od,
    s_hb,
    s_hh,
    s_hg,
    s_hp,
    s_hw,
    s_hc,
    s_lb,
    s_lh,
    s_lg,
    s_lp,
    s_lw,
    s_lc,
    s_sb,
    s_sh,
    s_sg,
    s_sd,
    NUM_HIGH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G: tl.constexpr,
    PLANES_HIGH: tl.constexpr,
    BITS_LOW: tl.constexpr,
    MIDPOINT: tl.constexpr,
    HIGH_DISTANCE: tl.constexpr,
    LOW_DISTANCE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    pack_key_group(
        keys_ptr + b * s_kb + h * s_kh,
        order_ptr + b * s_ob + h * s_oh,
        high_ptr + b * s_hb + h * s_hh,
        low_ptr + b * s_lb + h * s_lh,
        scale_ptr + b * s_sb + h * s_sh,
        zero_ptr + b * s_sb + h * s_sh,
        group,
        group,
        s_kt,
        s_kd,
        s_od,
        s_hg,
        s_hp,
        s_hw,
        s_hc,
        s_lg,
        s_lp,
        s_lw,
        s_lc,
        s_sg,
        s_sd,
        NUM_HIGH,
        D,
        BLOCK_D,
        G,
        PLANES_HIGH,
        BITS_LOW,
        MIDPOINT,
        HIGH_DISTANCE,
        LOW_DISTANCE,
    )


def triton_pack_keys(
    keys: torch.Tensor,
    order: torch.Tensor,
    num_high: int,
    group_size: int,
    bits_high: int,
    bits_low: int,
    midpoint_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the key quantizer; same arguments as :func:`pack_keys`, tensors on one device."""
    tokens = keys.shape[2]
    if group_size % 32 or tokens % group_size:
        raise ValueError(f"group_size={group_size} must be a multiple of 32 dividing tokens={tokens}")
    codes_high, codes_low, scale, zero = _empty_outputs(keys, num_high, group_size, bits_high, bits_low)
    if scale.numel():
        launch_pack_keys(keys, order, codes_high, codes_low, scale, zero, midpoint_correction)
    return codes_high, codes_low, scale, zero


def _empty_outputs(keys, num_high, group_size, bits_high, bits_low):
    """Uninitialized ``(codes_high, codes_low, scale, zero)`` of :func:`pack_keys` for ``keys`` (layout:
    the module docstring)."""
    batch, heads, tokens, head_dim = keys.shape
    groups = tokens // group_size
    return (
        keys.new_empty(batch, heads, *key_code_shape(groups, bits_high - bits_low, group_size, num_high), dtype=torch.int32),
        keys.new_empty(batch, heads, *key_code_shape(groups, bits_low, group_size, head_dim), dtype=torch.int32),
        keys.new_empty(batch, heads, groups, head_dim, dtype=scale_dtype_for(keys.dtype)),
        keys.new_empty(batch, heads, groups, head_dim, dtype=scale_dtype_for(keys.dtype)),
    )


def launch_pack_keys(keys, order, codes_high, codes_low, scale, zero, midpoint_correction) -> None:
    """Run the kernel over every group of ``keys`` into the given outputs (layout from the shapes)."""
    batch, heads, tokens, head_dim = keys.shape
    group_size = 32 * codes_high.shape[4]
    _pack_keys_kernel[(batch * heads, tokens // group_size)](
        keys,
        order,
        nonempty(codes_high),
        nonempty(codes_low),
        scale,
        zero,
        heads,
        *keys.stride(),
        *order.stride(),
        *codes_high.stride(),
        *codes_low.stride(),
        *scale.stride(),
        NUM_HIGH=codes_high.shape[-1],
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        G=group_size,
        PLANES_HIGH=codes_high.shape[3],
        BITS_LOW=codes_low.shape[3],
        MIDPOINT=midpoint_correction,
        **key_word_distances(codes_high, codes_low),
        enable_fp_fusion=False,  # see common.py: no fused multiply-add, codes must match torch
    )


@torch.library.custom_op("pnmix::pack_keys", mutates_args=())
def pack_keys(
    keys: torch.Tensor,
    order: torch.Tensor,
    num_high: int,
    group_size: int,
    bits_high: int,
    bits_low: int,
    midpoint_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize and pack keys ``[B, H, T, D]`` (``T`` a multiple of ``group_size``).

    ``order`` is int64 ``[B, H, D]`` = ``channel_order(channel_mask)`` with ``num_high``
    selected channels first. Returns ``quantize_keys``' ``(codes_high, codes_low, scale,
    zero)``. This default implementation is the PyTorch reference; CUDA runs Triton.
    """
    channel_mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
    return quantize_keys(keys, channel_mask, num_high, group_size, bits_high, bits_low, midpoint_correction)


@pack_keys.register_kernel("cuda")
def _pack_keys_cuda(keys, order, num_high, group_size, bits_high, bits_low, midpoint_correction):
    return triton_pack_keys(keys, order, num_high, group_size, bits_high, bits_low, midpoint_correction)


@pack_keys.register_fake
def _pack_keys_fake(keys, order, num_high, group_size, bits_high, bits_low, midpoint_correction):
    return _empty_outputs(keys, num_high, group_size, bits_high, bits_low)
