"""Decode attention over the packed cache with tensor-core operands unpacked in registers (Gluon).

Same op, inputs and result as :mod:`decode_attention` (its module docstring describes the
segments, the split-K scheme and the merge kernel, which this kernel shares); this is the
CUDA implementation on GPUs with ``mma.sync`` (compute capability 8.0 and up) for the
shapes of real models (:func:`supports`). The Triton kernel remains for the other shapes
and for the CPU interpreter, which cannot run Gluon.

Why a second kernel: in Triton, a tile computed in registers reaches ``tl.dot`` only
through shared memory (a layout conversion per tile), and Triton decides which thread
holds which code. Gluon states layouts explicitly, so here each thread unpacks exactly the
codes its ``mma.sync`` fragments need, from the packed words it loads itself:

- The packed codes are the *A* operand (16 x 16 fragments; a thread holds rows r, r + 8
  and column pairs k, k + 1). Keys: ``scores^T [T, Hq] = codes [T tokens, D] @ (q *
  scale)^T``. Values: ``acc^T [D, Hq] += codes^T [D, T tokens] @ (p * scale)^T``; the
  per-token value scale and zero fold into ``p`` (values need one scale per token:
  value group = head dim), the per-channel key scale into ``q``, zeros into a per-head
  offset.
- Rows r and r + 8 of a fragment read the same 32-bit word (tokens of a key word, channels
  of a value word), their bits 8 apart. A PTX block (:func:`unpack_asm`) rotates each
  plane word right by ``bit(r) - p``, gathers byte 0 (row r) or byte 1 (row r + 8) of the
  words of columns k and k + 1 into the two 16-bit halves of a register (``prmt``), and
  merges plane p into ``MAGIC + code`` (``lop3``): one register holds two 16-bit floats
  ``MAGIC + code`` (bf16 ``0x4300`` = 128, fp16 ``0x6400`` = 1024, the code in the low
  mantissa bits), with no integer-to-float conversion. bf16: ``MAGIC * sum(operand)`` is
  subtracted with the zero terms (128 times the sum costs the float32 sums 7 bits). fp16:
  the PTX subtracts MAGIC (``sub.f16x2``, exact), because 1024 times the sum cost 10 bits:
  relative error 4.7e-3 against the reference on an H200, where the Triton kernel has 5e-4.
- The word tensors are loaded once per thread in a layout that is the A-operand layout
  with the row split into (word, bit) and the bit dimension dropped
  (``DistributedLinearLayout``); broadcasting back over the bits and reshaping is free
  (``convert_layout(..., assert_trivial=True)`` checks it at compile time).
- Value rows are channels in a permuted order (:func:`value_row_channel`) so that the four
  rows a thread holds share one word; the output rows are mapped back at the store.

One step covers 64 tokens (4 warps x 16 rows); a split takes whole key groups (``G`` a
multiple of 64). The query heads of a KV head are the MMA's N dimension (8 or 16).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .decode_attention import _multiprocessors, _wave_filling_splits, split_and_merge

NUM_WARPS = 4
BLOCK_T = gl.constexpr(64)
"""Tokens per step: 4 warps x 16 rows of the MMA."""
MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}
"""16-bit float bit patterns whose lowest mantissa bit is worth 1: 128.0 (bf16), 1024.0 (fp16).
The per-head terms subtract ``MAGIC_VALUE`` times the operand sums (0 when the PTX already did)."""
MAX_REGISTERS = 128
"""Register cap per thread (Triton's ``maxnreg``) so that 4 programs share a multiprocessor;
uncapped the kernel takes ~250 and 2 fit."""


def supports(query: torch.Tensor, key_codes_high: torch.Tensor, key_codes_low: torch.Tensor,
             value_codes: torch.Tensor, value_scale: torch.Tensor, heads: int) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does): a CUDA device with
    ``mma.sync`` (8.0+), fp16/bf16, head dim 64 or 128, key groups of a multiple of 64
    tokens, codes of at most 4 bits, one value group per token, at most 16 query heads per KV head."""
    if not query.is_cuda or query.dtype not in MAGIC or _capability(query.device.index)[0] < 8:
        return False
    head_dim = query.shape[-1]
    bits = (key_codes_high.shape[3], key_codes_low.shape[3], value_codes.shape[3])
    return (
        head_dim in (64, 128)
        and (32 * key_codes_high.shape[4]) % BLOCK_T.value == 0
        and max(bits) <= 4
        and value_scale.shape[-1] == 1
        and query.shape[1] % heads == 0
        and query.shape[1] // heads <= 16
    )


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def value_row_channel(row: int, head_dim: int) -> int:
    """Channel held by ``row`` of the value operand ``[D, T]``. For D = 128 a thread holds rows
    r, r + 8, r + 64, r + 72: row bits (6, 5, 4) carry channel bits (4, 6, 5), so those four
    rows are channels r % 16 + {0, 8, 16, 24} of one 32-channel word. D = 64: the identity."""
    if head_dim == 64:
        return row
    return (row & 15) | ((row >> 6) & 1) << 4 | ((row >> 4) & 3) << 5


def _a_operand_bases(rows: int, cols: int) -> tuple[list, list, list]:
    """Register, lane and warp bases of the A operand ``[rows, cols]`` of a 16-bit ``mma.sync``
    m16n8k16 with 4 warps along the rows (Triton's linear layout, as ``gl.to_linear_layout`` gives)."""
    registers = [[0, 1], [8, 0], [0, 8]] + [[0, 16 << i] for i in range(int(math.log2(cols)) - 4)]
    registers += [[64 << i, 0] for i in range(int(math.log2(rows)) - 6)]
    return registers, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]]


