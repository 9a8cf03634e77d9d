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

``pnmix::decode_rotate_append`` takes the token's query and key before the q/k norms (Qwen3)
and RoPE and does those too, in the same programs (each also rotates the query heads of its
KV head) and returns the rotated queries: at batch 1 a decode step is a chain of a few
hundred short kernels, and compiled on their own, the norms and RoPE of queries and keys take
two of them per layer besides this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pnmix_patch.reference.quantize import quantize_keys, quantize_values

from .common import key_word_distances, launch_pdl, let_next_kernel_launch, nonempty, wait_for_previous_kernel
from .pack_keys import pack_key_group
from .pack_values import BLOCK_T, pack_value_tokens, value_layout

_MUTATED = (
    "sink_keys",
    "sink_values",
    "sink_len",
    "residual_keys",
    "residual_values",
    "residual_len",
    "key_codes_high",
    "key_codes_low",
    "key_scale",
    "key_zero",
    "value_codes",
    "value_scale",
    "value_zero",
    "num_groups",
    "overflowed",
    "arrivals",
)


@triton.jit
def _rotate_rows(
    base,
    row_stride,
    rows,
    row_mask,
    offs_d,
    partner,
    sign,
    d_mask,
    cos,
    sin,
    weight,
    weight_partner,
    eps,
    D: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rows ``[R, BLOCK_D]`` at ``base + rows * row_stride`` through transformers' RMSNorm (``NORM``:
    float32 variance and scale, back to the input dtype, times the weight) and RoPE with the
    rotate_half pairing (channel ``d`` pairs with ``partner = (d + D/2) % D``, ``sign`` -1 below
    ``D/2``). Every product and sum is rounded to the input dtype, as eager torch rounds them; the sum of
    squares may add in another order than torch's (an ulp apart in float32)."""
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(base + rows[:, None] * row_stride + offs_d[None, :], mask=mask, other=0.0)
    x_partner = tl.load(base + rows[:, None] * row_stride + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x, x_partner = x.to(tl.float32), x_partner.to(tl.float32)
    if NORM:
        # Correctly rounded: torch.rsqrt on CPU; CUDA's eager rsqrt may differ from it by an ulp.
        inverse_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, 1), D * 1.0) + eps))[:, None]
        x = (weight[None, :] * (x * inverse_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_partner = (weight_partner[None, :] * (x_partner * inverse_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated = (x * cos[None, :]).to(dtype).to(tl.float32) + (sign[None, :] * x_partner * sin[None, :]).to(dtype).to(tl.float32)
    return rotated.to(dtype)


@triton.jit
def _append_token_kernel(
    key_ptr,
    value_ptr,
    order_ptr,
    sink_k_ptr,
    sink_v_ptr,
    sink_len_ptr,
    res_k_ptr,
    res_v_ptr,
    res_len_ptr,
    high_ptr,
    low_ptr,
    k_scale_ptr,
    k_zero_ptr,
    vc_ptr,
    v_scale_ptr,
    v_zero_ptr,
    num_groups_ptr,
    overflow_ptr,
    arrivals_ptr,
    query_ptr,
    query_out_ptr,
    cos_ptr,
    sin_ptr,
    query_weight_ptr,
    key_weight_ptr,
    eps,
    s_qb,
    s_qh,
    s_qob,
    s_qoh,
    s_cosb,
    s_sinb,
    num_heads,
    sink_cap,
    residual_cap,
    group_cap,
    per_flush,
    s_kb,
    s_kh,
    s_vb,
    s_vh,
    s_ob,
    s_oh,
    s_od,
    s_skb,
    s_skh,
    s_skt,
    s_svb,
    s_svh,
    s_svt,
    s_rkb,
    s_rkh,
    s_rkt,
    s_rkd,
    s_rvb,
    s_rvh,
    s_rvt,
    s_rvd,
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
    s_cb,
    s_ch,
    s_vsb,
    s_vsh,
    s_vst,
    s_vsg,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_HIGH: tl.constexpr,
    G: tl.constexpr,
    PLANES_HIGH: tl.constexpr,
    BITS_LOW: tl.constexpr,
    GV: tl.constexpr,
    NG_PAD: tl.constexpr,
    GV_PAD: tl.constexpr,
    BITS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HIGH_DISTANCE: tl.constexpr,
    LOW_DISTANCE: tl.constexpr,
    ROTATE: tl.constexpr = False,
    NORM: tl.constexpr = False,
    RATIO: tl.constexpr = 1,
    BLOCK_R: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    wait_for_previous_kernel(PDL)
    # The token is read before the lengths, not after them: at batch 1 the kernel is a chain of
    # memory latencies, and the token does not depend on the lengths (nor does the flush touch it).
    if ROTATE:
        partner = (offs_d + D // 2) % D
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * s_cosb + offs_d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * s_sinb + offs_d, mask=mask, other=0.0).to(tl.float32)
        # Without NORM the weights are not read: any tensor of their shape stands in.
        query_weight, query_weight_partner, key_weight, key_weight_partner = cos, cos, cos, cos
        if NORM:
            query_weight = tl.load(query_weight_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
            query_weight_partner = tl.load(query_weight_ptr + partner, mask=mask, other=0.0).to(tl.float32)
            key_weight = tl.load(key_weight_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
            key_weight_partner = tl.load(key_weight_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        # This KV head's query heads h * RATIO .. h * RATIO + RATIO - 1.
        rows = tl.arange(0, BLOCK_R)
        query = _rotate_rows(
            query_ptr + b * s_qb + h * RATIO * s_qh,
            s_qh,
            rows,
            rows < RATIO,
            offs_d,
            partner,
            sign,
            mask,
            cos,
            sin,
            query_weight,
            query_weight_partner,
            eps,
            D,
            NORM,
        )
        out = query_out_ptr + b * s_qob + (h * RATIO + rows[:, None]) * s_qoh + offs_d[None, :]
        tl.store(out, query, mask=(rows < RATIO)[:, None] & mask[None, :])
        one_row = tl.arange(0, 1)
        key = _rotate_rows(
            key_ptr + b * s_kb + h * s_kh,
            0,
            one_row,
            one_row < 1,
            offs_d,
            partner,
            sign,
            mask,
            cos,
            sin,
            key_weight,
            key_weight_partner,
            eps,
            D,
            NORM,
        )
    else:
        key = tl.expand_dims(tl.load(key_ptr + b * s_kb + h * s_kh + offs_d, mask=mask), 0)  # [1, BLOCK_D] as rotated
    value = tl.load(value_ptr + b * s_vb + h * s_vh + offs_d, mask=mask)
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
                res_k,
                order_ptr + b * s_ob + h * s_oh,
                high_ptr + b * s_hb + h * s_hh,
                low_ptr + b * s_lb + h * s_lh,
                k_scale_ptr + b * s_sb + h * s_sh,
                k_zero_ptr + b * s_sb + h * s_sh,
                group,
                num_groups + group,
                s_rkt,
                s_rkd,
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
        offs_t = tl.arange(0, BLOCK_T)
        for start in range(0, residual_cap, BLOCK_T):
            tokens = start + offs_t
            pack_value_tokens(
                res_v,
                vc_ptr + b * s_cb + h * s_ch,
                v_scale_ptr + b * s_vsb + h * s_vsh,
                v_zero_ptr + b * s_vsb + h * s_vsh,
                tokens,
                tokens < residual_cap,
                num_groups.to(tl.int64) * G + tokens,
                tokens < residual_cap,
                s_rvt,
                s_rvd,
                s_vst,
                s_vsg,
                D,
                GV,
                NG_PAD,
                GV_PAD,
                BITS,
                MIDPOINT,
                G,
            )
        tl.debug_barrier()  # every thread has read the buffer before slot 0 is overwritten

    let_next_kernel_launch(PDL)  # after the flush: the attention's programs start while this one appends
    sink_slot = sink_len.to(tl.int64)
    tl.store(sink_k_ptr + b * s_skb + h * s_skh + sink_slot * s_skt + offs_d[None, :], key, mask=mask[None, :] & to_sink)
    tl.store(sink_v_ptr + b * s_svb + h * s_svh + sink_slot * s_svt + offs_d, value, mask=mask & to_sink)
    tl.store(res_k + slot * s_rkt + offs_d[None, :] * s_rkd, key, mask=mask[None, :] & to_residual)
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
    key,
    value,
    order,
    sink_keys,
    sink_values,
    sink_len,
    residual_keys,
    residual_values,
    residual_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    overflowed,
    arrivals,
    midpoint_correction: bool,
    rotation: tuple | None = None,
) -> torch.Tensor | None:
    """Launch the fused flush-and-append kernel, one program per (sequence, KV head). ``rotation``:
    ``(query, cos, sin, query_norm_weight, key_norm_weight, norm_eps)`` of :func:`decode_rotate_append`
    (the key is then taken before its norm and RoPE); returns the rotated queries then, else None."""
    batch, heads, head_dim = key.shape
    sink_cap, residual_cap = sink_keys.shape[2], residual_keys.shape[2]
    group_size = 32 * key_codes_high.shape[4]
    group_cap = key_scale.shape[2]
    words = value_codes.shape[3] * value_codes.shape[4]
    if value_codes.stride()[2:] != (words, value_codes.shape[4], 1):
        raise ValueError(
            "value_codes must be contiguous below the head dim (the flush writes a group's words in operand order "
            f"by offset); got strides {tuple(value_codes.stride())} for shape {tuple(value_codes.shape)}"
        )
    key, value = key.contiguous(), value.contiguous()
    sinks_k, sinks_v = nonempty(sink_keys), nonempty(sink_values)
    residual_k, residual_v = nonempty(residual_keys), nonempty(residual_values)
    high, low = nonempty(key_codes_high), nonempty(key_codes_low)
    k_scale, k_zero, v_codes = nonempty(key_scale), nonempty(key_zero), nonempty(value_codes)
    v_scale, v_zero = nonempty(value_scale), nonempty(value_zero)
    if rotation is None:  # the rotation's arguments are not read: the key stands in for each
        query_out, constants, rotation_args = None, {}, (key, key, key, key, key, key, 0.0, 0, 0, 0, 0, 0, 0)
    else:
        query, cos, sin, query_weight, key_weight, eps = rotation
        check_rotation(query, key, cos, sin, query_weight, key_weight)
        query, cos, sin = query.contiguous(), cos.contiguous(), sin.contiguous()
        query_out = torch.empty_like(query)
        ratio = query.shape[1] // heads
        constants = dict(ROTATE=True, NORM=query_weight is not None, RATIO=ratio, BLOCK_R=triton.next_power_of_2(ratio))
        rotation_args = (
            query,
            query_out,
            cos,
            sin,
            key if query_weight is None else query_weight,
            key if key_weight is None else key_weight,
            eps,
            *query.stride()[:2],
            *query_out.stride()[:2],
            cos.stride(0) if cos.shape[0] > 1 else 0,
            sin.stride(0) if sin.shape[0] > 1 else 0,  # [1, 1, D]: one position for all
        )
    pdl = launch_pdl(key)
    _append_token_kernel[(batch, heads)](
        key,
        value,
        order,
        sinks_k,
        sinks_v,
        sink_len,
        residual_k,
        residual_v,
        residual_len,
        high,
        low,
        k_scale,
        k_zero,
        v_codes,
        v_scale,
        v_zero,
        num_groups,
        overflowed,
        arrivals,
        *rotation_args,
        heads,
        sink_cap,
        residual_cap,
        group_cap,
        residual_cap // group_size,
        *key.stride()[:2],
        *value.stride()[:2],
        *order.stride(),
        *sink_keys.stride()[:3],
        *sink_values.stride()[:3],
        *residual_keys.stride(),
        *residual_values.stride(),
        *key_codes_high.stride(),
        *key_codes_low.stride(),
        *key_scale.stride(),
        *value_codes.stride()[:2],
        *value_scale.stride(),
        BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_HIGH=key_codes_high.shape[-1],
        G=group_size,
        PLANES_HIGH=key_codes_high.shape[3],
        BITS_LOW=key_codes_low.shape[3],
        **key_word_distances(key_codes_high, key_codes_low),
        **value_layout(head_dim, value_scale.shape[-1], value_codes.shape[3]),  # D, GV, ...
        MIDPOINT=midpoint_correction,
        BLOCK_T=BLOCK_T,
        **constants,
        PDL=pdl,
        launch_pdl=pdl,
        enable_fp_fusion=False,  # the quantizers' codes must match torch (kernels/common.py)
    )
    return query_out


def check_rotation(query, key, cos, sin, query_norm_weight, key_norm_weight) -> None:
    """Raise ``ValueError`` for arguments :func:`decode_rotate_append` cannot take."""
    batch, heads, head_dim = key.shape
    if query.shape[0] != batch or query.shape[2] != head_dim or query.shape[1] % heads or head_dim % 2:
        raise ValueError(
            f"decode_rotate_append needs query [B, Hq, D] and key [B, H, D] with Hq a multiple of H and D even; "
            f"got {list(query.shape)} and {list(key.shape)}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 3 or table.shape[0] not in (1, batch) or table.shape[1:] != (1, head_dim):
            raise ValueError(f"{name} must be [B, 1, D] or [1, 1, D] with B={batch}, D={head_dim}; got {list(table.shape)}")
    if (query_norm_weight is None) != (key_norm_weight is None):
        raise ValueError("query_norm_weight and key_norm_weight: give both (q/k norms) or neither")
    others = (("key", key), ("cos", cos), ("sin", sin), ("query_norm_weight", query_norm_weight), ("key_norm_weight", key_norm_weight))
    for name, tensor in others:
        if tensor is not None and (tensor.dtype != query.dtype or tensor.device != query.device):
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device}; the query is {query.dtype} on {query.device}: "
                "decode_rotate_append takes them all in one dtype, on one device"
            )
    for name, weight in others[3:]:
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{name} must be [D] = [{head_dim}]; got {list(weight.shape)}")


def rms_norm_reference(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama family, Qwen3's q/k norms) over the last dim, in its order of operations."""
    floats = heads.to(torch.float32)
    floats = floats * torch.rsqrt(floats.pow(2).mean(-1, keepdim=True) + eps)
    return weight * floats.to(heads.dtype)


def rotate_half_reference(query, key, cos, sin, query_norm_weight=None, key_norm_weight=None, norm_eps: float = 0.0):
    """The q/k norms (when weights are given) and RoPE with the rotate_half pairing of one token:
    ``query [B, Hq, D]``, ``key [B, H, D]``, ``cos``/``sin`` ``[B, 1, D]`` (or ``[1, 1, D]``); transformers'
    arithmetic."""
    if query_norm_weight is not None:
        query, key = rms_norm_reference(query, query_norm_weight, norm_eps), rms_norm_reference(key, key_norm_weight, norm_eps)

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), -1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def decode_append_reference(
    key,
    value,
    order,
    sink_keys,
    sink_values,
    sink_len,
    residual_keys,
    residual_values,
    residual_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    overflowed,
    arrivals,
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
                residual_keys[b : b + 1],
                channel_mask,
                num_high,
                group_size,
                key_codes_high.shape[3] + key_codes_low.shape[3],
                key_codes_low.shape[3],
                midpoint_correction,
            )
            key_codes_high[b, :, groups], key_codes_low[b, :, groups] = high[0], low[0]
            key_scale[b, :, groups], key_zero[b, :, groups] = scale[0], zero[0]
            codes, scale, zero = quantize_values(
                residual_values[b : b + 1],
                value_codes.shape[3],
                key.shape[-1] // value_scale.shape[-1],
                midpoint_correction,
                group_size,
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
        key,
        value,
        order,
        sink_keys,
        sink_values,
        sink_len,
        residual_keys,
        residual_values,
        residual_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        overflowed,
        arrivals,
        midpoint_correction,
    )


@decode_append.register_kernel("cuda")
def _decode_append_cuda(*args):
    triton_decode_append(*args)


@decode_append.register_fake
def _decode_append_fake(*args):
    return None


@torch.library.custom_op("pnmix::decode_rotate_append", mutates_args=_MUTATED)
def decode_rotate_append(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    query_norm_weight: torch.Tensor | None,
    key_norm_weight: torch.Tensor | None,
    norm_eps: float,
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
) -> torch.Tensor:
    """:func:`decode_append` of one token whose ``query [B, Hq, D]`` and ``key [B, H, D]`` come before
    the q/k norms (both weights ``[D]``, or both None for none) and RoPE (rotate_half pairing,
    ``cos``/``sin`` ``[B, 1, D]`` of the token's position as the model's rotary embedding gives them, or
    ``[1, 1, D]`` for all): normed, rotated, then the key appended; returns the rotated queries. Arithmetic of transformers' modules (:func:`rotate_half_reference`,
    this default implementation with :func:`decode_append_reference`); CUDA runs it in the append kernel.
    """
    check_rotation(query, key, cos, sin, query_norm_weight, key_norm_weight)
    query, key = rotate_half_reference(query, key, cos, sin, query_norm_weight, key_norm_weight, norm_eps)
    decode_append_reference(
        key,
        value,
        order,
        sink_keys,
        sink_values,
        sink_len,
        residual_keys,
        residual_values,
        residual_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        overflowed,
        arrivals,
        midpoint_correction,
    )
    return query.contiguous()


@decode_rotate_append.register_kernel("cuda")
def _decode_rotate_append_cuda(query, key, value, cos, sin, query_norm_weight, key_norm_weight, norm_eps, *cache):
    return triton_decode_append(key, value, *cache, rotation=(query, cos, sin, query_norm_weight, key_norm_weight, norm_eps))


@decode_rotate_append.register_fake
def _decode_rotate_append_fake(query, *args):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
