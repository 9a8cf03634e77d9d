"""Decode attention over the packed cache with tensor-core operands unpacked in registers (Gluon).

Same op, inputs and result as :mod:`decode_attention` (its module docstring describes the
segments, the split-K scheme and the merge kernel, which this kernel shares); this is the
CUDA implementation on GPUs with ``mma.sync`` (compute capability 8.0 and up) for the
shapes of real models (:func:`supports`). The Triton kernel remains for the other shapes
and for the CPU interpreter, which cannot run Gluon.

Why a second kernel: in Triton, a tile computed in registers reaches ``tl.dot`` only
through shared memory (a layout conversion per tile), and Triton decides which thread
holds which code. Gluon states layouts explicitly, so here each thread unpacks exactly the
codes its ``mma.sync`` fragments need, from the packed words it reads itself:

- The packed codes are the *A* operand (16 x 16 fragments; a thread holds rows r, r + 8
  and column pairs k, k + 1). Keys: ``scores^T [T, Hq] = planes [T tokens, D] @ (q *
  scale)^T``. Values: ``acc^T [D, Hq] += planes^T [D, T tokens] @ (p * scale)^T``; the
  per-token value scale and zero fold into ``p`` (values need one scale per token:
  value group = head dim), the per-channel key scale into ``q``, zeros into a per-head
  offset.
- Each bit plane is its own operand and its own ``mma.sync``, so a channel costs only the
  planes it has: keys run as two tiles, the first ``W_HIGH`` stored channels (the selected
  ones, ``b_H`` planes) and the rest (``b_L`` planes).
- Rows r and r + 8 of a fragment read the same 32-bit word (tokens of a key word, channels
  of a value word), as bytes ``b`` and ``b + 1`` at the same bit ``j = r % 8``. One ``prmt``
  gathers byte ``b`` of the words of columns k and k + 1 into the two 16-bit halves of a
  register and one ``lop3`` keeps bit j of each half and ORs in a 16-bit float ``M`` whose
  mantissa has its lowest bit worth ``2^p'`` (:func:`unpack_asm`): the halves are then
  ``M + 2^(p' + j) * bit``, a float made without any conversion, two instructions per
  register and plane. The factor ``2^-j`` is the same for all of a thread's rows, so it is
  applied to the MMA results (score rows, output rows), not to the operands.
- bf16 (7 mantissa bits): ``M`` is 128 for planes 0 and 1, 512 for planes 2 and 3 (an
  exponent with bit 7 clear, so that bit 7, row 7, ORs in exactly: 128 | 128 reads 256);
  odd planes accumulate apart and count twice. The ``M`` terms (``M * sum(operand)`` per
  plane) are subtracted per head: for keys from the score accumulators' start value, for
  values once after the loop (the sums of ``p * scale`` stay per thread, rescaled like the
  output, as do the sums of ``p`` and ``p * zero``). fp16: ``M = 1024 *
  2^p`` and the PTX subtracts it (``sub.f16x2``, exact), because 1024 times the sums cost
  10 bits of the tensor cores' float32 accumulation (relative error 4.7e-3 against 5e-4 on
  an H200, measured with the previous form of this kernel).
- Key groups are staged in shared memory: ``cp.async`` copies of the codes of ``STAGES``
  groups are in flight while one is computed (the 16-bit scales and zeros, whose alignment
  ``cp.async`` cannot assume, go through registers and are stored when the group before is
  done). Without it the kernel waited on memory: the same instructions took 1.5-2x as long.
- The words are read from shared memory in a layout that is the A-operand layout with the
  row split into (word, bit) and the bit dimension dropped (``DistributedLinearLayout``);
  broadcasting back over the bits and reshaping is free (``convert_layout(...,
  assert_trivial=True)`` checks it at compile time).
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
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .decode_attention import _multiprocessors, _wave_filling_splits, split_and_merge

NUM_WARPS = 4
BLOCK_T = gl.constexpr(64)
"""Tokens per step: 4 warps x 16 rows of the MMA."""
MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}
"""16-bit float bit patterns whose lowest mantissa bit is worth 1: 128.0 (bf16), 1024.0 (fp16)."""
STAGES = 3
"""Key groups whose copies into shared memory are in flight while one is computed."""
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # renamed in Triton 3.7


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


def high_tile_width(head_dim: int, num_high: int) -> int:
    """Stored channels ``[0, W)`` of the first key tile (the rest form the second): 0 when no
    channel is selected, else half the head or all of it, whichever holds the ``num_high``
    selected channels (a tile is a power of two wide)."""
    return 0 if num_high == 0 else head_dim // 2 if num_high <= head_dim // 2 else head_dim


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
def layouts(head_dim: int, high_width: int) -> dict:
    """The kernel's layouts (constexpr arguments) for ``head_dim`` and a first key tile
    ``high_width`` channels wide (a tile of width 0 gets a placeholder layout, never used)."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    return dict(
        MMA=mma,
        A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        KEY_BITS_HIGH=_word_bit_layout(BLOCK_T.value, high_width or head_dim, lambda r: r),
        KEY_BITS_LOW=_word_bit_layout(BLOCK_T.value, head_dim - high_width or head_dim, lambda r: r),
        VALUE_BITS=_word_bit_layout(head_dim, BLOCK_T.value, lambda r: value_row_channel(r, head_dim)),
    )