def _word_bit_layout(rows: int, cols: int, row_channel) -> gl.DistributedLinearLayout:
    """The A-operand layout with row r split into (word, bit) of ``row_channel(r)``: ``[rows/32, 32, cols]``."""

    def split(bases):
        return [[row_channel(r) >> 5, row_channel(r) & 31, c] for r, c in bases]

    return gl.DistributedLinearLayout(*(split(b) for b in _a_operand_bases(rows, cols)), [], [rows // 32, 32, cols])


@functools.cache
def layouts(head_dim: int) -> dict:
    """The kernel's layouts (constexpr arguments) for ``head_dim``."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    return dict(
        MMA=mma,
        A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        KEY_BITS=_word_bit_layout(BLOCK_T.value, head_dim, lambda r: r),
        VALUE_BITS=_word_bit_layout(head_dim, BLOCK_T.value, lambda r: value_row_channel(r, head_dim)),
    )


@functools.cache
def unpack_asm(planes: int, magic: int, subtract_magic: bool = False) -> str:
    """PTX of one 2 x 2 block of A-operand elements: ``(r, k), (r, k+1), (r+8, k), (r+8, k+1)``.

    Operands: ``$0, $1`` the two result registers (row r, row r + 8; column k in the low
    half); then per plane p: the words of the four elements (``$2 + 8p``: column k, ``$3 + 8p``:
    column k + 1; rows r + 8 repeat them), then ``bit(r) - p`` four times (``$6 + 8p``).
    ``subtract_magic`` (fp16 only): end with ``sub.rn.f16x2`` of MAGIC, leaving the exact codes.
    """
    lines = ["{", ".reg .b32 a, b, x;", f"mov.b32 $0, {magic * 0x10001:#x};", f"mov.b32 $1, {magic * 0x10001:#x};"]
    for p in range(planes):
        word_k, word_k1, shift = 2 + 8 * p, 3 + 8 * p, 6 + 8 * p
        lines += [f"shf.r.wrap.b32 a, ${word_k}, ${word_k}, ${shift};", f"shf.r.wrap.b32 b, ${word_k1}, ${word_k1}, ${shift};"]
        # prmt 0x0400: bytes (a0, a0, b0, a0); 0x0501: (a1, a0, b1, a0). lop3 0xEA: (x & mask) | out.
        for out, selector in ((0, "0x0400"), (1, "0x0501")):
            lines += [f"prmt.b32 x, a, b, {selector};", f"lop3.b32 ${out}, x, {0x10001 << p:#x}, ${out}, 0xEA;"]
    if subtract_magic:
        lines += [f"mov.b32 x, {magic * 0x10001:#x};", "sub.rn.f16x2 $0, $0, x;", "sub.rn.f16x2 $1, $1, x;"]
    return "\n".join(lines + ["}"])


def unpack_constraints(planes: int) -> str:
    return ",".join(["=r", "=r"] + ["r"] * (8 * planes))


@gluon.jit
def _spread(words, bit3, M: gl.constexpr, K: gl.constexpr, A: gl.constexpr, TAKE_BIT: gl.constexpr):
    """Words ``[M / 32, K]`` -> ``[M, K]`` in the A layout, row r reading its word (``TAKE_BIT``: the
    bit of row r instead). ``bit3`` is ``[1, 32, 1]``; no data moves."""
    x = gl.broadcast(gl.expand_dims(words, 1), bit3)[1 if TAKE_BIT else 0]
    return gl.convert_layout(gl.reshape(x, [M, K]), A, assert_trivial=True)


@gluon.jit
def _relabel_value_rows(x, D: gl.constexpr, T: gl.constexpr, A: gl.constexpr):
    """``[D, T]`` indexed by channel -> indexed by row (:func:`value_row_channel`); no data moves."""
    if D == 128:  # channel bits (6, 5, 4, 3-0) -> row bits (4, 6, 5, 3-0)
        x = gl.reshape(gl.permute(gl.reshape(x, [2, 2, 2, 16, T]), [2, 0, 1, 3, 4]), [D, T])
    return gl.convert_layout(x, A, assert_trivial=True)


@gluon.jit
def _unpack(w0, w1, w2, w3, s0, s1, s2, s3, PLANES: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr, like):
    """``MAGIC + code`` as 16-bit floats of ``like``'s dtype from ``PLANES`` plane words and rotations
    (the rest unused)."""
    dtype = like.dtype
    if PLANES == 1:
        out = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [w0, s0], dtype, True, 4)
    elif PLANES == 2:
        out = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [w0, s0, w1, s1], dtype, True, 4)
    elif PLANES == 3:
        out = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [w0, s0, w1, s1, w2, s2], dtype, True, 4)
    else:
        out = gl.inline_asm_elementwise(ASM, CONSTRAINTS, [w0, s0, w1, s1, w2, s2, w3, s3], dtype, True, 4)
    return out


@gluon.jit
def _key_words(kh_ptrs, kl_ptrs, is_high, group, word0, p: gl.constexpr, BITS_HIGH: gl.constexpr,
               BITS_LOW: gl.constexpr, WORDS: gl.constexpr, C_HIGH: gl.constexpr, C_LOW: gl.constexpr):
    """Plane ``p`` of the key words ``[T / 32, D]`` of one step: stored channel c < C_HIGH from the
    selected-channel codes, the others from the low ones; 0 for a channel with fewer planes."""
    high = kh_ptrs + ((group * BITS_HIGH + p) * WORDS + word0) * C_HIGH
    low = kl_ptrs + ((group * BITS_LOW + p) * WORDS + word0) * C_LOW
    if p < BITS_HIGH and p < BITS_LOW:
        words = gl.load(gl.where(is_high, high, low))
    elif p < BITS_HIGH:
        words = gl.load(high, mask=is_high, other=0)
    else:
        words = gl.load(low, mask=~is_high, other=0)
    return words


@gluon.jit
def _attend_dense(m_i, l_i, acc, q_t, k_ptr, v_ptr, length, D: gl.constexpr, BLOCK_Q: gl.constexpr,
                  A: gl.constexpr, B: gl.constexpr, MMA: gl.constexpr):
    """Attend to ``length`` full-precision rows ``[tokens, D]`` at ``k_ptr``/``v_ptr`` (sinks, residual)."""
    T: gl.constexpr = BLOCK_T
    t_k = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, A)), 1)
    d_k = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, A)), 0)
    rows_v = gl.arange(0, D, layout=gl.SliceLayout(1, A))
    if D == 128:  # value_row_channel
        rows_v = (rows_v & 15) | ((rows_v >> 6) & 1) << 4 | ((rows_v >> 4) & 3) << 5
    c_v = gl.expand_dims(rows_v, 1)
    t_v = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(0, A)), 0)
    t_s = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, MMA)), 1)
    for start in range(0, length, T):
        k = gl.load(k_ptr + (start + t_k) * D + d_k, mask=(start + t_k) < length, other=0.0)
        v = gl.load(v_ptr + (start + t_v) * D + c_v, mask=(start + t_v) < length, other=0.0)
        scores = mma_v2(k, q_t, gl.zeros([T, BLOCK_Q], gl.float32, layout=MMA))
        scores = gl.where((start + t_s) < length, scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(scores - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, 0)
        acc = mma_v2(v, gl.convert_layout(p.to(k.dtype), B), acc * gl.expand_dims(alpha, 0))
        m_i = m_new
    return m_i, l_i, acc


@gluon.jit
def _decode_split_kernel_mma(
    query_ptr, order_ptr,
    sink_k_ptr, sink_v_ptr, sink_len_ptr,
    kc_high_ptr, kc_low_ptr, k_scale_ptr, k_zero_ptr,
    vc_ptr, v_scale_ptr, v_zero_ptr, num_groups_ptr,
    res_k_ptr, res_v_ptr, res_len_ptr,
    m_out_ptr, l_out_ptr, acc_out_ptr,
    qk_scale, num_heads, num_splits, sink_cap, group_cap, residual_cap,
    # (batch, head) strides; the dims below the head are contiguous.
    s_qb, s_qh, s_ob, s_oh,
    s_skb, s_skh, s_svb, s_svh,
    s_khb, s_khh, s_klb, s_klh, s_ksb, s_ksh, s_kzb, s_kzh,
    s_vcb, s_vch, s_vsb, s_vsh, s_vzb, s_vzh,
    s_rkb, s_rkh, s_rvb, s_rvh,
    RATIO: gl.constexpr, BLOCK_Q: gl.constexpr, D: gl.constexpr,
    G: gl.constexpr, C_HIGH: gl.constexpr, BITS_HIGH: gl.constexpr, BITS_LOW: gl.constexpr, BITS_V: gl.constexpr,
    MAGIC_VALUE: gl.constexpr, KEY_PLANES: gl.constexpr, KEY_ASM: gl.constexpr, KEY_CONSTRAINTS: gl.constexpr,
    VALUE_ASM: gl.constexpr, VALUE_CONSTRAINTS: gl.constexpr,
    MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr,
):
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // num_heads).to(gl.int64)
    h = (pid_bh % num_heads).to(gl.int64)
    dtype: gl.constexpr = query_ptr.dtype.element_ty
    T: gl.constexpr = BLOCK_T

    # Query^T [D, BLOCK_Q] in the B-operand layout; scores in the log2 domain (qk_scale has log2(e)).
    d_b = gl.arange(0, D, layout=gl.SliceLayout(1, B))
    j_b = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, B))
    q_cols = query_ptr + b * s_qb + (h * RATIO + gl.expand_dims(j_b, 0)) * s_qh
    q_mask = gl.expand_dims(j_b < RATIO, 0) & gl.expand_dims(d_b < D, 1)
    order = gl.load(order_ptr + b * s_ob + h * s_oh + d_b)
    q_stored = gl.load(q_cols + gl.expand_dims(order, 1), mask=q_mask, other=0.0).to(gl.float32) * qk_scale
    q_natural = (gl.load(q_cols + gl.expand_dims(d_b, 1), mask=q_mask, other=0.0).to(gl.float32) * qk_scale).to(dtype)

    m_i = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([BLOCK_Q], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, BLOCK_Q], gl.float32, layout=MMA)  # rows: value_row_channel order

    # Sinks: split 0 only.
    n_sink = gl.where(split == 0, gl.minimum(gl.load(sink_len_ptr + b), sink_cap), 0)
    m_i, l_i, acc = _attend_dense(m_i, l_i, acc, q_natural, sink_k_ptr + b * s_skb + h * s_skh,
                                  sink_v_ptr + b * s_svb + h * s_svh, n_sink, D, BLOCK_Q, A, B, MMA)

    # Packed groups: this split's slice of the sequence's groups.
    WORDS: gl.constexpr = G // 32
    C_LOW: gl.constexpr = D - C_HIGH
    n_groups = gl.minimum(gl.load(num_groups_ptr + b), group_cap)
    per_split = gl.cdiv(n_groups, num_splits)
    group_end = gl.minimum(split * per_split + per_split, n_groups)

    # Key words [T / 32, D] of a plane: bit t of word w is token 32 w + t of the step.
    KEY_WORDS: gl.constexpr = gl.SliceLayout(1, KEY_BITS)
    k_word = gl.expand_dims(gl.arange(0, T // 32, layout=gl.SliceLayout(1, KEY_WORDS)), 1)
    k_chan = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, KEY_WORDS)), 0)
    is_high = k_chan < C_HIGH
    kh_ptrs = kc_high_ptr + b * s_khb + h * s_khh + k_word * C_HIGH + k_chan
    kl_ptrs = kc_low_ptr + b * s_klb + h * s_klh + k_word * C_LOW + (k_chan - C_HIGH)
    k_bit = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_BITS))), 0), 2)
    k_rot = _spread(gl.zeros([T // 32, D], gl.int32, layout=KEY_WORDS), k_bit, T, D, A, True)
    # Value words [D / 32, T] of a plane: bit i of word w of token t is channel 32 w + i.
    VALUE_WORDS: gl.constexpr = gl.SliceLayout(1, VALUE_BITS)
    v_word = gl.expand_dims(gl.arange(0, D // 32, layout=gl.SliceLayout(1, VALUE_WORDS)), 1)
    v_tok = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(0, VALUE_WORDS)), 0)
    vc_ptrs = vc_ptr + b * s_vcb + h * s_vch + v_tok * (BITS_V * (D // 32)) + v_word
    v_bit = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_BITS))), 0), 2)
    v_rot = _relabel_value_rows(
        gl.reshape(gl.broadcast(gl.expand_dims(gl.zeros([D // 32, T], gl.int32, layout=VALUE_WORDS), 1), v_bit)[1], [D, T]),
        D, T, A,
    )
    t_s = gl.arange(0, T, layout=gl.SliceLayout(1, MMA))
    vs_ptrs = v_scale_ptr + b * s_vsb + h * s_vsh + t_s
    vz_ptrs = v_zero_ptr + b * s_vzb + h * s_vzh + t_s
    ks_ptrs = k_scale_ptr + b * s_ksb + h * s_ksh + d_b
    kz_ptrs = k_zero_ptr + b * s_kzb + h * s_kzh + d_b

    for group in range(split * per_split, group_end):
        # q . (zero + code * scale) = (q * scale) . (MAGIC + code) + q . zero - MAGIC * sum(q * scale),
        # the sum over the 16-bit rounded q * scale that the MMA multiplies.
        k_scale = gl.load(ks_ptrs + group * D).to(gl.float32)
        k_zero = gl.load(kz_ptrs + group * D).to(gl.float32)
        q_scaled = (q_stored * gl.expand_dims(k_scale, 1)).to(dtype)
        k_offset = gl.sum(q_stored * gl.expand_dims(k_zero, 1) - MAGIC_VALUE * q_scaled.to(gl.float32), 0)
        k_offset = gl.expand_dims(gl.convert_layout(k_offset, gl.SliceLayout(0, MMA)), 0)
        for step in gl.static_range(G // T):
            word0 = step * (T // 32)
            w0 = _spread(_key_words(kh_ptrs, kl_ptrs, is_high, group, word0, 0, BITS_HIGH, BITS_LOW, WORDS, C_HIGH, C_LOW), k_bit, T, D, A, False)
            w1 = w0
            w2 = w0
            w3 = w0
            if KEY_PLANES > 1:
                w1 = _spread(_key_words(kh_ptrs, kl_ptrs, is_high, group, word0, 1, BITS_HIGH, BITS_LOW, WORDS, C_HIGH, C_LOW), k_bit, T, D, A, False)
            if KEY_PLANES > 2:
                w2 = _spread(_key_words(kh_ptrs, kl_ptrs, is_high, group, word0, 2, BITS_HIGH, BITS_LOW, WORDS, C_HIGH, C_LOW), k_bit, T, D, A, False)
            if KEY_PLANES > 3:
                w3 = _spread(_key_words(kh_ptrs, kl_ptrs, is_high, group, word0, 3, BITS_HIGH, BITS_LOW, WORDS, C_HIGH, C_LOW), k_bit, T, D, A, False)
            keys = _unpack(w0, w1, w2, w3, k_rot, k_rot - 1, k_rot - 2, k_rot - 3, KEY_PLANES, KEY_ASM, KEY_CONSTRAINTS, q_natural)
            scores = mma_v2(keys, gl.convert_layout(q_scaled, B), gl.zeros([T, BLOCK_Q], gl.float32, layout=MMA))
            scores += k_offset

            token0 = group * G + step * T
            w0 = _relabel_value_rows(gl.reshape(gl.broadcast(gl.expand_dims(gl.load(vc_ptrs + token0 * (BITS_V * (D // 32))), 1), v_bit)[0], [D, T]), D, T, A)
            w1 = w0
            if BITS_V > 1:
                w1 = _relabel_value_rows(gl.reshape(gl.broadcast(gl.expand_dims(gl.load(vc_ptrs + (token0 * BITS_V + 1) * (D // 32)), 1), v_bit)[0], [D, T]), D, T, A)
            values = _unpack(w0, w1, w1, w1, v_rot, v_rot - 1, v_rot, v_rot, BITS_V, VALUE_ASM, VALUE_CONSTRAINTS, q_natural)
            v_scale = gl.expand_dims(gl.load(vs_ptrs + token0).to(gl.float32), 1)
            v_zero = gl.expand_dims(gl.load(vz_ptrs + token0).to(gl.float32), 1)

            m_new = gl.maximum(m_i, gl.max(scores, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores - gl.expand_dims(m_new, 0))
            l_i = l_i * alpha + gl.sum(p, 0)
            # p . (zero + code * scale) = (p * scale) . (MAGIC + code) + p . zero - MAGIC * sum(p * scale),
            # summed apart from acc so that the MAGIC terms cancel before they meet the running sum.
            p_scaled = (p * v_scale).to(dtype)
            v_offset = gl.sum(p * v_zero - MAGIC_VALUE * p_scaled.to(gl.float32), 0)
            step_acc = mma_v2(values, gl.convert_layout(p_scaled, B), gl.zeros([D, BLOCK_Q], gl.float32, layout=MMA))
            acc = acc * gl.expand_dims(alpha, 0) + (step_acc + gl.expand_dims(v_offset, 0))
            m_i = m_new

    # Residual: last split only.
    n_res = gl.where(split == num_splits - 1, gl.minimum(gl.load(res_len_ptr + b), residual_cap), 0)
    m_i, l_i, acc = _attend_dense(m_i, l_i, acc, q_natural, res_k_ptr + b * s_rkb + h * s_rkh,
                                  res_v_ptr + b * s_rvb + h * s_rvh, n_res, D, BLOCK_Q, A, B, MMA)

    # Partials [B, Hq, splits] and [B, Hq, splits, D], contiguous float32.
    j_s = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, MMA))
    channel = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    if D == 128:  # value_row_channel
        channel = (channel & 15) | ((channel >> 6) & 1) << 4 | ((channel >> 4) & 3) << 5
    rows = (b * num_heads * RATIO + h * RATIO + j_s) * num_splits + split
    j_ok = j_s < RATIO
    gl.store(m_out_ptr + rows, m_i, mask=j_ok)
    gl.store(l_out_ptr + rows, l_i, mask=j_ok)
    gl.store(acc_out_ptr + gl.expand_dims(rows, 0) * D + gl.expand_dims(channel, 1), acc, mask=gl.expand_dims(j_ok, 0))


def launch_defaults(query: torch.Tensor, kv_programs: int, max_groups: int) -> tuple[int | None, int]:
    """Register cap and split count. Measured on an H200 (``bench_attention.py --sweep-mma``):
    with at most 128 registers, 4 programs per multiprocessor, the fastest at batch 8 to 64
    (batch 8, 16K: 189.7 us against 253.6 uncapped); when the KV heads number under a quarter
    of the multiprocessors (single-stream decoding), 2 uncapped programs per multiprocessor with
    twice the work each (batch 1, 32K: 46.0 us against 54.6). The split count fills the program
    slots in waves at least 95% full, as for the Triton kernel."""
    multiprocessors = _multiprocessors(query.device.index)
    registers, per_multiprocessor = (None, 2) if 4 * kv_programs < multiprocessors else (MAX_REGISTERS, 4)
    return registers, _wave_filling_splits(per_multiprocessor * multiprocessors, kv_programs, max_groups)


@functools.cache
def kernel_constants(
    dtype: torch.dtype, head_dim: int, ratio: int, group_size: int, num_high: int,
    bits_high: int, bits_low: int, bits_value: int,
) -> dict:
    """The split kernel's constexpr arguments for a cache of these shapes (the launcher's, and
    ``benchmarks/kernel_sass.py``'s when it compiles the kernel without a GPU). Cached: do not mutate."""
    magic, exact = MAGIC[dtype], dtype == torch.float16
    key_planes = max(bits_high, bits_low)
    return dict(
        RATIO=ratio, BLOCK_Q=max(8, triton.next_power_of_2(ratio)), D=head_dim,
        G=group_size, C_HIGH=num_high, BITS_HIGH=bits_high, BITS_LOW=bits_low, BITS_V=bits_value,
        MAGIC_VALUE=0.0 if exact else float(torch.tensor(magic, dtype=torch.int16).view(dtype)),
        KEY_PLANES=key_planes, KEY_ASM=unpack_asm(key_planes, magic, exact), KEY_CONSTRAINTS=unpack_constraints(key_planes),
        VALUE_ASM=unpack_asm(bits_value, magic, exact), VALUE_CONSTRAINTS=unpack_constraints(bits_value),
        **layouts(head_dim),
    )  # fmt: skip


def mma_decode_attention(
    query, order, sink_keys, sink_values, sink_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups,
    residual_keys, residual_values, residual_len,
    scaling: float, overflowed: torch.Tensor | None = None, num_splits: int | None = None,
    max_registers: int | None | str = "default",
) -> torch.Tensor:
    """Launch the Gluon split kernel and the shared merge kernel (``split_and_merge``); arguments as
    ``decode_attention``.

    The caller checks :func:`supports`. ``num_splits`` and ``max_registers`` (per thread;
    ``None``: the compiler's choice) override :func:`launch_defaults` (benchmarks sweep them).
    """
    batch, q_heads, head_dim = query.shape
    heads = sink_keys.shape[1]
    group_cap, bits_high, words, c_high = key_codes_high.shape[2:]
    default_registers, default_split_count = launch_defaults(query, batch * heads, group_cap)
    num_splits = default_split_count if num_splits is None else num_splits
    max_registers = default_registers if max_registers == "default" else max_registers
    constants = dict(
        kernel_constants(
            query.dtype, head_dim, q_heads // heads, 32 * words, c_high,
            bits_high, key_codes_low.shape[3], value_codes.shape[3],
        ),
        num_warps=NUM_WARPS, **({} if max_registers is None else {"maxnreg": max_registers}),
    )  # fmt: skip
    return split_and_merge(
        _decode_split_kernel_mma, constants, num_splits, overflowed, scaling,
        query, order, sink_keys, sink_values, sink_len,
        key_codes_high, key_codes_low, key_scale, key_zero,
        value_codes, value_scale, value_zero, num_groups,
        residual_keys, residual_values, residual_len,
    )  # fmt: skip
