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

On CUDA one kernel does all of it (one launch per layer and step, which matters for
single-stream decoding, where the step is a chain of tiny kernels):
:func:`_append_token_kernel`, one program per (sequence, KV head). Every program
decides from the lengths; a program whose sequence must flush quantizes its own head's
buffer with the device functions of ``pack_keys.py`` / ``pack_values.py`` (the heads
of a sequence flush in parallel), waits for its threads (the buffer's first slot is
overwritten next), then writes its head's token. The lengths are shared by the heads
of a sequence, so they change only after every head has read them: each program
counts itself in ``arrivals[b]`` (an atomic add), and the last of the sequence's
programs to arrive writes the new lengths and sets the counter back to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix_patch.quantize import quantize_keys, quantize_values

from .common import launch_pdl, let_next_kernel_launch, nonempty, wait_for_previous_kernel
from .pack_keys import pack_key_group
from .pack_values import BLOCK_T, pack_value_tokens, value_layout

_MUTATED = (
    "sink_keys", "sink_values", "sink_len", "residual_keys", "residual_values", "residual_len",
    "key_codes_high", "key_codes_low", "key_scale", "key_zero",
    "value_codes", "value_scale", "value_zero", "num_groups", "overflowed", "arrivals",
)  # fmt: skip


@triton.jit
def _append_token_kernel(
    key_ptr, value_ptr, order_ptr,
    sink_k_ptr, sink_v_ptr, sink_len_ptr,
    res_k_ptr, res_v_ptr, res_len_ptr,
    high_ptr, low_ptr, k_scale_ptr, k_zero_ptr, vc_ptr, v_scale_ptr, v_zero_ptr,
    num_groups_ptr, overflow_ptr, arrivals_ptr,
    num_heads, sink_cap, residual_cap, group_cap, per_flush,
    s_kb, s_kh, s_vb, s_vh, s_ob, s_oh, s_od,
    s_skb, s_skh, s_skt, s_svb, s_svh, s_svt,
    s_rkb, s_rkh, s_rkt, s_rkd, s_rvb, s_rvh, s_rvt, s_rvd,
    s_hb, s_hh, s_hg, s_hp, s_hw, s_hc,
    s_lb, s_lh, s_lg, s_lp, s_lw, s_lc,
    s_sb, s_sh, s_sg, s_sd,
    s_cb, s_ch, s_ct, s_cp, s_cw,
    s_vsb, s_vsh, s_vst, s_vsg,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_HIGH: tl.constexpr, G: tl.constexpr, BITS_HIGH: tl.constexpr, BITS_LOW: tl.constexpr,
    GV: tl.constexpr, NG_PAD: tl.constexpr, GV_PAD: tl.constexpr, BITS: tl.constexpr,
    MIDPOINT: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    wait_for_previous_kernel(PDL)
    sink_len = tl.load(sink_len_ptr + b)
    residual_len = tl.load(res_len_ptr + b)
    num_groups = tl.load(num_groups_ptr + b)
    to_sink = sink_len < sink_cap
    full = (~to_sink) & (residual_len == residual_cap)
    room = num_groups + per_flush <= group_cap
    flushed = full & room
    overflow = full & (~room)
    to_residual = (~to_sink) & (~overflow)
    slot = tl.where(flushed, 0, residual_len).to(tl.int64)

    res_k = res_k_ptr + b * s_rkb + h * s_rkh
    res_v = res_v_ptr + b * s_rvb + h * s_rvh
    if flushed:
        # Quantize this head's full buffer into groups num_groups .. num_groups + per_flush.
        for group in range(per_flush):
            pack_key_group(
                res_k, order_ptr + b * s_ob + h * s_oh,
                high_ptr + b * s_hb + h * s_hh, low_ptr + b * s_lb + h * s_lh,
                k_scale_ptr + b * s_sb + h * s_sh, k_zero_ptr + b * s_sb + h * s_sh,
                group, num_groups + group,
                s_rkt, s_rkd, s_od, s_hg, s_hp, s_hw, s_hc, s_lg, s_lp, s_lw, s_lc, s_sg, s_sd,
                NUM_HIGH, D, BLOCK_D, G, BITS_HIGH, BITS_LOW, MIDPOINT,
            )
        offs_t = tl.arange(0, BLOCK_T)
        for start in range(0, residual_cap, BLOCK_T):
            tokens = start + offs_t
            pack_value_tokens(
                res_v, vc_ptr + b * s_cb + h * s_ch,
                v_scale_ptr + b * s_vsb + h * s_vsh, v_zero_ptr + b * s_vsb + h * s_vsh,
                tokens, tokens < residual_cap, num_groups.to(tl.int64) * G + tokens,
                s_rvt, s_rvd, s_ct, s_cp, s_cw, s_vst, s_vsg, D, GV, NG_PAD, GV_PAD, BITS, MIDPOINT,
            )
        tl.debug_barrier()  # every thread has read the buffer before slot 0 is overwritten

    let_next_kernel_launch(PDL)  # after the flush: the attention's programs start while this one appends
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    key = tl.load(key_ptr + b * s_kb + h * s_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + b * s_vb + h * s_vh + offs_d, mask=mask)
    sink_slot = sink_len.to(tl.int64)
    tl.store(sink_k_ptr + b * s_skb + h * s_skh + sink_slot * s_skt + offs_d, key, mask=mask & to_sink)
    tl.store(sink_v_ptr + b * s_svb + h * s_svh + sink_slot * s_svt + offs_d, value, mask=mask & to_sink)
    tl.store(res_k + slot * s_rkt + offs_d * s_rkd, key, mask=mask & to_residual)
    tl.store(res_v + slot * s_rvt + offs_d * s_rvd, value, mask=mask & to_residual)

    # The last program of sequence b to get here writes its lengths. The barrier orders this
    # program's reads of the lengths (every thread's) before its arrival is counted.
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + b, 1) == num_heads - 1:
        tl.store(sink_len_ptr + b, sink_len + to_sink.to(tl.int32))
        tl.store(res_len_ptr + b, tl.where(to_residual, slot.to(tl.int32) + 1, residual_len))
        tl.store(num_groups_ptr + b, num_groups + tl.where(flushed, per_flush, 0))
        tl.store(overflow_ptr + b, tl.load(overflow_ptr + b) | overflow)
        tl.store(arrivals_ptr + b, 0)


