"""One decode token into the static PN-Mix cache, in place, with no host synchronization.

The static cache (:mod:`pnmix_patch.static_cache`) keeps every tensor at a fixed
address and size, so a decode step can be captured by ``torch.compile`` and CUDA
graphs. Appending a token is then a data-dependent choice made on the device, per
sequence ``b``, from its int32 lengths:

1. sinks not full (``sink_len < S``): the token becomes sink ``sink_len``;
2. else, residual buffer not full: the token is appended to it;
3. else (buffer full): the buffer is quantized into the next ``R / G`` groups at
   slot ``num_groups`` (flush), then the token becomes its first entry; if the
   packed storage has no room left, nothing is written and ``overflowed[b]`` is set
   (the static layer then returns NaN for that sequence rather than a wrong answer).

This is exactly the dynamic cache's rule for one real token (flush a full buffer
before a token joins it), so both caches hold the same codes.

On CUDA three kernels run: the key and value quantizers of ``pack_keys.py`` /
``pack_values.py`` in their in-place mode (a program whose sequence does not flush
now does nothing), then :func:`_append_token_kernel`, one program per sequence,
which writes the token and updates the lengths (after the quantizers have read
them: same stream, launch order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix_patch.quantize import quantize_keys, quantize_values

from .common import nonempty
from .pack_keys import launch_pack_keys
from .pack_values import launch_pack_values

_MUTATED = (
    "sink_keys", "sink_values", "sink_len", "residual_keys", "residual_values", "residual_len",
    "key_codes_high", "key_codes_low", "key_scale", "key_zero",
    "value_codes", "value_scale", "value_zero", "num_groups", "overflowed",
)  # fmt: skip


@triton.jit
def _append_token_kernel(
    key_ptr, value_ptr,
    sink_k_ptr, sink_v_ptr, sink_len_ptr,
    res_k_ptr, res_v_ptr, res_len_ptr,
    num_groups_ptr, overflow_ptr,
    num_heads, sink_cap, residual_cap, group_cap, per_flush,
    s_kb, s_kh, s_vb, s_vh,
    s_skb, s_skh, s_skt, s_svb, s_svh, s_svt,
    s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    sink_len = tl.load(sink_len_ptr + b)
    residual_len = tl.load(res_len_ptr + b)
    num_groups = tl.load(num_groups_ptr + b)
    to_sink = sink_len < sink_cap
    full = (~to_sink) & (residual_len == residual_cap)
    room = num_groups + per_flush <= group_cap
    flushed = full & room  # the quantizers have just packed the buffer
    overflow = full & (~room)
    to_residual = (~to_sink) & (~overflow)
    slot = tl.where(flushed, 0, residual_len).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < D)[None, :]
    key = tl.load(key_ptr + b * s_kb + offs_h[:, None] * s_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + b * s_vb + offs_h[:, None] * s_vh + offs_d[None, :], mask=mask)

    sink_slot = sink_len.to(tl.int64)
    tl.store(sink_k_ptr + b * s_skb + offs_h[:, None] * s_skh + sink_slot * s_skt + offs_d[None, :], key, mask=mask & to_sink)
    tl.store(sink_v_ptr + b * s_svb + offs_h[:, None] * s_svh + sink_slot * s_svt + offs_d[None, :], value, mask=mask & to_sink)
    tl.store(res_k_ptr + b * s_rkb + offs_h[:, None] * s_rkh + slot * s_rkt + offs_d[None, :], key, mask=mask & to_residual)
    tl.store(res_v_ptr + b * s_rvb + offs_h[:, None] * s_rvh + slot * s_rvt + offs_d[None, :], value, mask=mask & to_residual)

    tl.store(sink_len_ptr + b, sink_len + to_sink.to(tl.int32))
    tl.store(res_len_ptr + b, tl.where(to_residual, slot.to(tl.int32) + 1, residual_len))
    tl.store(num_groups_ptr + b, num_groups + tl.where(flushed, per_flush, 0))
    tl.store(overflow_ptr + b, tl.load(overflow_ptr + b) | overflow)


def triton_decode_append(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed,
    midpoint_correction: bool,
) -> None:
    """Launch the in-place flush (if the cache has packed storage) and the append kernel."""
    batch, heads, head_dim = key.shape
    sink_cap, residual_cap = sink_keys.shape[2], residual_keys.shape[2]
    group_size = 32 * key_codes_high.shape[4]
    group_cap = key_scale.shape[2]
    if group_cap:
        flush_state = (sink_len, residual_len, num_groups, sink_cap, group_cap, group_size)
        launch_pack_keys(
            residual_keys, order, key_codes_high, key_codes_low, key_scale, key_zero, midpoint_correction, flush_state
        )
        launch_pack_values(residual_values, value_codes, value_scale, value_zero, midpoint_correction, flush_state)
    key, value = key.contiguous(), value.contiguous()
    sinks_k, sinks_v = nonempty(sink_keys), nonempty(sink_values)
    _append_token_kernel[(batch,)](
        key, value, sinks_k, sinks_v, sink_len,
        residual_keys, residual_values, residual_len,
        num_groups, overflowed,
        heads, sink_cap, residual_cap, group_cap, residual_cap // group_size,
        *key.stride()[:2], *value.stride()[:2],
        *sinks_k.stride()[:3], *sinks_v.stride()[:3],
        *residual_keys.stride()[:3], *residual_values.stride()[:3],
        D=head_dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def decode_append_reference(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed,
    midpoint_correction: bool,
) -> None:
    """PyTorch reference of the three steps in the module docstring, sequence by sequence."""
    sink_cap, residual_cap = sink_keys.shape[2], residual_keys.shape[2]
    num_high, group_size = key_codes_high.shape[-1], 32 * key_codes_high.shape[4]
    per_flush = residual_cap // group_size
    for b in range(key.shape[0]):
        if sink_len[b] < sink_cap:
            sink_keys[b, :, sink_len[b]] = key[b]
            sink_values[b, :, sink_len[b]] = value[b]
            sink_len[b] += 1
            continue
        if residual_len[b] == residual_cap:
            if num_groups[b] + per_flush > key_scale.shape[2]:
                overflowed[b] = True
                continue
            groups = slice(int(num_groups[b]), int(num_groups[b]) + per_flush)
            tokens = slice(groups.start * group_size, groups.stop * group_size)
            channel_mask = torch.zeros_like(order[b : b + 1], dtype=torch.bool).scatter_(-1, order[b : b + 1, :, :num_high], True)
            high, low, scale, zero = quantize_keys(
                residual_keys[b : b + 1], channel_mask, num_high, group_size,
                key_codes_high.shape[3], key_codes_low.shape[3], midpoint_correction,
            )  # fmt: skip
            key_codes_high[b, :, groups], key_codes_low[b, :, groups] = high[0], low[0]
            key_scale[b, :, groups], key_zero[b, :, groups] = scale[0], zero[0]
            codes, scale, zero = quantize_values(
                residual_values[b : b + 1], value_codes.shape[3], key.shape[-1] // value_scale.shape[-1], midpoint_correction
            )
            value_codes[b, :, tokens], value_scale[b, :, tokens], value_zero[b, :, tokens] = codes[0], scale[0], zero[0]
            num_groups[b] += per_flush
            residual_len[b] = 0
        residual_keys[b, :, residual_len[b]] = key[b]
        residual_values[b, :, residual_len[b]] = value[b]
        residual_len[b] += 1


@torch.library.custom_op("pnmix::decode_append", mutates_args=_MUTATED)
def decode_append(
    key: torch.Tensor,
    value: torch.Tensor,
    order: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    sink_len: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_len: torch.Tensor,
    key_codes_high: torch.Tensor,
    key_codes_low: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    num_groups: torch.Tensor,
    overflowed: torch.Tensor,
    midpoint_correction: bool,
) -> None:
    """Append one token per sequence (``key/value [B, H, D]``) to a static PN-Mix cache, in place.

    ``order`` int64 ``[B, H, D]`` is the stored channel order; the other tensors are
    the static layer's storage (``pnmix_patch.static_cache``), ``overflowed`` bool ``[B]``.
    The layout (bits, group size, capacities) is read from the shapes. This default
    implementation is :func:`decode_append_reference`; CUDA runs Triton.
    """
    decode_append_reference(
        key, value, order, sink_keys, sink_values, sink_len,
        residual_keys, residual_values, residual_len,
        key_codes_high, key_codes_low, key_scale, key_zero,
        value_codes, value_scale, value_zero, num_groups, overflowed, midpoint_correction,
    )  # fmt: skip


@decode_append.register_kernel("cuda")
def _decode_append_cuda(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed, midpoint_correction,
):
    triton_decode_append(
        key, value, order, sink_keys, sink_values, sink_len,
        residual_keys, residual_values, residual_len,
        key_codes_high, key_codes_low, key_scale, key_zero,
        value_codes, value_scale, value_zero, num_groups, overflowed, midpoint_correction,
    )  # fmt: skip


@decode_append.register_fake
def _decode_append_fake(*args):
    return None