def copy_layout(rows: int, cols: int) -> gl.BlockedLayout:
    """A blocked layout of the 4 warps over ``[rows, cols]`` (at least 128 elements) with no element
    held twice: each thread copies up to 4 consecutive elements of a row."""
    vector = max(1, min(4, rows * cols // (32 * NUM_WARPS)))
    lanes_col = min(32, cols // vector)
    warps_col = max(1, min(NUM_WARPS, cols // (vector * lanes_col)))
    return gl.BlockedLayout([1, vector], [32 // lanes_col, lanes_col], [NUM_WARPS // warps_col, warps_col], [1, 0])


@functools.cache
def unpack_asm(subtract_magic: bool) -> str:
    """PTX of one plane of a 2 x 2 block of A-operand elements: ``(r, k), (r, k+1), (r+8, k), (r+8, k+1)``.

    Operands (four per input, in that element order): ``$0, $1`` the results (row r, row
    r + 8; column k in the low half); the plane words ``$2..$5`` (column k, column k + 1; rows
    r + 8 repeat them); the ``prmt`` selectors ``$6..$9`` (byte ``b`` of row r into bytes 0-1,
    the same byte of column k + 1's word into bytes 2-3; ``$8`` has row r + 8's byte ``b + 1``);
    the masks ``$10..$13`` (bit ``j`` of both halves); the magic ``$14..$17`` (``M`` in both
    halves). ``subtract_magic`` (fp16): end with ``sub.rn.f16x2`` of ``M``, leaving ``2^(p' + j) * bit``.
    """
    lines = ["{", ".reg .b32 x;"]
    for out, selector, mask, magic in ((0, 6, 10, 14), (1, 8, 12, 16)):
        # lop3 0xEA: (x & mask) | magic.
        lines += [f"prmt.b32 x, $2, $3, ${selector};", f"lop3.b32 ${out}, x, ${mask}, ${magic}, 0xEA;"]
    if subtract_magic:
        lines += ["sub.rn.f16x2 $0, $0, $14;", "sub.rn.f16x2 $1, $1, $16;"]
    return "\n".join(lines + ["}"])


UNPACK_CONSTRAINTS = gl.constexpr(",".join(["=r", "=r"] + ["r"] * 16))


def plane_magic(dtype: torch.dtype, plane: int) -> int:
    """The 16-bit pattern ``M`` of bit plane ``plane``: fp16 ``1024 * 2^p`` (its lowest mantissa
    bit is worth ``2^p``); bf16 ``128 * 4^(p // 2)`` (worth ``4^(p // 2)``: odd planes count twice)."""
    if dtype == torch.float16:
        return MAGIC[dtype] + (plane << 10)
    return MAGIC[dtype] + ((plane // 2) << 8)


@gluon.jit
def _spread(words, bit3, M: gl.constexpr, K: gl.constexpr, A: gl.constexpr):
    """Words ``[M / 32, K]`` -> ``[M, K]`` in the A layout, row r reading its word. ``bit3`` is
    ``[1, 32, 1]``; no data moves."""
    x = gl.broadcast(gl.expand_dims(words, 1), bit3)[0]
    return gl.convert_layout(gl.reshape(x, [M, K]), A, assert_trivial=True)


@gluon.jit
def _relabel_value_rows(x, D: gl.constexpr, T: gl.constexpr, A: gl.constexpr):
    """``[D, T]`` indexed by channel -> indexed by row (:func:`value_row_channel`); no data moves."""
    if D == 128:  # channel bits (6, 5, 4, 3-0) -> row bits (4, 6, 5, 3-0)
        x = gl.reshape(gl.permute(gl.reshape(x, [2, 2, 2, 16, T]), [2, 0, 1, 3, 4]), [D, T])
    return gl.convert_layout(x, A, assert_trivial=True)


@gluon.jit
def _row_channel(rows, D: gl.constexpr):
    """:func:`value_row_channel` of a tensor of rows."""
    if D == 128:
        rows = (rows & 15) | ((rows >> 6) & 1) << 4 | ((rows >> 4) & 3) << 5
    return rows


@gluon.jit
def _bit_operands(bit_index):
    """The ``prmt`` selector and the mask (see :func:`unpack_asm`) of rows whose code bit is bit
    ``bit_index`` (0-31, a ``[rows, 1]`` tensor) of their word; they broadcast over the columns."""
    byte = (bit_index % 32) // 8
    return byte * 0x11 + (byte + 4) * 0x1100, 0x10001 << (bit_index % 8)


@gluon.jit
def _plane_operand(words, selector, mask, MAGIC_BITS: gl.constexpr, ASM: gl.constexpr, like):
    """One bit plane as a 16-bit A operand of ``like``'s dtype: ``M + 2^(p' + j) * bit`` (see :func:`unpack_asm`)."""
    return gl.inline_asm_elementwise(ASM, UNPACK_CONSTRAINTS, [words, selector, mask, MAGIC_BITS * 0x10001],
                                     like.dtype, True, 4)


@gluon.jit
def _copy_group_codes(key_smem, value_smem, stage, group, valid, kc_high, kc_low, v_codes,
                      D: gl.constexpr, G: gl.constexpr, C_HIGH: gl.constexpr, BITS_HIGH: gl.constexpr,
                      BITS_LOW: gl.constexpr, BITS_V: gl.constexpr, PLANES: gl.constexpr,
                      COPY_KEYS: gl.constexpr, COPY_VALUES: gl.constexpr):
    """Start the asynchronous copies of key group ``group``'s codes of one head (pointers: the head's
    bases) into ``stage`` of the shared buffers: per plane p its ``[G / 32, D]`` key words in stored
    channel order (zeros where a channel has fewer planes) and the value words ``[G, b_V * D / 32]``.
    Nothing is read when not ``valid`` (a group past this split's end)."""
    WORDS: gl.constexpr = G // 32
    word = gl.expand_dims(gl.arange(0, WORDS, layout=gl.SliceLayout(1, COPY_KEYS)), 1)
    channel = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, COPY_KEYS)), 0)
    is_high = channel < C_HIGH
    for p in gl.static_range(PLANES):
        high = kc_high + ((group * BITS_HIGH + p) * WORDS + word) * C_HIGH + channel
        low = kc_low + ((group * BITS_LOW + p) * WORDS + word) * (D - C_HIGH) + (channel - C_HIGH)
        if p < BITS_HIGH and p < BITS_LOW:
            present = valid
        elif p < BITS_HIGH:
            present = is_high & valid
        else:
            present = (~is_high) & valid
        async_copy.async_copy_global_to_shared(key_smem.index(stage * PLANES + p), gl.where(is_high, high, low),
                                               mask=present)
    token = gl.expand_dims(gl.arange(0, G, layout=gl.SliceLayout(1, COPY_VALUES)), 1)
    column = gl.expand_dims(gl.arange(0, BITS_V * (D // 32), layout=gl.SliceLayout(0, COPY_VALUES)), 0)
    async_copy.async_copy_global_to_shared(value_smem.index(stage),
                                           v_codes + (group * G + token) * (BITS_V * (D // 32)) + column, mask=valid)


@gluon.jit
def _load_group_params(group, valid, k_scale, k_zero, v_scale, v_zero, D: gl.constexpr, G: gl.constexpr,
                       PARAMS_D: gl.constexpr, PARAMS_G: gl.constexpr):
    """Key scale and zero ``[D]`` and value scale and zero ``[G]`` of key group ``group`` (16-bit, any
    alignment: plain loads, stored to shared memory later by :func:`_store_group_params`)."""
    d = gl.arange(0, D, layout=PARAMS_D)
    t = gl.arange(0, G, layout=PARAMS_G)
    return (gl.load(k_scale + group * D + d, mask=valid), gl.load(k_zero + group * D + d, mask=valid),
            gl.load(v_scale + group * G + t, mask=valid), gl.load(v_zero + group * G + t, mask=valid))


@gluon.jit
def _store_group_params(key_param_smem, value_param_smem, stage, params):
    """Store :func:`_load_group_params`' tensors into ``stage`` of the shared buffers."""
    key_param_smem.index(2 * stage).store(params[0])
    key_param_smem.index(2 * stage + 1).store(params[1])
    value_param_smem.index(2 * stage).store(params[2])
    value_param_smem.index(2 * stage + 1).store(params[3])


@gluon.jit
def _key_tile_scores(s_even, s_odd, key_smem, stage, WORD0: gl.constexpr, q_tile, selector, mask, bit3,
                     C0: gl.constexpr, W: gl.constexpr, PLANES: gl.constexpr, TILE_PLANES: gl.constexpr,
                     T: gl.constexpr, A: gl.constexpr, KEY_BITS: gl.constexpr,
                     MAGIC_BITS: gl.constexpr, MAGIC_STEP: gl.constexpr, MAGIC_DIV: gl.constexpr,
                     EXACT: gl.constexpr, ASM: gl.constexpr):
    """Add the planes of stored channels ``[C0, C0 + W)`` of one step (``TILE_PLANES`` of the buffer's
    ``PLANES``) times ``q_tile`` to the score accumulators (bf16: odd planes to ``s_odd``, which
    counts twice; see :func:`plane_magic`)."""
    for p in gl.static_range(TILE_PLANES):
        words = key_smem.index(stage * PLANES + p).slice(WORD0, T // 32, 0).slice(C0, W, 1).load(gl.SliceLayout(1, KEY_BITS))
        operand = _plane_operand(_spread(words, bit3, T, W, A), selector, mask,
                                 MAGIC_BITS + (p // MAGIC_DIV) * MAGIC_STEP, ASM, q_tile)
        if EXACT or p % 2 == 0:
            s_even = mma_v2(operand, q_tile, s_even)
        else:
            s_odd = mma_v2(operand, q_tile, s_odd)
    return s_even, s_odd


@gluon.jit
def _attend_dense(m_i, l_i, acc, q_t, k_ptr, v_ptr, length, D: gl.constexpr, BLOCK_Q: gl.constexpr,
                  A: gl.constexpr, B: gl.constexpr, MMA: gl.constexpr):
    """Attend to ``length`` full-precision rows ``[tokens, D]`` at ``k_ptr``/``v_ptr`` (sinks, residual)."""
    T: gl.constexpr = BLOCK_T
    t_k = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, A)), 1)
    d_k = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, A)), 0)
    c_v = gl.expand_dims(_row_channel(gl.arange(0, D, layout=gl.SliceLayout(1, A)), D), 1)
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
    W_HIGH: gl.constexpr, PLANES_HIGH: gl.constexpr,
    EXACT: gl.constexpr, MAGIC_VALUE: gl.constexpr, MAGIC_BITS: gl.constexpr, MAGIC_STEP: gl.constexpr,
    MAGIC_DIV: gl.constexpr, ASM: gl.constexpr,
    MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
    KEY_BITS_HIGH: gl.constexpr, KEY_BITS_LOW: gl.constexpr, VALUE_BITS: gl.constexpr,
    STAGES: gl.constexpr, COPY_KEYS: gl.constexpr, COPY_VALUES: gl.constexpr, PARAMS_D: gl.constexpr,
    PARAMS_G: gl.constexpr,
):
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // num_heads).to(gl.int64)
    h = (pid_bh % num_heads).to(gl.int64)
    dtype: gl.constexpr = query_ptr.dtype.element_ty
    T: gl.constexpr = BLOCK_T
    W_LOW: gl.constexpr = D - W_HIGH

    # Query^T [D, BLOCK_Q] in the B-operand layout; scores in the log2 domain (qk_scale has log2(e)).
    d_b = gl.arange(0, D, layout=gl.SliceLayout(1, B))
    j_b = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, B))
    q_cols = query_ptr + b * s_qb + (h * RATIO + gl.expand_dims(j_b, 0)) * s_qh
    q_mask = gl.expand_dims(j_b < RATIO, 0) & gl.expand_dims(d_b < D, 1)
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
    n_groups = gl.minimum(gl.load(num_groups_ptr + b), group_cap)
    per_split = gl.cdiv(n_groups, num_splits)
    group_end = gl.minimum(split * per_split + per_split, n_groups)

    # Shared buffers: STAGES key groups in flight (asynchronous copies), read back in the operand layouts.
    PLANES: gl.constexpr = PLANES_HIGH if PLANES_HIGH > BITS_LOW else BITS_LOW
    # (Buffers are indexed along their first dim; the layouts describe the rest.)
    SHARED_2D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SHARED_1D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_dtype: gl.constexpr = k_scale_ptr.dtype.element_ty
    key_smem = gl.allocate_shared_memory(gl.int32, [STAGES * PLANES, WORDS, D], SHARED_2D)  # [stage * PLANES + plane]
    key_param_smem = gl.allocate_shared_memory(scale_dtype, [STAGES * 2, D], SHARED_1D)  # [2 stage]: scale, [2 stage + 1]: zero
    value_smem = gl.allocate_shared_memory(gl.int32, [STAGES, G, BITS_V * (D // 32)], SHARED_2D)
    value_param_smem = gl.allocate_shared_memory(scale_dtype, [STAGES * 2, G], SHARED_1D)
    kc_high = kc_high_ptr + b * s_khb + h * s_khh
    kc_low = kc_low_ptr + b * s_klb + h * s_klh
    k_scale = k_scale_ptr + b * s_ksb + h * s_ksh
    k_zero = k_zero_ptr + b * s_kzb + h * s_kzh
    v_codes = vc_ptr + b * s_vcb + h * s_vch
    v_scale = v_scale_ptr + b * s_vsb + h * s_vsh
    v_zero = v_zero_ptr + b * s_vzb + h * s_vzh

    # Key tiles: stored channels [0, W_HIGH) (PLANES_HIGH planes) and [W_HIGH, D) (BITS_LOW planes),
    # each with the query in stored order; the rows' prmt selectors and masks.
    order_ptrs = order_ptr + b * s_ob + h * s_oh
    jq_mask = gl.expand_dims(j_b < RATIO, 0)
    key_selector, key_mask = _bit_operands(gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, A)), 1))
    if W_HIGH > 0:
        high_bit = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_BITS_HIGH))), 0), 2)
        d_high = gl.arange(0, W_HIGH, layout=gl.SliceLayout(1, B))
        q_high = gl.load(q_cols + gl.expand_dims(gl.load(order_ptrs + d_high), 1), mask=jq_mask, other=0.0).to(gl.float32) * qk_scale
    if W_LOW > 0:
        low_bit = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, KEY_BITS_LOW))), 0), 2)
        d_low = W_HIGH + gl.arange(0, W_LOW, layout=gl.SliceLayout(1, B))
        q_low = gl.load(q_cols + gl.expand_dims(gl.load(order_ptrs + d_low), 1), mask=jq_mask, other=0.0).to(gl.float32) * qk_scale
    # Score rows read bit r % 8 of their bytes: their codes came out 2^(r % 8) times too large.
    t_s = gl.arange(0, T, layout=gl.SliceLayout(1, MMA))
    key_unit = gl.expand_dims(gl.exp2(-(t_s % 8).to(gl.float32)), 1)

    # Value words [D / 32, T] of a plane: bit i of word w of token t is channel 32 w + i.
    VALUE_WORDS: gl.constexpr = gl.SliceLayout(1, VALUE_BITS)
    v_bit = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, VALUE_BITS))), 0), 2)
    v_channel = gl.expand_dims(_row_channel(gl.arange(0, D, layout=gl.SliceLayout(1, A)), D), 1)
    value_selector, value_mask = _bit_operands(v_channel)
    rows_acc = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    value_unit = gl.expand_dims(gl.exp2(-(rows_acc % 8).to(gl.float32)), 1)  # channel % 8 = row % 8
    PLANE_SUM_HIGH: gl.constexpr = MAGIC_VALUE * (2**PLANES_HIGH - 1)
    PLANE_SUM_LOW: gl.constexpr = MAGIC_VALUE * (2**BITS_LOW - 1)
    PLANE_SUM_V: gl.constexpr = MAGIC_VALUE * (2**BITS_V - 1)
    no_scores = gl.zeros([T, BLOCK_Q], gl.float32, layout=MMA)
    no_values = gl.zeros([D, BLOCK_Q], gl.float32, layout=MMA)
    l_rows = no_scores  # per-thread partial sums over the packed tokens, see below
    zero_rows = no_scores
    magic_rows = no_scores

    group_start = split * per_split
    for i in gl.static_range(STAGES - 1):
        _copy_group_codes(key_smem, value_smem, i, group_start + i, group_start + i < group_end, kc_high, kc_low,
                          v_codes, D, G, C_HIGH, BITS_HIGH, BITS_LOW, BITS_V, PLANES, COPY_KEYS, COPY_VALUES)
        async_copy.commit_group()
        params = _load_group_params(group_start + i, group_start + i < group_end, k_scale, k_zero, v_scale, v_zero,
                                    D, G, PARAMS_D, PARAMS_G)  # fmt: skip
        _store_group_params(key_param_smem, value_param_smem, i, params)
    for group in range(group_start, group_end):
        # Start reading group + STAGES - 1 into the buffers the last group was read from (its scales
        # and zeros wait in registers until this group is done), then wait for this group's codes.
        ahead = group + STAGES - 1
        ahead_stage = (ahead - group_start) % STAGES
        _copy_group_codes(key_smem, value_smem, ahead_stage, ahead, ahead < group_end, kc_high, kc_low,
                          v_codes, D, G, C_HIGH, BITS_HIGH, BITS_LOW, BITS_V, PLANES, COPY_KEYS, COPY_VALUES)
        async_copy.commit_group()
        params = _load_group_params(ahead, ahead < group_end, k_scale, k_zero, v_scale, v_zero, D, G, PARAMS_D, PARAMS_G)
        async_copy.wait_group(STAGES - 1)
        _barrier()
        stage = (group - group_start) % STAGES
        # q . (zero + code * scale) = (q * scale) . code + q . zero. The planes carry M + 2^j * bit, so the
        # score accumulators start at -(sum over planes of M) * sum(q * scale): an MMA of that constant
        # with the 16-bit q * scale the planes meet, which also broadcasts it over the rows.
        k_offset = gl.zeros([BLOCK_Q], gl.float32, layout=gl.SliceLayout(0, B))
        k_start = no_scores
        if W_HIGH > 0:
            scale = key_param_smem.index(2 * stage).slice(0, W_HIGH).load(gl.SliceLayout(1, B)).to(gl.float32)
            zero = key_param_smem.index(2 * stage + 1).slice(0, W_HIGH).load(gl.SliceLayout(1, B)).to(gl.float32)
            q_high_scaled = (q_high * gl.expand_dims(scale, 1)).to(dtype)
            k_offset += gl.sum(q_high * gl.expand_dims(zero, 1), 0)
            if not EXACT:
                k_start = mma_v2(gl.full([T, W_HIGH], -PLANE_SUM_HIGH, dtype, A), q_high_scaled, k_start)
        if W_LOW > 0:
            scale = key_param_smem.index(2 * stage).slice(W_HIGH, W_LOW).load(gl.SliceLayout(1, B)).to(gl.float32)
            zero = key_param_smem.index(2 * stage + 1).slice(W_HIGH, W_LOW).load(gl.SliceLayout(1, B)).to(gl.float32)
            q_low_scaled = (q_low * gl.expand_dims(scale, 1)).to(dtype)
            k_offset += gl.sum(q_low * gl.expand_dims(zero, 1), 0)
            if not EXACT:
                k_start = mma_v2(gl.full([T, W_LOW], -PLANE_SUM_LOW, dtype, A), q_low_scaled, k_start)
        k_offset = gl.expand_dims(gl.convert_layout(k_offset, gl.SliceLayout(0, MMA)), 0)
        for step in gl.static_range(G // T):
            s_even = k_start
            s_odd = no_scores
            if W_HIGH > 0:
                s_even, s_odd = _key_tile_scores(
                    s_even, s_odd, key_smem, stage, step * (T // 32), q_high_scaled, key_selector, key_mask, high_bit,
                    0, W_HIGH, PLANES, PLANES_HIGH, T, A, KEY_BITS_HIGH, MAGIC_BITS, MAGIC_STEP, MAGIC_DIV, EXACT, ASM,
                )  # fmt: skip
            if W_LOW > 0:
                s_even, s_odd = _key_tile_scores(
                    s_even, s_odd, key_smem, stage, step * (T // 32), q_low_scaled, key_selector, key_mask, low_bit,
                    W_HIGH, W_LOW, PLANES, BITS_LOW, T, A, KEY_BITS_LOW, MAGIC_BITS, MAGIC_STEP, MAGIC_DIV, EXACT, ASM,
                )  # fmt: skip
            if EXACT:
                scores = s_even * key_unit + k_offset
            else:
                scores = (s_even + 2.0 * s_odd) * key_unit + k_offset

            token_scale = gl.expand_dims(value_param_smem.index(2 * stage).slice(step * T, T).load(gl.SliceLayout(1, MMA)).to(gl.float32), 1)
            token_zero = gl.expand_dims(value_param_smem.index(2 * stage + 1).slice(step * T, T).load(gl.SliceLayout(1, MMA)).to(gl.float32), 1)
            m_new = gl.maximum(m_i, gl.max(scores, 0))
            alpha = gl.exp2(m_i - m_new)
            alpha_row = gl.expand_dims(alpha, 0)
            p = gl.exp2(scores - gl.expand_dims(m_new, 0))
            # p . (zero + code * scale) = (p * scale) . code + p . zero. The sums over tokens (of p, of
            # p * zero, of the M terms) stay per thread, rescaled like acc, and are reduced once after the loop.
            p_scaled = (p * token_scale).to(dtype)
            l_i = l_i * alpha
            l_rows = l_rows * alpha_row + p
            zero_rows = zero_rows * alpha_row + p * token_zero
            if not EXACT:
                magic_rows = magic_rows * alpha_row + p_scaled.to(gl.float32)
            v_even = no_values
            v_odd = no_values
            p_operand = gl.convert_layout(p_scaled, B)
            for plane in gl.static_range(BITS_V):
                words = value_smem.index(stage).slice(step * T, T, 0).slice(plane * (D // 32), D // 32, 1).permute([1, 0])
                words = _relabel_value_rows(gl.reshape(gl.broadcast(gl.expand_dims(words.load(VALUE_WORDS), 1), v_bit)[0], [D, T]), D, T, A)
                operand = _plane_operand(words, value_selector, value_mask, MAGIC_BITS + (plane // MAGIC_DIV) * MAGIC_STEP, ASM, q_natural)
                if EXACT or plane % 2 == 0:
                    v_even = mma_v2(operand, p_operand, v_even)
                else:
                    v_odd = mma_v2(operand, p_operand, v_odd)
            # Summed apart from acc, so that the M terms of this step meet acc already scaled to its units.
            if EXACT:
                acc = acc * alpha_row + v_even * value_unit
            else:
                acc = acc * alpha_row + (v_even + 2.0 * v_odd) * value_unit
            m_i = m_new
        _store_group_params(key_param_smem, value_param_smem, ahead_stage, params)
        _barrier()  # every warp is done with this stage before the next iteration refills it
    async_copy.wait_group(0)
    l_i += gl.sum(l_rows, 0)
    acc += gl.expand_dims(gl.convert_layout(gl.sum(zero_rows, 0), gl.SliceLayout(0, MMA)), 0)
    if not EXACT:
        acc -= value_unit * gl.expand_dims(gl.convert_layout(PLANE_SUM_V * gl.sum(magic_rows, 0), gl.SliceLayout(0, MMA)), 0)

    # Residual: last split only.
    n_res = gl.where(split == num_splits - 1, gl.minimum(gl.load(res_len_ptr + b), residual_cap), 0)
    m_i, l_i, acc = _attend_dense(m_i, l_i, acc, q_natural, res_k_ptr + b * s_rkb + h * s_rkh,
                                  res_v_ptr + b * s_rvb + h * s_rvh, n_res, D, BLOCK_Q, A, B, MMA)

    # Partials [B, Hq, splits] and [B, Hq, splits, D], contiguous float32.
    j_s = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, MMA))
    rows = (b * num_heads * RATIO + h * RATIO + j_s) * num_splits + split
    j_ok = j_s < RATIO
    gl.store(m_out_ptr + rows, m_i, mask=j_ok)
    gl.store(l_out_ptr + rows, l_i, mask=j_ok)
    gl.store(acc_out_ptr + gl.expand_dims(rows, 0) * D + gl.expand_dims(_row_channel(rows_acc, D), 1), acc,
             mask=gl.expand_dims(j_ok, 0))


def default_splits(query: torch.Tensor, kv_programs: int, max_groups: int, group_size: int) -> int:
    """Split count: the kernel runs with the compiler's register choice, and the splits fill the
    program slots in waves at least 95% full. Slots per multiprocessor, as measured on an H200
    (Triton 3.6, bf16; ``bench_attention.py --sweep-mma`` and ``--sweep-occupancy``):

    - 2 in general (pnmix-1, G = 128: 226 registers per thread in Nsight Compute, two programs
      fit). Capping the registers at 128, 160 or 168 (3-4 programs) is slower at batch 1-64 (batch
      32 / 32K: 679.3 us uncapped, 701.1-816.5 capped) and within 0.2% at batch 580 / 8K
      (3,067.3 against 3,061.9 at cap 160).
    - 3 for key groups of 64 tokens (pnmix-2; 168 registers in the offline sm_90 compile of
      ``kernel_sass.py`` with Triton 3.7.1, where pnmix-1 takes 208) once there are at least 64 KV
      programs: uncapped, batch 8 / 16K 122.5 against 126.7 us with 2 slots, batch 32 / 32K 866.7
      against 931.6, batch 64 / 16K 865.9 against 928.9; at batch 1 (8 KV programs) 2 slots stay
      faster (37.1 against 41.1 us at 32K).
    """
    per_multiprocessor = 3 if group_size == 64 and kv_programs >= 64 else 2
    return _wave_filling_splits(per_multiprocessor * _multiprocessors(query.device.index), kv_programs, max_groups)


@functools.cache
def kernel_constants(
    dtype: torch.dtype, head_dim: int, ratio: int, group_size: int, num_high: int,
    bits_high: int, bits_low: int, bits_value: int, stages: int = STAGES,
) -> dict:
    """The split kernel's constexpr arguments for a cache of these shapes (the launcher's, and
    ``benchmarks/kernel_sass.py``'s when it compiles the kernel without a GPU). Cached: do not mutate."""
    exact = dtype == torch.float16
    high_width = high_tile_width(head_dim, num_high)
    plane_divisor = 1 if exact else 2  # planes p with the same p // divisor share a magic
    return dict(
        RATIO=ratio, BLOCK_Q=max(8, triton.next_power_of_2(ratio)), D=head_dim,
        G=group_size, C_HIGH=num_high, BITS_HIGH=bits_high, BITS_LOW=bits_low, BITS_V=bits_value,
        W_HIGH=high_width, PLANES_HIGH=bits_high if high_width == num_high else max(bits_high, bits_low),
        EXACT=exact, MAGIC_VALUE=0.0 if exact else float(torch.tensor(MAGIC[dtype], dtype=torch.int16).view(dtype)),
        MAGIC_BITS=MAGIC[dtype], MAGIC_DIV=plane_divisor, MAGIC_STEP=plane_magic(dtype, plane_divisor) - MAGIC[dtype],
        ASM=unpack_asm(exact), STAGES=stages,
        COPY_KEYS=copy_layout(group_size // 32, head_dim), COPY_VALUES=copy_layout(group_size, bits_value * head_dim // 32),
        PARAMS_D=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]), PARAMS_G=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]),
        **layouts(head_dim, high_width),
    )  # fmt: skip


def mma_decode_attention(
    query, order, sink_keys, sink_values, sink_len,
    key_codes_high, key_codes_low, key_scale, key_zero,
    value_codes, value_scale, value_zero, num_groups,
    residual_keys, residual_values, residual_len,
    scaling: float, overflowed: torch.Tensor | None = None, num_splits: int | None = None,
    max_registers: int | None = None, stages: int = STAGES,
) -> torch.Tensor:
    """Launch the Gluon split kernel and the shared merge kernel (``split_and_merge``); arguments as
    ``decode_attention``.

    The caller checks :func:`supports`. ``num_splits`` (default :func:`default_splits`),
    ``max_registers`` (per thread, Triton's ``maxnreg``; default the compiler's choice) and ``stages``
    (key groups in flight) are for benchmarks that sweep them.
    """
    batch, q_heads, head_dim = query.shape
    heads = sink_keys.shape[1]
    group_cap, bits_high, words, c_high = key_codes_high.shape[2:]
    num_splits = default_splits(query, batch * heads, group_cap, 32 * words) if num_splits is None else num_splits
    constants = dict(
        kernel_constants(
            query.dtype, head_dim, q_heads // heads, 32 * words, c_high,
            bits_high, key_codes_low.shape[3], value_codes.shape[3], stages,
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
