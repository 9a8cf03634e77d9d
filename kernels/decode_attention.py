"""Fused decode attention over the PN-Mix cache: full-precision sinks, packed groups, residual.

One query token per sequence. The cache of a (sequence, KV head) has three segments,
each with its own per-sequence length read from device tensors (no host sync):

- sinks ``[B, H, S, D]`` (first tokens, full precision), ``sink_len int32[B]``;
- packed groups (``quantize.py`` layout, words in its operand order) with ``num_groups
  int32[B]``: keys per channel in the *stored* channel order (selected-pair channels first),
  values per token;
- residual ``[B, H, R, D]`` (recent tokens, full precision), ``residual_len int32[B]``.

Softmax order is irrelevant, so the kernel simply attends to all valid tokens.

Flash-decoding split-K. Kernel 1 runs a grid ``(B * H, splits)``: a program serves
the ``Hq / H`` query heads of one KV head (padded to a power-of-two block of at least
16 rows for ``tl.dot`` and masked) and keeps an online softmax (running max ``m``,
denominator ``l``, unnormalized output ``acc``, all float32, scores in the log2
domain). Split ``s`` takes the ``s``-th slice of this sequence's packed chunks
(32 consecutive tokens of one group), split 0 also the sinks, the last
split the residual. Kernel 2 merges the splits with log-sum-exp weights; a sequence
with no valid token gets zeros.

Packed keys are never dequantized into memory, nor even into a float key tile: with
``k = zero + code * scale`` per stored channel,
``q . k = (q * scale) . code + q . zero``, so the tile product runs on the exact
small-integer codes and the per-group scale folds into the query. Values are
rebuilt in registers (``zero + code * scale`` per token and channel group) before
``p @ v``; each token's value bits are gathered from the words of its block
(``[tokens, words, 32]``, word and bit by the operand order), never dequantized into
memory. The query is
gathered into the stored channel order for packed keys (``order``) and used as is
for sinks, residual and values.

Dot operands are in the query dtype (fp16/bf16, float32 accumulation); float32
inputs use exact ``ieee`` dots (for tests).

On CUDA the op runs the Gluon kernel of :mod:`.decode_attention_mma` where it applies
(``supports``: fp16/bf16, head dim 64 or 128, ...): it shares this module's merge kernel
and launcher (:func:`split_and_merge`) and is several times faster on an H200
(``docs/performance.md``). This Triton kernel serves the other shapes and is the one the CPU
interpreter tests.

Limits: ``D``, ``G`` and the value group size multiples of 32, bits <= 8, ``Hq`` a
multiple of ``H``. Tensors may have any batch/head strides (views sliced along the
group dim, or along the token dim from a multiple of ``G`` tokens, are read in place: the
value words are in operand order per block of ``G`` tokens); below the head dim they must
be contiguous, else they are copied.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pnmix_patch.reference.attention import masked_attention
from pnmix_patch.reference.quantize import dequantize_keys, dequantize_values

from .common import (
    compacted_field_word,
    key_word_distances,
    let_next_kernel_launch,
    multiprocessors,
    split_and_merge,
    wait_for_previous_kernel,
    wave_filling_splits,
)

BLOCK_N_DENSE = 64
"""Tokens per step over sinks and residual."""


@triton.jit
def _softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with log2-domain ``scores [BQ, BN]`` (-inf where masked)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_dense(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    length,
    offs_d,
    d_mask,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attend to ``length`` full-precision ``[tokens, D]`` rows at ``k_ptr``/``v_ptr``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, length, BLOCK_N):
        t = start + offs_n
        mask = (t < length)[:, None] & d_mask[None, :]
        rows = t[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + rows, mask=mask, other=0.0)
        v = tl.load(v_ptr + rows, mask=mask, other=0.0)
        scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION)
        scores = tl.where((t < length)[None, :], scores, float("-inf"))
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _key_bits(channel, C: tl.constexpr, token, DISTANCE: tl.constexpr, FIELD: tl.constexpr, PLANE: tl.constexpr):
    """Offset (from a plane's first word in one group: ``word row * C + word``, plus ``PLANE``, the
    words of a plane, for the second slot of a pair) and bit of ``token`` ``[32]`` (the group's first
    32; :func:`_key_chunk_step` moves them to the others) of channel ``channel`` ``[N]`` of a key codes
    tensor of ``C`` channels, in the operand order of ``quantize.py``. Thread-owned words (``DISTANCE``
    > 0, ``quantize.key_word_distance``): token (tile, tile pair, row half, lane row) of channel
    (chunk, half, lane column, byte) is in word (tile pair, ``32 chunk + 4 lane row + lane column``)
    at bit ``8 byte + 4 tile + 2 half + row half`` of a plane or, ``FIELD``, at the low bit ``8 byte +
    4 tile + 2 row half`` of its 2-bit field in slot ``half`` of a pair of planes (the bit of the
    pair's second plane one above); the field words of a last partial chunk are compacted
    (``quantize.compact_key_fields``). Else a channel of a run of four is byte ``channel % 4`` of the
    run's word ``token // 8`` and the last ``C % 4`` channels keep plain words. Both ``[32, N]``."""
    c = channel[None, :]
    t = token[:, None]
    if DISTANCE > 0:  # the first 32 tokens: tile 0, tile pairs 0 and 1
        offset = t // 16 * C + 32 * (c // 32) + 4 * (t % 8) + c // 4 % 4
        if FIELD:
            slot = c // 16 % 2
            PART: tl.constexpr = C % 32
            if PART > 0:
                part_slot, column, _ = compacted_field_word(slot, t % 8, c // 4 % 4, PART)
                in_part = c >= C - PART
                offset = tl.where(in_part, t // 16 * C + C - PART + column, offset)
                slot = tl.where(in_part, part_slot, slot)
            return offset + slot * PLANE, 8 * (c % 4) + 2 * (t // 8 % 2)
        return offset, 8 * (c % 4) + 2 * (c // 16 % 2) + t // 8 % 2
    in_run = c < 4 * (C // 4)
    return tl.where(in_run, 4 * (c // 4) + t // 8, c), tl.where(in_run, 8 * (c % 4) + t % 8, t)


@triton.jit
def _key_chunk_step(word, C: tl.constexpr, DISTANCE: tl.constexpr):
    """What tokens ``32 word .. 32 word + 31`` of a group add to :func:`_key_bits`' offsets and bits
    of its first 32. Thread-owned words (tiles ``DISTANCE`` tokens apart): their tile moves the bits
    by 4, their tile pairs the word rows; else (``DISTANCE`` 0) one word row per 32 tokens."""
    if DISTANCE > 0:
        first = 32 * word
        return (first // (2 * DISTANCE) * (DISTANCE // 16) + first % DISTANCE // 16) * C, 4 * (first // DISTANCE % 2)
    return word * C, 0


@triton.jit
def _or_key_plane(
    codes,
    plane_ptrs,
    field_ptrs,
    bit,
    field_bit,
    mask,
    group,
    step,
    p: tl.constexpr,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    PAIRED: tl.constexpr,
    WORDS: tl.constexpr,
    C: tl.constexpr,
):
    """``codes`` with plane ``p`` of group ``group`` of one key codes tensor (``C`` channels, ``BITS``
    planes) ORed in at bit ``SHIFT + p``: pointers and bits of :func:`_key_bits`, moved to the chunk by
    ``step`` (words) and the bits already. The planes below ``PAIRED`` are pairs stored as 2-bit
    fields: both bits come from the half's word at the pair's first plane, and its second adds
    nothing."""
    if p < PAIRED:
        if p % 2 == 0:
            words = tl.load(field_ptrs + (group * BITS + p) * WORDS * C + step, mask=mask, other=0)
            codes |= ((words >> field_bit) & 3) << (SHIFT + p)
    elif p < BITS:
        words = tl.load(plane_ptrs + (group * BITS + p) * WORDS * C + step, mask=mask, other=0)
        codes |= ((words >> bit) & 1) << (SHIFT + p)
    return codes


@triton.jit
def _value_bits(p: tl.constexpr, word, bit, D: tl.constexpr, BITS_V: tl.constexpr):
    """Where plane ``p`` of value channel ``32 word + bit`` (``word`` ``[W]``, ``bit`` ``[32]``) is in a
    token's words in operand order (``quantize.py``): the word column, the bit in that word and
    whether it is stored inverted, each ``[1, W, 32]``. Planes of a pair ``(2m, 2m + 1)`` are 2-bit
    fields (channel ``16u + k`` at bits ``2k + p % 2`` of column ``m * D/16 + u``, bit 7 of every
    byte inverted); an odd last plane is a plane (bit ``c % 32`` of column ``p * D/32 + c // 32``)."""
    channel = 32 * word[None, :, None] + bit[None, None, :]
    if p < BITS_V - BITS_V % 2:
        position = 2 * (channel % 16) + p % 2
        return (p // 2) * (D // 16) + channel // 16, position, (position % 8 == 7).to(tl.int32)
    return p * (D // 32) + channel // 32, channel % 32, tl.zeros_like(channel)


@triton.jit
def _decode_split_kernel(
    query_ptr,
    order_ptr,
    sink_k_ptr,
    sink_v_ptr,
    sink_len_ptr,
    kc_high_ptr,
    kc_low_ptr,
    k_scale_ptr,
    k_zero_ptr,
    vc_ptr,
    v_scale_ptr,
    v_zero_ptr,
    num_groups_ptr,
    res_k_ptr,
    res_v_ptr,
    res_len_ptr,
    m_out_ptr,
    l_out_ptr,
    acc_out_ptr,
    qk_scale,
    num_heads,
    num_splits,
    sink_cap,
    group_cap,
    residual_cap,
    # (batch, head) strides; the dims below the head are contiguous.
    s_qb,
    s_qh,
    s_ob,
    s_oh,
    s_skb,
    s_skh,
    s_svb,
    s_svh,
    s_khb,
    s_khh,
    s_klb,
    s_klh,
    s_ksb,
    s_ksh,
    s_kzb,
    s_kzh,
    s_vcb,
    s_vch,
    s_vsb,
    s_vsh,
    s_vzb,
    s_vzh,
    s_rkb,
    s_rkh,
    s_rvb,
    s_rvh,
    RATIO: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G: tl.constexpr,
    C_HIGH: tl.constexpr,
    PLANES_HIGH: tl.constexpr,
    BITS_LOW: tl.constexpr,
    BITS_V: tl.constexpr,
    GV: tl.constexpr,
    HIGH_DISTANCE: tl.constexpr,
    LOW_DISTANCE: tl.constexpr,
    BLOCK_N_DENSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)

    offs_q = tl.arange(0, BLOCK_Q)
    q_mask = offs_q < RATIO
    heads_q = h * RATIO + offs_q  # query heads served by KV head h (HF repeat_kv order)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    qd_mask = q_mask[:, None] & d_mask[None, :]
    dtype = query_ptr.dtype.element_ty

    # Scores in the log2 domain: fold softmax scaling * log2(e) into the query.
    q_rows = query_ptr + b * s_qb + heads_q[:, None] * s_qh
    wait_for_previous_kernel(PDL)
    q = tl.load(q_rows + offs_d[None, :], mask=qd_mask, other=0.0).to(tl.float32) * qk_scale
    order = tl.load(order_ptr + b * s_ob + h * s_oh + offs_d, mask=d_mask, other=0)
    q_stored = tl.load(q_rows + order[None, :], mask=qd_mask, other=0.0).to(tl.float32) * qk_scale

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    # Sinks: split 0 only.
    n_sink = tl.where(split == 0, tl.minimum(tl.load(sink_len_ptr + b), sink_cap), 0)
    m_i, l_i, acc = _attend_dense(
        q,
        m_i,
        l_i,
        acc,
        sink_k_ptr + b * s_skb + h * s_skh,
        sink_v_ptr + b * s_svb + h * s_svh,
        n_sink,
        offs_d,
        d_mask,
        D,
        BLOCK_N_DENSE,
        DOT_PRECISION,
    )

    # Packed groups: this split's slice of the sequence's 32-token chunks. Chunk j is
    # tokens 32 (j % (G/32)) .. + 31 of group j // (G/32), i.e. tokens 32 j .. 32 j + 31.
    WORDS = G // 32
    n_chunks = tl.minimum(tl.load(num_groups_ptr + b), group_cap) * WORDS
    per_split = tl.cdiv(n_chunks, num_splits)
    chunk_end = tl.minimum(split * per_split + per_split, n_chunks)

    # Keys: one int32 word per (group, plane, word, stored channel): the low tensor holds the low
    # BITS_LOW planes of every stored channel, the high tensor the PLANES_HIGH planes above them of
    # the channels c < C_HIGH, each token at the word and bit of _key_bits (the operand order of
    # quantize.py).
    is_high = offs_d < C_HIGH
    offs_n = tl.arange(0, 32)
    high_offset, high_bit = _key_bits(offs_d, C_HIGH, offs_n, HIGH_DISTANCE, False, WORDS * C_HIGH)
    low_offset, low_bit = _key_bits(offs_d, D, offs_n, LOW_DISTANCE, False, WORDS * D)
    kh_ptrs = kc_high_ptr + b * s_khb + h * s_khh + high_offset
    kl_ptrs = kc_low_ptr + b * s_klb + h * s_klh + low_offset
    # Thread-owned words hold each pair of planes as two words of 2-bit fields (quantize.py).
    high_field_offset, high_field_bit = _key_bits(offs_d, C_HIGH, offs_n, HIGH_DISTANCE, True, WORDS * C_HIGH)
    low_field_offset, low_field_bit = _key_bits(offs_d, D, offs_n, LOW_DISTANCE, True, WORDS * D)
    kh_field_ptrs = kc_high_ptr + b * s_khb + h * s_khh + high_field_offset
    kl_field_ptrs = kc_low_ptr + b * s_klb + h * s_klh + low_field_offset
    HIGH_PAIRED: tl.constexpr = PLANES_HIGH - PLANES_HIGH % 2 if HIGH_DISTANCE > 0 else 0  # planes stored as fields
    LOW_PAIRED: tl.constexpr = BITS_LOW - BITS_LOW % 2 if LOW_DISTANCE > 0 else 0
    ks_ptrs = k_scale_ptr + b * s_ksb + h * s_ksh + offs_d
    kz_ptrs = k_zero_ptr + b * s_kzb + h * s_kzh + offs_d
    # Values: per token, BITS_V planes of D/32 words, in the operand order of quantize.py per
    # block of G tokens (the key group): channel c = 32 w + i of plane p is bit `position` of the
    # token's word `column` (_value_bits), stored as word (column, position // 8, t // 4) of the
    # block, bit 8 (t % 4) + position % 8 for its token t. Tiles are [tokens, words, bits] and
    # reshaped to [tokens, channels].
    offs_w = tl.arange(0, BLOCK_D // 32)
    w_mask = (offs_w < D // 32)[None, :]
    offs_i = tl.arange(0, 32)
    vc_base = vc_ptr + b * s_vcb + h * s_vch
    # Value groups hold GV channels (a multiple of 32): word w is in group w // (GV/32).
    v_group = (offs_w // (GV // 32))[None, :]
    vs_ptrs = v_scale_ptr + b * s_vsb + h * s_vsh + v_group
    vz_ptrs = v_zero_ptr + b * s_vzb + h * s_vzh + v_group
    for chunk in range(split * per_split, chunk_end):
        group = chunk // WORDS
        word = chunk % WORDS
        # Token n of the chunk: word and bit of each channel in a plane of its group (_key_bits, moved
        # to this chunk by _key_chunk_step).
        high_step, high_bit_step = _key_chunk_step(word, C_HIGH, HIGH_DISTANCE)
        low_step, low_bit_step = _key_chunk_step(word, D, LOW_DISTANCE)
        codes = tl.zeros([32, BLOCK_D], tl.int32)
        for p in tl.static_range(BITS_LOW):
            codes = _or_key_plane(
                codes,
                kl_ptrs,
                kl_field_ptrs,
                low_bit + low_bit_step,
                low_field_bit + low_bit_step,
                d_mask[None, :],
                group,
                low_step,
                p,
                0,
                BITS_LOW,
                LOW_PAIRED,
                WORDS,
                D,
            )
        for p in tl.static_range(PLANES_HIGH):
            codes = _or_key_plane(
                codes,
                kh_ptrs,
                kh_field_ptrs,
                high_bit + high_bit_step,
                high_field_bit + high_bit_step,
                is_high[None, :],
                group,
                high_step,
                p,
                BITS_LOW,
                PLANES_HIGH,
                HIGH_PAIRED,
                WORDS,
                C_HIGH,
            )
        k_scale = tl.load(ks_ptrs + group * D, mask=d_mask, other=0.0).to(tl.float32)
        k_zero = tl.load(kz_ptrs + group * D, mask=d_mask, other=0.0).to(tl.float32)
        # q . (zero + code * scale) = (q * scale) . code + q . zero; codes are exact in fp16/bf16.
        scores = tl.dot((q_stored * k_scale[None, :]).to(dtype), tl.trans(codes.to(dtype)), input_precision=DOT_PRECISION)
        scores += tl.sum(q_stored * k_zero[None, :], 1)[:, None]

        token = (chunk * 32 + offs_n)[:, None]  # row of the per-token value arrays
        within = (token % G)[:, :, None]
        block_words = vc_base + ((token - token % G) * (BITS_V * (D // 32)))[:, :, None] + within // 4
        bit = 8 * (within % 4)
        v_codes = tl.zeros([32, BLOCK_D // 32, 32], tl.int32)
        for p in tl.static_range(BITS_V):
            column, position, inverted = _value_bits(p, offs_w, offs_i, D, BITS_V)
            words = tl.load(block_words + (column * 4 + position // 8) * (G // 4), mask=w_mask[:, :, None], other=0)
            v_codes |= (((words >> (bit + position % 8)) & 1) ^ inverted) << p
        v_scale = tl.load(vs_ptrs + token * (D // GV), mask=w_mask, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_ptrs + token * (D // GV), mask=w_mask, other=0.0).to(tl.float32)
        v = v_zero[:, :, None] + v_codes.to(tl.float32) * v_scale[:, :, None]
        v = tl.reshape(v, [32, BLOCK_D]).to(dtype)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    let_next_kernel_launch(PDL)  # the merge kernel's programs start while the last splits finish
    # Residual: last split only.
    n_res = tl.where(split == num_splits - 1, tl.minimum(tl.load(res_len_ptr + b), residual_cap), 0)
    m_i, l_i, acc = _attend_dense(
        q,
        m_i,
        l_i,
        acc,
        res_k_ptr + b * s_rkb + h * s_rkh,
        res_v_ptr + b * s_rvb + h * s_rvh,
        n_res,
        offs_d,
        d_mask,
        D,
        BLOCK_N_DENSE,
        DOT_PRECISION,
    )

    # Partials [B, Hq, splits] and [B, Hq, splits, D], contiguous float32.
    rows = (b * num_heads * RATIO + heads_q) * num_splits + split
    tl.store(m_out_ptr + rows, m_i, mask=q_mask)
    tl.store(l_out_ptr + rows, l_i, mask=q_mask)
    tl.store(acc_out_ptr + rows[:, None] * D + offs_d[None, :], acc, mask=qd_mask)


PROGRAMS_PER_MULTIPROCESSOR = 4
"""Split programs resident per multiprocessor: 4 warps each, at most 128 registers per thread
(``MAX_REGISTERS``; uncapped, Triton takes 255 and only two fit). Measured on an H200
(``bench_attention.py --sweep-registers``): 1.08-1.31x faster than two uncapped programs with
three pipeline stages, for every preset at batch 1, 8 and 32."""
MAX_REGISTERS = 128
NUM_STAGES = 1


def _default_splits(query: torch.Tensor, kv_programs: int, max_chunks: int) -> int:
    """Splits whose programs fill the program slots of the device (``slots`` =
    ``PROGRAMS_PER_MULTIPROCESSOR`` per multiprocessor): the most that fit in one wave if they fill
    it at least ``MIN_WAVE_FILL``, else the fewest that fill every slot in waves at least that
    full; at most one per chunk and 128."""
    slots = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors(query.device.index) if query.is_cuda else 2
    return wave_filling_splits(slots, kv_programs, max_chunks)


def triton_decode_attention(
    query,
    order,
    sink_keys,
    sink_values,
    sink_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    residual_keys,
    residual_values,
    residual_len,
    scaling: float,
    overflowed: torch.Tensor | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = NUM_STAGES,
    max_registers: int | None = MAX_REGISTERS,
) -> torch.Tensor:
    """Launch the split and combine kernels; arguments as :func:`decode_attention`.

    ``num_splits`` overrides the split count (tests use it to exercise the merge);
    ``num_warps``, ``num_stages`` and ``max_registers`` (per thread, Triton's ``maxnreg``;
    ``None``: the compiler's choice) are the split kernel's launch options (benchmarks sweep them).
    """
    batch, q_heads, head_dim = query.shape
    heads = sink_keys.shape[1]
    group_cap, planes_high, words, c_high = key_codes_high.shape[2:]
    value_group = head_dim // value_scale.shape[-1]
    if q_heads % heads or head_dim % 32 or value_group % 32:
        raise ValueError(
            f"need Hq={q_heads} a multiple of H={heads}, head_dim={head_dim} and the value group size {value_group} multiples of 32"
        )
    if num_splits is None:
        num_splits = _default_splits(query, batch * heads, group_cap * words)

    constants = dict(
        RATIO=q_heads // heads,
        BLOCK_Q=max(16, triton.next_power_of_2(q_heads // heads)),
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        G=32 * words,
        C_HIGH=c_high,
        PLANES_HIGH=planes_high,
        BITS_LOW=key_codes_low.shape[3],
        **key_word_distances(key_codes_high, key_codes_low),
        BITS_V=value_codes.shape[3],
        GV=value_group,
        BLOCK_N_DENSE=BLOCK_N_DENSE,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if max_registers is None else {"maxnreg": max_registers}),
    )
    return split_and_merge(
        _decode_split_kernel,
        constants,
        num_splits,
        overflowed,
        scaling,
        query,
        order,
        sink_keys,
        sink_values,
        sink_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        residual_keys,
        residual_values,
        residual_len,
    )


def decode_attention_reference(
    query,
    order,
    sink_keys,
    sink_values,
    sink_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    residual_keys,
    residual_values,
    residual_len,
    scaling: float,
    overflowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference: dequantize every segment, masked softmax in float32."""
    group_size = 32 * key_codes_high.shape[4]
    num_high = key_codes_high.shape[-1]
    channel_mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
    keys = torch.cat(
        [
            sink_keys.float(),
            dequantize_keys(key_codes_high, key_codes_low, key_scale, key_zero, channel_mask),
            residual_keys.float(),
        ],
        2,
    )
    values = torch.cat(
        [sink_values.float(), dequantize_values(value_codes, value_scale, value_zero, group_size), residual_values.float()], 2
    )

    def valid(capacity, length):
        return torch.arange(capacity, device=query.device) < length.to(query.device)[:, None]

    allowed = torch.cat(
        [
            valid(sink_keys.shape[2], sink_len),
            valid(value_codes.shape[2], num_groups * group_size),
            valid(residual_keys.shape[2], residual_len),
        ],
        1,
    )[:, None, None, :]  # [B, 1, 1, T]
    # Unused slots never leak NaN; a non-finite cached key still gives NaN, as in FP16 attention.
    output = masked_attention(query.unsqueeze(2), keys, values, allowed, scaling).squeeze(2).to(query.dtype)
    if overflowed is not None:
        output = torch.where(overflowed.to(query.device)[:, None, None], float("nan"), output)
    return output


@torch.library.custom_op("pnmix::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    order: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    sink_len: torch.Tensor,
    key_codes_high: torch.Tensor,
    key_codes_low: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    num_groups: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_len: torch.Tensor,
    scaling: float,
    overflowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``query [B, Hq, D]`` over a PN-Mix cache; returns ``[B, Hq, D]``.

    ``order`` int64 ``[B, H, D]`` is the stored channel order of the packed keys
    (``channel_order(channel_mask)``); the other tensors are as in the module docstring.
    ``overflowed`` (bool ``[B]``, optional) marks sequences that outgrew a static cache:
    their rows are NaN (written by the merge kernel, no extra launch).
    This default implementation is :func:`decode_attention_reference`; CUDA runs the Gluon kernel of
    :mod:`.decode_attention_mma` for the shapes it supports, the Triton kernel otherwise.
    """
    return decode_attention_reference(
        query,
        order,
        sink_keys,
        sink_values,
        sink_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        residual_keys,
        residual_values,
        residual_len,
        scaling,
        overflowed,
    )


@functools.cache
def _mma_kernel():
    """The Gluon kernel's module (``decode_attention_mma``, which imports this one), or None when
    the installed Triton has no Gluon ``mma_v2`` (older than 3.5)."""
    try:
        from . import decode_attention_mma
    except ImportError:
        return None
    return decode_attention_mma


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(
    query,
    order,
    sink_keys,
    sink_values,
    sink_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    residual_keys,
    residual_values,
    residual_len,
    scaling,
    overflowed=None,
):
    mma = _mma_kernel()
    use_mma = mma is not None and mma.supports(query, key_codes_high, key_codes_low, value_codes, value_scale, sink_keys.shape[1])
    return (mma.mma_decode_attention if use_mma else triton_decode_attention)(
        query,
        order,
        sink_keys,
        sink_values,
        sink_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        residual_keys,
        residual_values,
        residual_len,
        scaling,
        overflowed,
    )


@decode_attention.register_fake
def _decode_attention_fake(
    query,
    order,
    sink_keys,
    sink_values,
    sink_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    residual_keys,
    residual_values,
    residual_len,
    scaling,
    overflowed=None,
):
    return torch.empty_like(query)