def triton_decode_append(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed, arrivals,
    midpoint_correction: bool,
) -> None:
    """Launch the fused flush-and-append kernel, one program per (sequence, KV head)."""
    batch, heads, head_dim = key.shape
    sink_cap, residual_cap = sink_keys.shape[2], residual_keys.shape[2]
    group_size = 32 * key_codes_high.shape[4]
    group_cap = key_scale.shape[2]
    key, value = key.contiguous(), value.contiguous()
    sinks_k, sinks_v = nonempty(sink_keys), nonempty(sink_values)
    residual_k, residual_v = nonempty(residual_keys), nonempty(residual_values)
    high, low = nonempty(key_codes_high), nonempty(key_codes_low)
    k_scale, k_zero, v_codes = nonempty(key_scale), nonempty(key_zero), nonempty(value_codes)
    v_scale, v_zero = nonempty(value_scale), nonempty(value_zero)
    pdl = launch_pdl(key)
    _append_token_kernel[(batch, heads)](
        key, value, order, sinks_k, sinks_v, sink_len,
        residual_k, residual_v, residual_len,
        high, low, k_scale, k_zero, v_codes, v_scale, v_zero,
        num_groups, overflowed, arrivals,
        heads, sink_cap, residual_cap, group_cap, residual_cap // group_size,
        *key.stride()[:2], *value.stride()[:2], *order.stride(),
        *sink_keys.stride()[:3], *sink_values.stride()[:3],
        *residual_keys.stride(), *residual_values.stride(),
        *key_codes_high.stride(), *key_codes_low.stride(), *key_scale.stride(), *value_codes.stride(),
        *value_scale.stride(),
        BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_HIGH=key_codes_high.shape[-1], G=group_size,
        BITS_HIGH=key_codes_high.shape[3], BITS_LOW=key_codes_low.shape[3],
        **value_layout(head_dim, value_scale.shape[-1], value_codes.shape[3]),  # D, GV, ...
        MIDPOINT=midpoint_correction, BLOCK_T=BLOCK_T, PDL=pdl, launch_pdl=pdl,
        enable_fp_fusion=False,  # the quantizers' codes must match torch (kernels/common.py)
    )  # fmt: skip


def decode_append_reference(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed, arrivals,
    midpoint_correction: bool,
) -> None:
    """PyTorch reference of the three steps in the module docstring, sequence by sequence.
    ``arrivals`` (the CUDA kernel's counter, zero between steps) is not used."""
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
    arrivals: torch.Tensor,
    midpoint_correction: bool,
) -> None:
    """Append one token per sequence (``key/value [B, H, D]``) to a static PN-Mix cache, in place.

    ``order`` int64 ``[B, H, D]`` is the stored channel order; the other tensors are
    the static layer's storage (``pnmix_patch.static_cache``), ``overflowed`` bool ``[B]``;
    ``arrivals`` int32 ``[B]``, zero between calls, is the CUDA kernel's count of the heads
    done with a sequence (module docstring).
    The layout (bits, group size, capacities) is read from the shapes. This default
    implementation is :func:`decode_append_reference`; CUDA runs Triton.
    """
    decode_append_reference(
        key, value, order, sink_keys, sink_values, sink_len,
        residual_keys, residual_values, residual_len,
        key_codes_high, key_codes_low, key_scale, key_zero,
        value_codes, value_scale, value_zero, num_groups, overflowed, arrivals, midpoint_correction,
    )  # fmt: skip


@decode_append.register_kernel("cuda")
def _decode_append_cuda(
    key, value, order, sink_keys, sink_values, sink_len,
    residual_keys, residual_values, residual_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups, overflowed, arrivals, midpoint_correction,
):
    triton_decode_append(
        key, value, order, sink_keys, sink_values, sink_len,
        residual_keys, residual_values, residual_len,
        key_codes_high, key_codes_low, key_scale, key_zero,
        value_codes, value_scale, value_zero, num_groups, overflowed, arrivals, midpoint_correction,
    )  # fmt: skip


@decode_append.register_fake
def _decode_append_fake(*args):
    return None
