"""Triton value quantizer: per-token min-max over groups of channels, packed into bit planes and 2-bit fields.

Produces exactly :func:`pnmix_patch.reference.quantize.quantize_values` (same shapes and dtypes,
bit-identical codes, scales and zeros). Used when the residual buffer is flushed.

One program quantizes ``BLOCK_T`` tokens of one (sequence, KV head). A token's
``D`` channels are viewed as a ``[D / Gv, Gv]`` tile (padded to powers of two and
masked), so each channel group reduces along the last axis. Codes are packed along
channels: bit ``c % 32`` of word ``c // 32`` of plane ``p`` is bit ``p`` of channel
``c``'s code, i.e. ``codes [B, H, T, b_V, D/32]``; ``scale/zero [B, H, T, D/Gv]``. The
words are written in operand order per block of ``token_block`` tokens (``quantize.py``):
pairs of planes as 2-bit field words, each run of four tokens' words byte-transposed, a
block's words stored ``[b_V * D/32, 4, token_block/4]``; the tokens of a last, partial block
keep plain words.
Limits: ``D`` a multiple of 32, ``Gv`` dividing ``D``, bits <= 8, ``token_block`` a
multiple of 4; the codes contiguous below the head dim.

The per-token work is the device function :func:`pack_value_tokens`, which the
static cache's fused decode append (``decode_append.py``) also calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix_patch.reference.quantize import FIELD_SIGN_FLIP as _FIELD_SIGN_FLIP
from pnmix_patch.reference.quantize import check_token_block, quantize_values, scale_dtype_for

from .common import encode, minmax_scale_zero, transpose_byte_quads

BLOCK_T = 16
"""Tokens per program: a multiple of 4 (the runs of four tokens whose words are transposed)."""
FIELD_SIGN_FLIP = tl.constexpr(_FIELD_SIGN_FLIP)


@triton.jit
def pack_value_tokens(
    values_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    offs_t,
    t_mask,
    offs_out,
    in_full_block,
    s_vt,
    s_vd,
    s_st,
    s_sg,
    D: tl.constexpr,
    GV: tl.constexpr,
    NG_PAD: tl.constexpr,
    GV_PAD: tl.constexpr,
    BITS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    TOKEN_BLOCK: tl.constexpr,
):
    """Quantize the tokens ``offs_t`` (where ``t_mask``) of one (sequence, KV head) into
    the token slots ``offs_out``, consecutive from a multiple of 4 (so are ``offs_t``); the
    slots ``in_full_block`` (whole blocks of ``TOKEN_BLOCK``) get operand order, the others
    plain words. The pointers are that head's bases; the codes are contiguous below it."""
    # Channel c = group * GV + i as a [NG_PAD, GV_PAD] tile.
    offs_g = tl.arange(0, NG_PAD)
    offs_i = tl.arange(0, GV_PAD)
    channel = offs_g[:, None] * GV + offs_i[None, :]
    c_mask = (offs_g[:, None] < D // GV) & (offs_i[None, :] < GV)
    mask = t_mask[:, None, None] & c_mask[None, :, :]

    x_ptrs = values_ptr + offs_t[:, None, None] * s_vt + channel[None, :, :] * s_vd
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    low = tl.min(tl.where(mask, x, float("inf")), 2)
    high = tl.max(tl.where(mask, x, float("-inf")), 2)
    nonfinite = tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), 2)  # masked x is 0
    levels = 2.0**BITS - 1.0
    scale, zero = minmax_scale_zero(low, high, nonfinite, levels, MIDPOINT)

    param_offs = offs_out[:, None] * s_st + offs_g[None, :] * s_sg
    param_mask = t_mask[:, None] & (offs_g[None, :] < D // GV)
    scale = scale.to(scale_ptr.dtype.element_ty)
    zero = zero.to(zero_ptr.dtype.element_ty)
    tl.store(scale_ptr + param_offs, scale, mask=param_mask)
    tl.store(zero_ptr + param_offs, zero, mask=param_mask)

    codes = encode(x, scale.to(tl.float32)[:, :, None], zero.to(tl.float32)[:, :, None], levels)
    # Word column c of slot t (plain: c = p * D/32 + w, plane p; operand order: the same columns
    # with plane pairs as field words): plain at t * BITS * D/32 + c; in operand order, in block
    # t // TOKEN_BLOCK at (c * 4 + t % 4) * TOKEN_BLOCK/4 + (t % TOKEN_BLOCK) // 4, transposed.
    # Sums of distinct bits are their OR (bit 31 wraps to the sign, as int32 should).
    within = offs_out % TOKEN_BLOCK
    plain_base = codes_ptr + offs_out * (BITS * (D // 32))
    block_base = codes_ptr + (offs_out - within) * (BITS * (D // 32)) + (within % 4) * (TOKEN_BLOCK // 4) + within // 4
    PAIRED_PLANES: tl.constexpr = BITS - BITS % 2
    for w in tl.static_range(D // 32):
        in_word = ((channel // 32) == w) & c_mask
        for p in tl.static_range(BITS):
            bits = tl.where(in_word[None, :, :], ((codes >> p) & 1) << (channel % 32)[None, :, :], 0)
            word = tl.sum(tl.sum(bits, 2), 1)
            column = p * (D // 32) + w
            tl.store(plain_base + column, word, mask=t_mask & ~in_full_block)
            if p >= PAIRED_PLANES:  # an odd last plane stays a plane in operand order
                tl.store(block_base + column * TOKEN_BLOCK, transpose_byte_quads(word), mask=t_mask & in_full_block)
    # Plane pairs (2m, 2m + 1) as 2-bit fields: channel 16u + k at bits 2k, 2k + 1 of field word u
    # (column m * D/16 + u), bit 7 of every byte inverted (quantize.planes_to_fields).
    for m in tl.static_range(BITS // 2):
        for u in tl.static_range(D // 16):
            in_word = ((channel // 16) == u) & c_mask
            fields = tl.where(in_word[None, :, :], ((codes >> (2 * m)) & 3) << (2 * (channel % 16))[None, :, :], 0)
            word = tl.sum(tl.sum(fields, 2), 1) ^ FIELD_SIGN_FLIP
            column = m * (D // 16) + u
            tl.store(block_base + column * TOKEN_BLOCK, transpose_byte_quads(word), mask=t_mask & in_full_block)


@triton.jit
def _pack_values_kernel(
    values_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    num_heads,
    num_tokens,
    s_vb,
    s_vh,
    s_vt,
    s_vd,
    s_cb,
    s_ch,
    s_sb,
    s_sh,
    s_st,
    s_sg,
    D: tl.constexpr,
    GV: tl.constexpr,
    NG_PAD: tl.constexpr,
    GV_PAD: tl.constexpr,
    BITS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TOKEN_BLOCK: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    pack_value_tokens(
        values_ptr + b * s_vb + h * s_vh,
        codes_ptr + b * s_cb + h * s_ch,
        scale_ptr + b * s_sb + h * s_sh,
        zero_ptr + b * s_sb + h * s_sh,
        offs_t,
        offs_t < num_tokens,
        offs_t,
        (offs_t // TOKEN_BLOCK + 1) * TOKEN_BLOCK <= num_tokens,
        s_vt,
        s_vd,
        s_st,
        s_sg,
        D,
        GV,
        NG_PAD,
        GV_PAD,
        BITS,
        MIDPOINT,
        TOKEN_BLOCK,
    )


def triton_pack_values(
    values: torch.Tensor, bits: int, group_size: int, midpoint_correction: bool, token_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the value quantizer; same arguments as :func:`pack_values`."""
    batch, heads, tokens, head_dim = values.shape
    if head_dim % 32 or head_dim % group_size:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 32 and of group_size={group_size}")
    check_token_block(token_block)
    num_groups = head_dim // group_size
    codes = values.new_empty(batch, heads, tokens, bits, head_dim // 32, dtype=torch.int32)
    scale = values.new_empty(batch, heads, tokens, num_groups, dtype=scale_dtype_for(values.dtype))
    zero = torch.empty_like(scale)
    if scale.numel():
        launch_pack_values(values, codes, scale, zero, midpoint_correction, token_block)
    return codes, scale, zero


def launch_pack_values(values, codes, scale, zero, midpoint_correction, token_block) -> None:
    """Run the kernel over every token of ``values`` into the given outputs (codes contiguous below the head dim)."""
    batch, heads, tokens, head_dim = values.shape
    channel_groups = scale.shape[-1]
    _pack_values_kernel[(batch * heads, triton.cdiv(tokens, BLOCK_T))](
        values,
        codes,
        scale,
        zero,
        heads,
        tokens,
        *values.stride(),
        *codes.stride()[:2],
        *scale.stride(),
        **value_layout(head_dim, channel_groups, codes.shape[3]),
        MIDPOINT=midpoint_correction,
        BLOCK_T=BLOCK_T,
        TOKEN_BLOCK=token_block,
        enable_fp_fusion=False,  # see common.py: no fused multiply-add, codes must match torch
    )


def value_layout(head_dim: int, channel_groups: int, bits: int) -> dict:
    """The layout constants of :func:`pack_value_tokens`."""
    group = head_dim // channel_groups
    return dict(
        D=head_dim,
        GV=group,
        NG_PAD=triton.next_power_of_2(channel_groups),
        GV_PAD=triton.next_power_of_2(group),
        BITS=bits,
    )


@torch.library.custom_op("pnmix::pack_values", mutates_args=())
def pack_values(
    values: torch.Tensor, bits: int, group_size: int, midpoint_correction: bool, token_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize and pack values ``[B, H, T, D]`` per token over groups of ``group_size`` channels,
    the codes in operand order per block of ``token_block`` tokens (the key group size).

    Returns ``quantize_values``' ``(codes, scale, zero)``. This default implementation
    is the PyTorch reference; CUDA runs Triton.
    """
    return quantize_values(values, bits, group_size, midpoint_correction, token_block)


@pack_values.register_kernel("cuda")
def _pack_values_cuda(values, bits, group_size, midpoint_correction, token_block):
    return triton_pack_values(values, bits, group_size, midpoint_correction, token_block)


@pack_values.register_fake
def _pack_values_fake(values, bits, group_size, midpoint_correction, token_block):
    batch, heads, tokens, head_dim = values.shape
    scale = values.new_empty(batch, heads, tokens, head_dim // group_size, dtype=scale_dtype_for(values.dtype))
    return (
        values.new_empty(batch, heads, tokens, bits, head_dim // 32, dtype=torch.int32),
        scale,
        torch.empty_like(scale),
    )
