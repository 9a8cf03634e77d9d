"""Decode attention over the packed cache with 8-bit tensor-core operands made in registers (Gluon).

Same op, inputs and result as :mod:`decode_attention` (its module docstring describes the
segments, the split-K scheme and the merge kernel, which this kernel shares); this is the
CUDA implementation on GPUs with ``mma.sync`` (compute capability 8.0 and up) for the
shapes of real models (:func:`supports`). The Triton kernel remains for the other shapes
and for the CPU interpreter, which cannot run Gluon.

Why a second kernel: Triton decides which thread holds which code and reaches ``tl.dot`` only
through shared memory; Gluon states layouts explicitly, so each thread builds exactly the
operands its ``mma.sync`` fragments need, with one instruction per register:

- Every key level (a pair of bit planes stored as 2-bit fields, or an odd last plane), and every
  pair of value bit planes, is the A operand of an 8-bit MMA
  (m16n8k32, int32 accumulation). Keys: ``scores^T [T, Hq] = levels [T tokens, D] @ (q *
  scale)^T``; values: ``acc^T [D, Hq] += codes^T [D, T tokens] @ (p * scale)^T``. The
  per-channel key scale folds into q, the per-token value scale into p (one value group per
  token), the zeros into per-head offsets.
- An A register holds four consecutive K elements of one row. The cache stores its words in
  operand order (``pnmix_patch/reference/quantize.py``), one byte per K column, so no word is
  transposed on the way. Key words are thread-owned (``quantize.thread_owned_keys``; the
  shapes this kernel takes, :func:`supports_shapes`): a thread's word of a 32-channel chunk holds
  all its registers' bits, rows g and g + 8 of its warp's two 16-token tiles (a group's 128 tokens
  of a step; of 64 tokens, one tile's) by the chunk's two halves; a warp reads 32 consecutive
  words, one per lane, a step's key words with 4 ``ldmatrix`` of two matrices (``LDSM.16.M88.2``)
  and 8 shifts. ``(word >> 2 * half) & 0x01010101 << bit`` (:data:`BYTES_ASM`) is a register, four
  int8 elements ``2^bit * code bit``, ``bit = 4 * tile + row half`` (:func:`_key_row_factors`); a
  pair of planes is two field words, one per half, and ``(word >> row half) & 0x03030303 << bit``
  reads ``2^bit`` times the pair's 2-bit code, the same factor, so planes and fields share one
  accumulator (:func:`_key_level_scores`), and a pair of planes costs one AND and one MMA. The
  factor ``2^-bit`` is the same for all of a row's elements, so it is applied to the MMA results.
- Values are stored as 2-bit fields (a pair of planes per word): a word holds 4 channel rows x 4
  token columns, and ``word & 0x03030303 << 2k`` is the register of row k: ``4^k * code``, half
  the ANDs and MMAs of two planes. The top field (k = 3) holds the sign bit of the int8, so the
  cache stores its high bit inverted: it reads ``64 * (code - 2)``. Its rows get ``2 * sum(p *
  scale)`` back after the loop (per-thread partial sums, like the zeros'; with 4-bit values, two
  field words per row weighted 4 and 1, ``10 * sum(p * scale)``).
- The B operands (``q * scale``, ``p * scale``, float32) are split into two 8-bit parts with one
  scale per query column: ``y = 127 * x / peak``, ``high = round(y)``, ``low = round(128 * (y -
  high))``, 15 significant bits against bf16's 8; ``result = (128 * acc_high + acc_low) * peak /
  (127 * 128)``. Keys: ``peak`` is the column's largest ``|q * scale|`` of the group; the operands
  are made once per group by all warps into shared memory. Values: ``peak`` is the largest
  token scale of the stage's one or two groups (``p <= 1``, see below). The parts are rounded by
  adding 1.5 * 2^23 and reading the float's low byte (:func:`_split_8bit`, :data:`PACK_ASM`): no
  float-to-integer conversion.
- Every key level of a tile meets the same B operand, the levels weighted by Horner's scheme: from
  the top level down, the integer accumulators are shifted by the next level's planes (2 for a
  pair, 1 for an odd plane) and its MMA is added (one shift per accumulator register and level
  instead of one operand per level and tile, or 2^p MMAs for plane p); 4-bit values' two field
  words likewise, times 4. The key sums stay far inside int32 (at most 128 channels x 15 x 127 x
  2^5 = 7.8e6 with 4-bit codes, whose rows read their codes at most 2^5 times too large); their
  high and low parts are combined as ``128 * high + low`` in int32 (under 1.01e9).
- Paired columns: with at most 4 query heads per KV head (Llama-3, Qwen3, Mistral: 4) the MMA's
  8 columns hold each head twice, its high parts in column 2j and its low parts in column 2j + 1,
  so one MMA makes both (half the MMAs and B-operand loads). A thread's accumulator registers hold
  both columns of a pair, so ``128 * high + low`` is made in the thread (:func:`_pair_parts`) and the
  softmax works on one score per token and head (``[T, 4]``, :func:`heads_layout`). With more heads
  the parts are two MMAs.
- Key tiles: the first ``W_HIGH`` stored channels (the selected ones and, where they are fewer,
  others) and the rest. Both tiles read the low codes (planes ``0 .. b_L - 1`` of every channel);
  the first also the high ones (planes ``b_L .. b_H - 1`` of the selected channels: one pair of
  planes for every preset, ``quantize.py``), whose levels are the top ones of its Horner sum, on
  the same query operands. So a channel costs only the planes it has, and every preset reads
  thread-owned words: the low codes span whole 32-channel chunks, and a partial last chunk of the
  high ones (pnmix-2: 52 selected channels) is stored compacted and gathered by the copy, its
  missing words zeros. The shared buffer of a group's key words holds the first tile's low and
  high planes, then the second's low planes (:func:`_copy_offsets`).
- Key groups are staged in shared memory: ``STAGES`` buffers, the operands read from the buffer
  itself. A stage holds one group, or two consecutive 64-token groups (their codes, scales and zeros
  are consecutive in the cache, so one copy takes both). While a stage's key products run, the
  ``cp.async`` copies of the codes of the next ``STAGES - 2`` stages are in flight; the copy of the
  stage after them starts once the stage's scores are made, and runs during its softmax and value
  products (the stage count: :func:`default_splits`). The 16-bit scales and zeros, whose
  alignment ``cp.async`` cannot assume, go through
  registers and are stored once the stage's last step has read its token scales. The value words'
  buffer is swizzled (:func:`value_shared_layout`). Without staging the
  kernel would wait on memory.
- One barrier per stage, the stage's codes arrived (and its query operands are stored), and two per
  step: the 4 warps' score maxima exchanged (:func:`_column_max`); p stored. A stage's query
  operands and factors (:func:`_group_operands`) are made during the value products of the stage
  before, where they fill the products' wait; the next copy is started and the stage's scales and
  zeros refilled after the last step's score-maximum barrier. (Triton's own
  cross-warp reductions take two barriers each, and its barrier analysis adds one between a write
  and a read of one buffer, in either order, with no barrier between them: hence the order of the
  loop.)
- Shared buffers are written one whole buffer per operation: Triton fences every write to a buffer
  that is read or written nearby with a barrier, whatever part of the buffer it touches.
- The words are read in a layout that is the A-operand layout with rows and columns
  split as the words hold them and the bit and byte-in-register dimensions dropped
  (``DistributedLinearLayout``);
  broadcasting back and reshaping is free (``convert_layout(..., assert_trivial=True)`` checks it
  at compile time).

A step covers 128 tokens (4 warps x 2 x 16 rows; 64 where the value codes have 4 bits, see
:func:`step_tokens`): one softmax update per step. With 64-token groups (``pnmix-2``) a step covers
two groups: the rows of a warp's first 16-row tile are the first group's, those of its second tile
the second's (:func:`_join_groups`), and each group's key products are made on its own operands
(its query times its channel scales); the value products of both go into one set of accumulators on
operands of one peak (the stage's largest token scale), so groups of any size take the softmax, the
barriers, the value accumulators and their rescaling of 128-token steps. A split takes whole
stages (``G`` a power of two, at least 64; its last stage may hold one group of two). The query
heads of a KV head are the MMA's N dimension (8 or 16).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pnmix_patch.reference.quantize import key_word_distance, thread_owned_keys

from .common import multiprocessors, split_and_merge, wave_filling_splits

NUM_WARPS = 4
WARPS = gl.constexpr(NUM_WARPS)
DENSE_T = gl.constexpr(64)
"""Tokens per step of the full-precision parts (sinks, residual): 4 warps x 16 rows of the MMA."""
DTYPES = (torch.bfloat16, torch.float16)
STAGES = 3
"""Shared buffers of key groups: ``STAGES - 2`` groups' copies in flight during a group's key products, one more during
its value products (see the module docstring and :func:`default_splits`)."""
MAX_REGISTERS = 128
"""Registers per thread (Triton's ``maxnreg``): four programs per multiprocessor (see :func:`default_splits`)."""
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # renamed in Triton 3.7


def supports(
    query: torch.Tensor,
    key_codes_high: torch.Tensor,
    key_codes_low: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    heads: int,
) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does): a CUDA device with
    ``mma.sync`` (8.0+), fp16/bf16, and shapes :func:`supports_shapes` accepts."""
    if not query.is_cuda or query.dtype not in DTYPES or _capability(query.device.index)[0] < 8:
        return False
    return supports_shapes(
        query.shape[-1],
        32 * key_codes_high.shape[4],
        key_codes_high.shape[3] + key_codes_low.shape[3],
        key_codes_low.shape[3],
        value_codes.shape[3],
        value_scale.shape[-1],
        query.shape[1],
        heads,
        key_codes_high.shape[5],
    )


def supports_shapes(
    head_dim: int,
    group_size: int,
    bits_high: int,
    bits_low: int,
    bits_value: int,
    value_scales_per_token: int,
    query_heads: int,
    heads: int,
    num_high: int,
) -> bool:
    """The shapes this kernel builds for: head dim 64 or 128, key groups of a power of two of at
    least 64 tokens, key codes of at most 4 bits in thread-owned words (the selected channels' upper
    planes too: ``quantize.thread_owned_keys``; pnmix-2 at head dim 64 selects 26 channels, whose
    last partial chunk has lanes of two channels, and goes to the Triton kernel), value codes of 2 or
    4 bits (pairs of planes stored as 2-bit fields; a 1-bit or an odd top plane is a plane, which
    this kernel does not read; and its shared buffers are powers of two: 192-token groups would not
    compile), one value group per token, at most 16 query heads per KV head."""
    return (
        head_dim in (64, 128)
        and group_size >= 64
        and group_size & (group_size - 1) == 0
        and bits_high <= 4
        and thread_owned_keys(group_size, num_high, bits_high - bits_low)
        and bits_value in (2, 4)
        and value_scales_per_token == 1
        and query_heads % heads == 0
        and query_heads // heads <= 16
    )


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def high_tile_width(head_dim: int, num_high: int) -> int:
    """Stored channels ``[0, W)`` of the first key tile (the rest form the second): 0 when no
    channel is selected, else half the head or all of it, whichever holds the ``num_high``
    selected channels (a tile is a power of two wide)."""
    return 0 if num_high == 0 else head_dim // 2 if num_high <= head_dim // 2 else head_dim


def _a8_operand_bases(rows: int, cols: int) -> tuple[list, list, list]:
    """Register, lane and warp bases of the A operand ``[rows, cols]`` of an 8-bit ``mma.sync``
    m16n8k32 (four columns per register) with 4 warps along the rows (Triton's linear layout, as
    ``gl.to_linear_layout`` gives)."""
    registers = [[0, 1], [0, 2], [8, 0]] + [[0, 16 << i] for i in range(int(math.log2(cols)) - 4)]
    registers += [[64 << i, 0] for i in range(int(math.log2(rows)) - 6)]
    return registers, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]]


def step_tokens(group_size: int, value_bits: int) -> int:
    """Tokens per step of the packed groups: 128 (4 warps x 32 rows of the MMA) where the value codes
    have 2 bits, else 64 (4-bit values). A step makes one softmax update (one cross-warp maximum, one
    rescaling of the accumulators); with 64-token groups a 128-token step covers two groups
    (:func:`group_step_tokens`). A step's integer value sums stay inside int32: with 2-bit fields a
    byte reads at most 128 in magnitude, weighted 4^m over the b/2 field words, so they reach at most
    T x (2^b - 1) / 3 x 128 x 127 x 128 (the high part's weight), 1.3e9 even for 4-bit values at 128
    tokens. 4-bit values nonetheless take 64-token steps (128-token steps are untimed for them)."""
    return 128 if value_bits <= 2 else 64


def group_step_tokens(group_size: int, value_bits: int) -> int:
    """Tokens of one key group in a step: the step's (:func:`step_tokens`), or the whole group where a
    step covers two groups (64-token groups, 128-token steps). Each group of a step has its own query
    operands, so the key products of a step are made group by group, on operands of this many tokens;
    the softmax update and the value accumulators are shared."""
    return min(step_tokens(group_size, value_bits), group_size)


def top_field_correction(value_bits: int) -> float:
    """What a top-field row (channel % 4 == 3) of the value operands reads short of the code: its
    field words' high bits are stored inverted, so each reads ``code - 2`` and the Horner sum over the
    ``b/2`` field words (weights 4^m) ``code - 2 * (4^(b/2) - 1) / 3``: 2 for 2-bit values, 10 for
    4-bit ones. The kernel adds this times ``sum(p * scale)`` to those rows."""
    return 2.0 * ((1 << value_bits) - 1) / 3.0


def paired_columns(ratio: int) -> bool:
    """Whether the MMA's 8 columns hold each of the ``ratio`` query heads twice, its high and low 8-bit
    parts side by side (at most 4 heads per KV head; see the kernel)."""
    return ratio <= 4


def _key_owned_layouts(cols: int, tokens: int, distance: int) -> tuple[gl.DistributedLinearLayout, gl.DistributedLinearLayout]:
    """For thread-owned key words (``pnmix_patch/reference/quantize.py``, tiles ``distance`` tokens apart): the
    8-bit A-operand layout of a key tile ``[T, cols]`` (``T = tokens``) with token t split into (tile,
    tile pair, row half, lane row) and channel k into (chunk, half, lane column, byte): ``[T /
    distance, distance / 16, 2, 8, cols / 32, 2, 4, 4]``; and the layout of the step's words as
    shared memory holds them, ``[distance / 16, cols / 4, 4]`` (tile pair, 8 chunk + lane row, lane
    column): each thread's own word, one per chunk."""

    def split(bases):
        return [[t // distance, t % distance >> 4, (t >> 3) & 1, t & 7, k >> 5, (k >> 4) & 1, (k >> 2) & 3, k & 3] for t, k in bases]

    def word(bases):
        return [[t % distance >> 4, 8 * (k >> 5) + (t & 7), (k >> 2) & 3] for t, k in bases]

    bases = _a8_operand_bases(tokens, cols)
    shape = [tokens // distance, distance // 16, 2, 8, cols // 32, 2, 4, 4]
    return (
        gl.DistributedLinearLayout(*(split(b) for b in bases), [], shape),
        gl.DistributedLinearLayout(*(word(b) for b in bases), [], [distance // 16, cols // 4, 4]),
    )


def _value_byte_layout(head_dim: int, tokens: int) -> gl.DistributedLinearLayout:
    """The 8-bit A-operand layout of the values ``[D, T]`` (channel rows, token columns) with channel
    c split into (word row, 2-bit field) and token t into (quad, byte): ``[D/4, 4, T/4, 4]``."""

    def split(bases):
        return [[c >> 2, c & 3, t >> 2, t & 3] for c, t in bases]

    shape = [head_dim // 4, 4, tokens // 4, 4]
    return gl.DistributedLinearLayout(*(split(b) for b in _a8_operand_bases(head_dim, tokens)), [], shape)


@functools.cache
def layouts(head_dim: int, high_width: int, query_rows: int, groups: int, tokens: int, key_distance: int) -> dict:
    """The kernel's layouts (constexpr arguments) for ``head_dim``, a first key tile ``high_width``
    channels wide (a tile of width 0 gets placeholder layouts, never used; when there are two, both
    are half the head wide), ``query_rows`` rows of query operands (the query heads per KV head
    rounded up to a power of two: 4 when the columns are paired, see the kernel) for each of the
    ``groups`` key groups of a step, ``tokens`` of a group per step (:func:`group_step_tokens`) and
    the ``key_distance`` of the thread-owned key words."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    low_width = head_dim - high_width
    (key_high, key_words_high), (key_low, key_words_low) = (
        _key_owned_layouts(width or head_dim, tokens, key_distance) for width in (high_width, low_width)
    )
    return dict(
        MMA=mma,
        A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        A8=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4),
        B8=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4),
        KEY_BYTES_HIGH=key_high,
        KEY_BYTES_LOW=key_low,
        KEY_WORDS_HIGH=key_words_high,
        KEY_WORDS_LOW=key_words_low,
        QUERY=query_layout(groups, query_rows, high_width if 0 < high_width < head_dim else head_dim),
        VALUE_BYTES=_value_byte_layout(head_dim, tokens),
    )


def query_layout(groups: int, rows: int, cols: int) -> gl.BlockedLayout:
    """A blocked layout of the 4 warps over ``[groups, rows, cols]``: the groups in separate lanes
    (``32 / groups`` lanes each), and over each group's ``[rows, cols]`` up to ``4 * groups``
    consecutive elements of a row per thread, the group's lanes along the row, warps along the columns
    only where the rows are fewer than the warps (a tensor of fewer than ``32 / groups * 4`` elements
    per group is then held more than once). Used for the query operands ``[key groups of a step, query
    heads, tile width]``: with 4 or more heads a row's reduction stays within a warp, and one shuffle
    reduces every group's rows at once."""
    lanes = 32 // groups
    vector = max(1, min(4 * groups, rows * cols // (lanes * NUM_WARPS)))
    lanes_col = min(lanes, cols // vector)
    warps_col = max(1, min(NUM_WARPS, cols // (vector * lanes_col)))
    return gl.BlockedLayout([1, 1, vector], [groups, lanes // lanes_col, lanes_col], [1, NUM_WARPS // warps_col, warps_col], [2, 1, 0])


def _accumulator_bases(rows: int, columns: int) -> tuple[list, list, list]:
    """Register, lane and warp bases of an ``mma.sync`` m16n8 accumulator ``[rows, columns]`` with 4
    warps along the rows (``NVMMADistributedLayout`` version 2): a thread holds columns 2c and
    2c + 1 of rows r and r + 8 of each 64-row tile (c: lane % 4, r: lane / 4), 8-column tiles in
    registers."""
    registers = [[0, 1], [8, 0]] + [[0, 8 << i] for i in range(int(math.log2(columns)) - 3)]
    registers += [[64 << i, 0] for i in range(int(math.log2(rows)) - 6)]
    return registers, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]]


def heads_layout(rows: int) -> gl.DistributedLinearLayout:
    """Layout of ``[rows, 4]`` per-head values made from a paired accumulator ``[rows, 8]`` (columns
    2j and 2j + 1: head j's high and low parts, in one thread): the accumulator's layout without its
    column bit 0, so every thread holds one head of rows r and r + 8 of each 64-row tile."""
    registers, lanes, warps = _accumulator_bases(rows, 8)
    return gl.DistributedLinearLayout(registers[1:], [[0, 1], [0, 2]] + lanes[2:], warps, [], [rows, 4])


def partials_layout(columns: int, paired: bool) -> gl.DistributedLinearLayout:
    """Layout of the 4 warps' column maxima ``[4, columns]`` (:func:`_column_max`) of the scores
    (``paired``: per head, :func:`heads_layout`; else the MMA accumulators): every thread holds the
    4 rows of the columns it holds of the scores, so the maximum over the rows stays in the thread."""
    if paired:  # heads in lanes 0 and 1
        registers, lanes = [[1, 0], [2, 0]], [[0, 1], [0, 2]]
    else:  # column bit 0, and bit 3 of 16, in registers, bits 1 and 2 in lanes 0 and 1
        registers, lanes = [[0, 1], [1, 0], [2, 0]] + ([[0, 8]] if columns == 16 else []), [[0, 2], [0, 4]]
    return gl.DistributedLinearLayout(registers, lanes + [[0, 0]] * 3, [[0, 0], [0, 0]], [], [4, columns])


def quad_layout(quads: int) -> gl.BlockedLayout:
    """A blocked layout of the 4 warps over ``[rows, quads, 4]`` words: each thread holds one quad of
    four consecutive words (one 16-byte access), lanes along the quads, warps along the rows."""
    lanes = min(32, quads)
    return gl.BlockedLayout([1, 1, 4], [32 // lanes, lanes, 1], [NUM_WARPS, 1, 1], [2, 1, 0])


def operand_shared_layout(row_bytes: int, rows: int, slice_bytes: int) -> gl.SwizzledSharedLayout:
    """Shared layout of an 8-bit B operand stored N-major (``[query heads, K]``, rows of ``row_bytes``),
    written ``rows`` at a time and read in column slices of ``slice_bytes``: 16-byte chunks swizzled
    within both, so that ``ldmatrix``'s eight row reads hit at most two rows per bank group."""
    per_phase = max(1, 128 // row_bytes)
    return gl.SwizzledSharedLayout(16, per_phase, max(1, min(8, row_bytes // 16, slice_bytes // 16, rows // per_phase)), [1, 0])


def value_copy_layout(group_size: int) -> gl.BlockedLayout:
    """Layout of the value words' copy ``[b_V * D / 32 * 4, G / 4]`` (a group's words as the cache
    stores them, contiguous): four consecutive words per thread (one 16-byte copy), lanes along the rows."""
    lanes = min(32, group_size // 16)
    return gl.BlockedLayout([1, 4], [32 // lanes, lanes], [NUM_WARPS, 1], [1, 0])


def value_shared_layout(group_size: int, tokens: int) -> gl.SwizzledSharedLayout:
    """Shared layout of a group's value words ``[b_V * D / 32 * 4, G / 4]`` (rows of ``G`` bytes), read
    in column slices of ``tokens / 4`` words: 16-byte chunks (the copy's) swizzled within both.

    Each 8x8 matrix of an ``ldmatrix`` of the value operands reads the same 16 bytes of two adjacent
    word rows (its eight row addresses: lanes that differ only in a channel's 2-bit field share a
    word). Unswizzled, with rows of 128 bytes (``G`` = 128), both fall in the same four banks: two
    wavefronts per matrix. Swizzled, Nsight Compute reports no bank conflict of shared loads; 64-token
    groups (pnmix-2), two rows per 128 bytes, have no conflict to remove."""
    per_phase = max(1, 128 // group_size)
    return gl.SwizzledSharedLayout(4, per_phase, max(1, min(8, group_size // 16, tokens // 16)), [1, 0])


BYTES_ASM = gl.constexpr("and.b32 $0, $1, $5;")
"""PTX of one register of an 8-bit operand: a word in operand order ANDed with ``0x01010101 << j``
(keys) or ``0x03030303 << 2k`` (values) (``$1..$4`` are the word, ``$5..$8`` the mask, four times
each: one per byte of the result)."""
BYTES_CONSTRAINTS = gl.constexpr(",".join(["=r"] + ["r"] * 8))


ROUNDING = gl.constexpr(12582912.0)
"""1.5 * 2^23: a float32 ``y + ROUNDING`` (``|y| < 2^22``) is rounded to an integer (to nearest,
ties to even) held in the low bits of its significand, two's complement: its low byte is
``round(y)`` as an int8 (modulo 256), with no float-to-integer conversion."""


@gluon.jit
def _split_8bit(y):
    """The two 8-bit parts of a B operand (``|y| <= 127``), ``round(y)`` and ``round(128 * (y -
    round(y)))``, each in the low byte of a float32 (see :data:`ROUNDING`; :func:`_int8` reads it):
    four float additions and multiplications."""
    shifted = y + ROUNDING
    return shifted, (y - (shifted - ROUNDING)) * 128.0 + ROUNDING  # shifted - ROUNDING = round(y), exactly


PACK_ASM = gl.constexpr(
    """{
.reg .b32 t0, t1;
prmt.b32 t0, $1, $2, 0x0040;
prmt.b32 t1, $3, $4, 0x0040;
prmt.b32 $0, t0, t1, 0x5410;
}"""
)
"""PTX packing the low bytes of four words ``$1..$4`` into ``$0`` (byte i from word i + 1)."""


@gluon.jit
def _wait_for_previous_kernel(PDL: gl.constexpr):
    """``kernels.common.wait_for_previous_kernel`` in Gluon (``griddepcontrol``, for a launch with PDL)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _let_next_kernel_launch(PDL: gl.constexpr):
    """``kernels.common.let_next_kernel_launch`` in Gluon."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _int8(x):
    """The int8 in the low byte of float32 ``x`` (a part from :func:`_split_8bit`), four per
    :data:`PACK_ASM`. Not ``.to(gl.int32, bitcast=True).to(gl.int8)``: after a ``gl.where`` of two
    parts, Triton 3.6's ptxas compiles that truncation as a float-to-uint8 conversion (``F2IP.U8``,
    255 for every part)."""
    return gl.inline_asm_elementwise(PACK_ASM, "=r,r,r,r,r", [x.to(gl.int32, bitcast=True)], gl.int8, True, 4)


@gluon.jit
def _copy_offsets(
    D: gl.constexpr,
    G: gl.constexpr,
    C_HIGH: gl.constexpr,
    PLANES_HIGH: gl.constexpr,
    BITS_LOW: gl.constexpr,
    BITS_V: gl.constexpr,
    W_HIGH: gl.constexpr,
    KEY_ROWS: gl.constexpr,
    LOW_ROW: gl.constexpr,
    STAGE_GROUPS: gl.constexpr,
    COPY_KEYS: gl.constexpr,
    COPY_VALUES: gl.constexpr,
):
    """What :func:`_copy_group_codes` reads of a stage's ``STAGE_GROUPS`` consecutive groups, relative
    to the first group's first word, made once per program: the key words ``[STAGE_GROUPS *
    KEY_ROWS, W / 4, 4]`` (``W``: a key tile's width; group g's from row g * KEY_ROWS on) and, per
    element, whether it comes from the high codes (``is_high``), its offset into them or into the low
    ones, and whether it is ``present`` (zeros elsewhere: the padding rows, and the high planes' words
    that a last partial chunk does not store); the value words ``[STAGE_GROUPS * b_V * D / 32 * 4, G /
    4]`` (the groups', in their order: consecutive groups' value words are consecutive); and each key
    and value row's group in the stage.

    A group's key rows: the first tile's low planes (``BITS_LOW * G / 32`` rows: row p * G / 32 + w is
    word row w of plane p), then its high planes (``PLANES_HIGH``, the selected channels' upper ones),
    then from row ``LOW_ROW`` on the second tile's low planes. Element ``[q, b]`` of a row is word ``4q
    + b`` of the tile's part of the row, as the cache holds it in operand order (thread-owned words:
    32 per 32-channel chunk); the high planes' last partial chunk is stored compacted
    (``quantize.compact_key_fields``), so its words are gathered from the pool of their pair of slots."""
    WORDS: gl.constexpr = G // 32
    W_LOW: gl.constexpr = D - W_HIGH
    W_TILE: gl.constexpr = W_HIGH if W_HIGH > 0 else W_LOW
    V_ROWS: gl.constexpr = BITS_V * (D // 32) * 4
    row = gl.arange(0, STAGE_GROUPS * KEY_ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY_KEYS)))
    key_group = gl.expand_dims(gl.expand_dims(row // KEY_ROWS, 1), 2)
    row = gl.expand_dims(gl.expand_dims(row % KEY_ROWS, 1), 2)
    quad = gl.expand_dims(gl.expand_dims(gl.arange(0, W_TILE // 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY_KEYS))), 0), 2)
    within = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_KEYS))), 0), 1)
    in_low = (row >= LOW_ROW) & (W_LOW > 0)  # rows of the second tile (and the padding after it)
    tile_row = gl.where(in_low, row - LOW_ROW, row)
    word = gl.where(in_low, W_HIGH, 0) + 4 * quad + within
    is_high = (tile_row >= BITS_LOW * WORDS) & (W_HIGH > 0) & ~in_low
    high_row = tile_row - BITS_LOW * WORDS  # of the high planes: slot high_row // WORDS, word row high_row % WORDS
    high_offset = high_row * C_HIGH + word
    high_present = (high_row < PLANES_HIGH * WORDS) & (word < C_HIGH - C_HIGH % 32)
    PART: gl.constexpr = C_HIGH % 32
    if PART > 0:
        # The compacted chunk: lane column within of lane row quad % 8 has a word in slot 2m + half iff
        # within < LANES[half]; the pool of the pair's words (first half's, then second half's, lane by
        # lane) is split over the two slots, PART words of each word row.
        FULL: gl.constexpr = C_HIGH - PART
        LANES_FIRST: gl.constexpr = min(PART, 16) // 4
        LANES_SECOND: gl.constexpr = (PART - min(PART, 16)) // 4
        half = high_row // WORDS % 2
        lane_row = quad % 8
        pool = gl.where(half == 0, lane_row * LANES_FIRST, 8 * LANES_FIRST + lane_row * LANES_SECOND) + within
        in_part = (word >= FULL) & (word < FULL + 32)
        slot = high_row // WORDS - half + pool // PART
        high_offset = gl.where(in_part, (slot * WORDS + high_row % WORDS) * C_HIGH + FULL + pool % PART, high_offset)
        lanes = gl.where(half == 0, LANES_FIRST, LANES_SECOND)
        high_present = gl.where(in_part, (high_row < PLANES_HIGH * WORDS) & (within < lanes), high_present)
    key_offsets = gl.where(
        is_high,
        key_group * (PLANES_HIGH * WORDS * C_HIGH) + high_offset,
        key_group * (BITS_LOW * WORDS * D) + tile_row * D + word,
    )
    present = gl.where(is_high, high_present, tile_row < BITS_LOW * WORDS)
    value_row = gl.expand_dims(gl.arange(0, STAGE_GROUPS * V_ROWS, layout=gl.SliceLayout(1, COPY_VALUES)), 1)
    quad = gl.expand_dims(gl.arange(0, G // 4, layout=gl.SliceLayout(0, COPY_VALUES)), 0)
    return is_high, key_offsets, present, key_group, value_row * (G // 4) + quad, value_row // V_ROWS


@gluon.jit
def _copy_group_codes(
    key_smem,
    value_smem,
    stage,
    group,
    count,
    kc_high,
    kc_low,
    v_codes,
    offsets,
    D: gl.constexpr,
    G: gl.constexpr,
    C_HIGH: gl.constexpr,
    PLANES_HIGH: gl.constexpr,
    BITS_LOW: gl.constexpr,
    BITS_V: gl.constexpr,
):
    """Start the asynchronous copies of the codes of one head's key groups from ``group`` on, a
    stage's worth (pointers: the head's bases; ``offsets``: :func:`_copy_offsets`), into ``stage`` of
    the shared buffers: the key words (runs of four words of a word row, as stored) and the value
    words (the groups', in operand order). Only the first ``count`` groups are read (the others are
    past this split's end). One copy per buffer: copies into one buffer are each fenced by a barrier."""
    is_high, key_offsets, present, key_group, value_offsets, value_group = offsets
    WORDS: gl.constexpr = G // 32
    key_base = gl.where(is_high, kc_high + group * (PLANES_HIGH * WORDS * C_HIGH), kc_low + group * (BITS_LOW * WORDS * D))
    async_copy.async_copy_global_to_shared(key_smem.index(stage), key_base + key_offsets, mask=present & (key_group < count))
    async_copy.async_copy_global_to_shared(
        value_smem.index(stage), v_codes + group * (G * BITS_V * (D // 32)) + value_offsets, mask=value_group < count
    )


@gluon.jit
def _load_group_params(
    group,
    count,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    D: gl.constexpr,
    G: gl.constexpr,
    STAGE_GROUPS: gl.constexpr,
    PARAMS_D: gl.constexpr,
    PARAMS_G: gl.constexpr,
):
    """Key scales and zeros ``[2, STAGE_GROUPS * D]`` and value scales and zeros ``[2, STAGE_GROUPS *
    G]`` (row 0: scales, row 1: zeros; each group's after the one before: they are consecutive in the
    cache) of the key groups from ``group`` on, of which the first ``count`` are read (16-bit, any
    alignment: plain loads, stored to shared memory later by :func:`_store_group_params`). The token
    scales and zeros of the others are 0: a stage's one value peak (:func:`_group_operands`) and its
    products with ``p`` (0 there) stay those of its read groups."""
    is_scale_d = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, PARAMS_D)), 1) == 0
    d = gl.expand_dims(gl.arange(0, STAGE_GROUPS * D, layout=gl.SliceLayout(0, PARAMS_D)), 0)
    is_scale_g = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, PARAMS_G)), 1) == 0
    t = gl.expand_dims(gl.arange(0, STAGE_GROUPS * G, layout=gl.SliceLayout(0, PARAMS_G)), 0)
    d_mask = d // D < count
    t_mask = t // G < count
    d += group * D
    t += group * G
    return (
        gl.load(gl.where(is_scale_d, k_scale + d, k_zero + d), mask=d_mask),
        gl.load(gl.where(is_scale_g, v_scale + t, v_zero + t), mask=t_mask, other=0.0),
    )


@gluon.jit
def _store_group_params(key_param_smem, value_param_smem, stage, params):
    """Store :func:`_load_group_params`' tensors into ``stage`` of the shared buffers (one store
    per buffer: stores into one buffer are each fenced by a barrier)."""
    key_param_smem.index(stage).store(params[0])
    value_param_smem.index(stage).store(params[1])


@gluon.jit
def _key_step_words(
    key_words,
    ROW: gl.constexpr,
    step: gl.constexpr,
    W: gl.constexpr,
    T: gl.constexpr,
    A8: gl.constexpr,
    KEY_BYTES: gl.constexpr,
    KEY_WORDS: gl.constexpr,
    KEY_DISTANCE: gl.constexpr,
):
    """The words of step ``step`` of one slot (a plane, or one word of a pair's fields) of a key tile
    ``W`` channels wide, the slot's word rows from ``ROW`` on in the stage's buffer
    (:func:`_copy_offsets`), as ``[T, W]`` in ``A8``: each element the word holding its operand byte.
    Each thread reads its own word of each 32-channel chunk, ``[tile pair, 8 chunk + lane row, lane
    column]`` -> ``[tile pair, lane row, chunk, lane column]`` -> broadcast over (tile, row half, half,
    byte) -> ``[T, W]``: no data moves. The step's word rows: those of its block of ``2 * KEY_DISTANCE``
    tokens (a step of ``KEY_DISTANCE`` tokens is one tile of it)."""
    PAIRS: gl.constexpr = KEY_DISTANCE // 16
    OWNED_ROW: gl.constexpr = ROW + step * T // (2 * KEY_DISTANCE) * PAIRS
    OWN: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(5, gl.SliceLayout(7, KEY_BYTES))))
    words = key_words.slice(OWNED_ROW, PAIRS, 0).load(KEY_WORDS)
    words = gl.convert_layout(gl.permute(gl.reshape(words, [PAIRS, W // 32, 8, 4]), [0, 2, 1, 3]), OWN, assert_trivial=True)
    words = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(words, 0), 2), 5), 7)
    shape: gl.constexpr = [T // KEY_DISTANCE, PAIRS, 2, 8, W // 32, 2, 4, 4]
    return gl.convert_layout(gl.reshape(gl.broadcast(words, gl.zeros(shape, gl.int32, KEY_BYTES))[0], [T, W]), A8, assert_trivial=True)


@gluon.jit
def _key_level_scores(
    high,
    low,
    key_words,
    query_high,
    query_low,
    ROW: gl.constexpr,
    WORDS: gl.constexpr,
    FIELDS: gl.constexpr,
    step: gl.constexpr,
    bit,
    W: gl.constexpr,
    T: gl.constexpr,
    A8: gl.constexpr,
    KEY_BYTES: gl.constexpr,
    KEY_WORDS: gl.constexpr,
    KEY_DISTANCE: gl.constexpr,
    PAIRED: gl.constexpr,
):
    """Add one key level of a tile ``W`` channels wide of step ``step`` (a plane, or with ``FIELDS`` a
    pair of planes stored as 2-bit fields: the slots from word row ``ROW`` on, ``WORDS`` rows each)
    times the tile's 8-bit query operands (B-operand registers) to the integer score accumulators:
    high and low parts in two (``low`` untouched when ``PAIRED``: both parts are columns of
    ``query_high``). ``bit``: the rows' bit of a byte (:func:`_key_row_factors`).

    A plane word's register is ``(word >> 2 * half) & 0x01010101 << bit`` (its byte's bit ``4 tile +
    2 half + row half``, ``bit = 4 tile + row half``); a field word's (the half's own slot) ``(word >>
    row half) & 0x03030303 << bit`` (its byte's field at ``4 tile + 2 row half``): both read their
    row's code ``2^bit`` times too large, so planes and fields share one accumulator."""
    words = _key_step_words(key_words, ROW, step, W, T, A8, KEY_BYTES, KEY_WORDS, KEY_DISTANCE)
    half = gl.expand_dims((gl.arange(0, W, layout=gl.SliceLayout(0, A8)) >> 4) & 1, 0)  # the chunk's second half: channels 16 .. 31
    if FIELDS:
        second = _key_step_words(key_words, ROW + WORDS, step, W, T, A8, KEY_BYTES, KEY_WORDS, KEY_DISTANCE)
        words = gl.where(half == 1, second, words) >> (bit & 1)
        mask = 0x03030303 << bit
    else:
        words = words >> (2 * half)
        mask = 0x01010101 << bit
    operand = gl.inline_asm_elementwise(BYTES_ASM, BYTES_CONSTRAINTS, [words, mask], gl.int8, True, 4)
    high = mma_v2(operand, query_high, high)
    if not PAIRED:
        low = mma_v2(operand, query_low, low)
    return high, low


@gluon.jit
def _key_row_factors(step: gl.constexpr, T: gl.constexpr, KEY_DISTANCE: gl.constexpr, A8: gl.constexpr, SCORES: gl.constexpr):
    """Which bit of a byte each score row of step ``step`` reads (``[T, 1]`` in ``A8``) and the factor
    that undoes its weight (``[T, 1]`` in ``SCORES``): bit ``4 * tile + row half`` of the row's token
    (``pnmix_patch/reference/quantize.py``; with ``T = KEY_DISTANCE`` the step is one tile); its codes
    read ``2^bit`` times too large."""
    t_a = gl.arange(0, T, layout=gl.SliceLayout(1, A8))
    t_s = gl.arange(0, T, layout=gl.SliceLayout(1, SCORES))
    TILE: gl.constexpr = step * T // KEY_DISTANCE % 2  # the step's first tile in its block
    bit_a = 4 * (t_a // KEY_DISTANCE + TILE) + (t_a >> 3) % 2
    unit = gl.exp2(-(4 * (t_s // KEY_DISTANCE + TILE) + (t_s >> 3) % 2).to(gl.float32))
    return gl.expand_dims(bit_a, 1), gl.expand_dims(unit, 1)


@gluon.jit
def _query_operands(query_high_smem, query_low_smem, x, inverse, ROWS: gl.constexpr, PAIRED: gl.constexpr):
    """Store the 8-bit query operands of one key tile for the stage's groups, ``y = x * inverse`` (``x =
    q * scale`` ``[groups, ROWS, W]``, ``inverse``: 127 / the column's largest ``|x|`` in the group)
    split by :func:`_split_8bit`, into the two buffers ``[groups * BLOCK_Q, W]`` of the high and low
    parts, group g's from row g * BLOCK_Q on (``PAIRED``: head j's into rows 2j and 2j + 1 of the
    group's rows of ``query_high_smem``). One store per buffer (stores into one buffer are each
    fenced by a barrier)."""
    high, low = _split_8bit(x * inverse)
    GROUPS: gl.constexpr = x.shape[0]
    if PAIRED:
        operands = gl.reshape(gl.permute(gl.join(high, low), [0, 1, 3, 2]), [GROUPS * 2 * ROWS, x.shape[2]])
        query_high_smem.store(_int8(operands))
    else:
        query_high_smem.store(_int8(gl.reshape(high, [GROUPS * ROWS, x.shape[2]])))
        query_low_smem.store(_int8(gl.reshape(low, [GROUPS * ROWS, x.shape[2]])))


@gluon.jit
def _operand_inverse(peak):
    """``127 / peak`` (``peak >= 0``, the largest magnitude an 8-bit operand's column holds): one
    ``rcp.approx`` (within 1 ulp, about 2^-23) in place of the division's ten instructions with their
    range checks. 0 where ``peak`` is 0, below float32's smallest normal, NaN, infinite or at least
    2^126 (the flushed reciprocal); infinite below about 3.7e-37, as with a division. A NaN group
    still gives NaN scores through its offset. The operands are exact
    to within that factor: ``y`` may pass 127 by 127 * 2^-22, which still rounds to 127, and the
    result is scaled back by ``peak`` itself, not by the inverse, so the errors match a division's."""
    reciprocal = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [peak], gl.float32, True, 1)
    return gl.where(peak >= 1.1754943508222875e-38, 127.0 * reciprocal, 0.0)


@gluon.jit
def _group_operands(
    key_param_smem,
    value_param_smem,
    stage,
    q_high,
    q_low,
    query_hh_smem,
    query_hl_smem,
    query_lh_smem,
    query_ll_smem,
    column_scale_smem,
    column_offset_smem,
    value_unit,
    D: gl.constexpr,
    G: gl.constexpr,
    STAGE_GROUPS: gl.constexpr,
    W_HIGH: gl.constexpr,
    QUERY_ROWS: gl.constexpr,
    PAIRED: gl.constexpr,
    QUERY: gl.constexpr,
    STAGE_TOKENS: gl.constexpr,
):
    """The operands of the ``STAGE_GROUPS`` key groups whose scales and zeros are in ``stage``: the 8-bit
    query operands of both key tiles and the columns' score scale and offset of each group, stored to
    shared memory (``q_high``, ``q_low``: the query of each tile's channels times ``qk_scale``,
    ``[QUERY_ROWS, W]``); returned, the values' factors: the inverse that makes ``p * token scale``
    8-bit (:func:`_split_8bit`) and the scale of the accumulators per channel row (``value_unit``
    times the stage's largest token scale / (127 * 128)), one of each for the stage's groups. Needs no
    barrier of its own: the kernel calls it where every warp is done with the previous stage's
    operands, after the value products in source order (``ptxas`` then interleaves the two; placed
    before them, its shared stores would keep the products' shared loads waiting)."""
    W_LOW: gl.constexpr = D - W_HIGH
    # q . (zero + code * scale) = (q * scale) . code + q . zero, with q * scale in 8-bit parts of one
    # scale per column and group (its largest |q * scale| is 127). Per group g: scales in row g, zeros
    # in row STAGE_GROUPS + g.
    key_params = key_param_smem.index(stage).reshape([2 * STAGE_GROUPS, D])
    # The values' 8-bit parts: y = p * token scale * 127 / (the stage's largest token scale), p <= 1 (one
    # peak for the stage's groups: their value products share a step's accumulators).
    value_peak = gl.max(value_param_smem.index(stage).slice(0, 1, 0).load(STAGE_TOKENS).to(gl.float32), 1)  # [1]
    value_inverse = gl.sum(_operand_inverse(value_peak), 0)
    value_scale = value_unit * (gl.sum(value_peak, 0) * (1.0 / (127.0 * 128.0)))
    # Per group and column: the largest |q * scale| and sum(q * zero), one reduction each ([groups, QUERY_ROWS, W]).
    PARAMS: gl.constexpr = gl.SliceLayout(1, QUERY)
    if W_HIGH > 0:
        x_high = gl.expand_dims(q_high, 0) * gl.expand_dims(
            key_params.slice(0, STAGE_GROUPS, 0).slice(0, W_HIGH, 1).load(PARAMS).to(gl.float32), 1
        )
        terms = gl.abs(x_high)
        zeros = key_params.slice(STAGE_GROUPS, STAGE_GROUPS, 0).slice(0, W_HIGH, 1).load(PARAMS).to(gl.float32)
        offsets = gl.expand_dims(q_high, 0) * gl.expand_dims(zeros, 1)
    if W_LOW > 0:
        scales = key_params.slice(0, STAGE_GROUPS, 0).slice(W_HIGH, W_LOW, 1).load(PARAMS).to(gl.float32)
        x_low = gl.expand_dims(q_low, 0) * gl.expand_dims(scales, 1)
        low_terms = gl.abs(x_low)
        zeros = key_params.slice(STAGE_GROUPS, STAGE_GROUPS, 0).slice(W_HIGH, W_LOW, 1).load(PARAMS).to(gl.float32)
        low_offsets = gl.expand_dims(q_low, 0) * gl.expand_dims(zeros, 1)
        if W_HIGH > 0:
            terms = gl.maximum(terms, low_terms)
            offsets += low_offsets
        else:
            terms = low_terms
            offsets = low_offsets
    peak = gl.max(terms, 2)
    k_offset = gl.sum(offsets, 2)  # NaN for a non-finite group (NaN zeros), so its scores are NaN
    inverse = gl.expand_dims(_operand_inverse(peak), 2)
    if W_HIGH > 0:
        _query_operands(query_hh_smem, query_hl_smem, x_high, inverse, QUERY_ROWS, PAIRED)
    if W_LOW > 0:
        _query_operands(query_lh_smem, query_ll_smem, x_low, inverse, QUERY_ROWS, PAIRED)
    # Score = (128 * high + low) * peak / (127 * 128) * key_unit + offset, per group [STAGE_GROUPS * QUERY_ROWS].
    column_scale_smem.store(gl.reshape(peak * (1.0 / (127.0 * 128.0)), [STAGE_GROUPS * QUERY_ROWS]))
    column_offset_smem.store(gl.reshape(k_offset, [STAGE_GROUPS * QUERY_ROWS]))
    return value_inverse, value_scale


@gluon.jit
def _column_max(scores, max_smem, PARTIALS: gl.constexpr, SCORES: gl.constexpr):
    """The maximum of each column of ``scores`` ``[T, N]`` (layout ``SCORES``: the MMA accumulators' or
    :func:`heads_layout`; warp w holds rows 16w + 64k .. 16w + 64k + 15), in ``gl.SliceLayout(0,
    SCORES)``: each warp's within the warp, then the 4 warps' through ``max_smem`` ``[4, N]`` with one
    barrier (``gl.max(scores, 0)`` takes two)."""
    T: gl.constexpr = scores.shape[0]
    per_warp = gl.max(gl.max(gl.reshape(scores, [T // 64, WARPS, 16, scores.shape[1]]), 2), 0)
    max_smem.store(per_warp)
    _barrier()
    return gl.convert_layout(gl.max(max_smem.load(PARTIALS), 0), gl.SliceLayout(0, SCORES), assert_trivial=True)


@gluon.jit
def _pair_parts(x, HEADS: gl.constexpr):
    """The even and odd columns of a paired accumulator ``x`` ``[R, 2 Q]`` (head j's high and low
    parts, see the kernel's ``PAIRED``), each ``[R, Q]`` in ``HEADS`` (:func:`heads_layout`): both
    columns of a pair are in one thread, so no data moves."""
    high, low = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    return gl.convert_layout(high, HEADS, assert_trivial=True), gl.convert_layout(low, HEADS, assert_trivial=True)


@gluon.jit
def _join_parts(high, low, MMA: gl.constexpr):
    """``[R, Q]`` high and low parts -> ``[R, 2 Q]`` with head j's in columns 2j and 2j + 1, in the
    MMA accumulators' layout (the inverse of :func:`_pair_parts`: no data moves)."""
    return gl.convert_layout(gl.reshape(gl.join(high, low), [high.shape[0], 2 * high.shape[1]]), MMA, assert_trivial=True)


@gluon.jit
def _group_scores(
    key_words,
    query_hh_smem,
    query_hl_smem,
    query_lh_smem,
    query_ll_smem,
    column_scale_smem,
    column_offset_smem,
    group: gl.constexpr,
    step: gl.constexpr,
    G: gl.constexpr,
    T_G: gl.constexpr,
    KEY_ROWS: gl.constexpr,
    LOW_ROW: gl.constexpr,
    PLANES_HIGH: gl.constexpr,
    BITS_LOW: gl.constexpr,
    W_HIGH: gl.constexpr,
    W_LOW: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    QUERY_ROWS: gl.constexpr,
    PAIRED: gl.constexpr,
    MMA: gl.constexpr,
    A8: gl.constexpr,
    B8: gl.constexpr,
    KEY_BYTES_HIGH: gl.constexpr,
    KEY_BYTES_LOW: gl.constexpr,
    KEY_WORDS_HIGH: gl.constexpr,
    KEY_WORDS_LOW: gl.constexpr,
    KEY_DISTANCE: gl.constexpr,
    GROUP_SCORES: gl.constexpr,
):
    """The scores ``[T_G, QUERY_ROWS]`` (``GROUP_SCORES``) of step ``step`` of the stage's key group
    ``group`` (its words from row ``group * KEY_ROWS`` of the stage's ``key_words``; its query operands
    and column factors from its rows of the shared buffers, see :func:`_group_operands`): Horner's
    scheme over the key levels, from the top: the high planes' levels (the first tile's only), then
    the low planes' (both tiles'), each a pair of planes as 2-bit fields or an odd last plane; before a
    level is added the accumulators are shifted by its plane count."""
    WORDS: gl.constexpr = G // 32
    ROW: gl.constexpr = group * KEY_ROWS
    LOW_LEVELS: gl.constexpr = (BITS_LOW + 1) // 2
    HIGH_LEVELS: gl.constexpr = (PLANES_HIGH + 1) // 2 if W_HIGH > 0 else 0
    column_scale = gl.expand_dims(column_scale_smem.slice(group * QUERY_ROWS, QUERY_ROWS).load(gl.SliceLayout(0, GROUP_SCORES)), 0)
    k_offset = gl.expand_dims(column_offset_smem.slice(group * QUERY_ROWS, QUERY_ROWS).load(gl.SliceLayout(0, GROUP_SCORES)), 0)
    if W_HIGH > 0:
        query_hh = query_hh_smem.slice(group * BLOCK_Q, BLOCK_Q, 0).permute([1, 0]).load(B8)
        query_hl = query_hh
        if not PAIRED:
            query_hl = query_hl_smem.slice(group * BLOCK_Q, BLOCK_Q, 0).permute([1, 0]).load(B8)
    if W_LOW > 0:
        query_lh = query_lh_smem.slice(group * BLOCK_Q, BLOCK_Q, 0).permute([1, 0]).load(B8)
        query_ll = query_lh
        if not PAIRED:
            query_ll = query_ll_smem.slice(group * BLOCK_Q, BLOCK_Q, 0).permute([1, 0]).load(B8)
    # Score rows read one bit position of each byte of the key operands (_key_row_factors).
    key_bit, key_unit = _key_row_factors(step, T_G, KEY_DISTANCE, A8, GROUP_SCORES)
    high = gl.zeros([T_G, BLOCK_Q], gl.int32, layout=MMA)
    low = high
    for level in gl.static_range(HIGH_LEVELS + LOW_LEVELS - 1, -1, -1):
        # Level l < LOW_LEVELS: planes 2l and 2l + 1 of the low codes (both tiles), from word row 2l *
        # WORDS; above: planes 2m and 2m + 1 of the high codes (m = l - LOW_LEVELS; the first tile
        # only), from word row (BITS_LOW + 2m) * WORDS. A level of two planes is stored as fields.
        if level < HIGH_LEVELS + LOW_LEVELS - 1:
            high = high << (min(2, BITS_LOW - 2 * level) if level < LOW_LEVELS else min(2, PLANES_HIGH - 2 * (level - LOW_LEVELS)))
            if not PAIRED:
                low = low << (min(2, BITS_LOW - 2 * level) if level < LOW_LEVELS else min(2, PLANES_HIGH - 2 * (level - LOW_LEVELS)))
        if W_HIGH > 0:
            high, low = _key_level_scores(
                high,
                low,
                key_words,
                query_hh,
                query_hl,
                ROW + (2 * level if level < LOW_LEVELS else BITS_LOW + 2 * (level - LOW_LEVELS)) * WORDS,
                WORDS,
                (BITS_LOW - 2 * level if level < LOW_LEVELS else PLANES_HIGH - 2 * (level - LOW_LEVELS)) >= 2,
                step,
                key_bit,
                W_HIGH,
                T_G,
                A8,
                KEY_BYTES_HIGH,
                KEY_WORDS_HIGH,
                KEY_DISTANCE,
                PAIRED,
            )
        if W_LOW > 0 and level < LOW_LEVELS:
            high, low = _key_level_scores(
                high,
                low,
                key_words,
                query_lh,
                query_ll,
                ROW + LOW_ROW + 2 * level * WORDS,
                WORDS,
                BITS_LOW - 2 * level >= 2,
                step,
                key_bit,
                W_LOW,
                T_G,
                A8,
                KEY_BYTES_LOW,
                KEY_WORDS_LOW,
                KEY_DISTANCE,
                PAIRED,
            )
    if PAIRED:
        high, low = _pair_parts(high, GROUP_SCORES)
    # 128 * high + low in int32: a row's codes read at most 2^5 times too large (bit 4 * tile + row
    # half), so |high| <= 128 channels x 15 x 127 x 32 = 7.8e6 and 128 * high + low < 1.01e9.
    return (high * 128 + low).to(gl.float32) * (key_unit * column_scale) + k_offset


@gluon.jit
def _join_groups(first, second, SCORES: gl.constexpr):
    """Two groups' scores ``[T_G, N]`` as one step's ``[2 T_G, N]`` in ``SCORES``, the first group's
    rows first: rows r and T_G + r are a thread's registers k = 0 and 1 of its row r (the accumulators'
    64-row tiles), so no data moves."""
    joined = gl.reshape(gl.permute(gl.join(first, second), [2, 0, 1]), [2 * first.shape[0], first.shape[1]])
    return gl.convert_layout(joined, SCORES, assert_trivial=True)


@gluon.jit
def _step_values(
    value_words,
    p_high_smem,
    p_low_smem,
    value_mask,
    step: gl.constexpr,
    D: gl.constexpr,
    T_G: gl.constexpr,
    STAGE_GROUPS: gl.constexpr,
    BITS_V: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    PAIRED: gl.constexpr,
    MMA: gl.constexpr,
    A8: gl.constexpr,
    B8: gl.constexpr,
    VALUE_BYTES: gl.constexpr,
    ACC: gl.constexpr,
):
    """The integer value sums ``[D, QUERY_ROWS]`` (``ACC``) of step ``step`` of the stage: each group's
    value field words (group g's from row ``g * b_V * D / 32 * 4`` of the stage's ``value_words``)
    times its tokens' 8-bit parts of ``p * scale`` (columns ``g * T_G`` on of the step's ``p``
    buffers), the groups into the same accumulators, Horner's scheme over the field words; ``128 *
    high + low``."""
    V_ROWS: gl.constexpr = BITS_V * (D // 32) * 4
    VALUE_WORDS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, VALUE_BYTES))  # [D / 4, T_G / 4]
    v_high = gl.zeros([D, BLOCK_Q], gl.int32, layout=MMA)
    v_low = v_high
    for value_pair in gl.static_range(BITS_V // 2 - 1, -1, -1):  # Horner's scheme over the field words
        if value_pair < BITS_V // 2 - 1:
            v_high = v_high * 4
            if not PAIRED:
                v_low = v_low * 4
        for group in gl.static_range(STAGE_GROUPS):
            p_high = p_high_smem.slice(group * T_G, T_G, 1).permute([1, 0]).load(B8)
            # [channel // 4, token quad] -> broadcast over (field, token within the quad) -> [D, T_G]: no data moves.
            words = (
                value_words.slice(group * V_ROWS + value_pair * (D // 4), D // 4, 0).slice(step * (T_G // 4), T_G // 4, 1).load(VALUE_WORDS)
            )
            words = gl.expand_dims(gl.expand_dims(words, 1), 3)
            words = gl.convert_layout(
                gl.reshape(gl.broadcast(words, gl.zeros([D // 4, 4, T_G // 4, 4], gl.int32, VALUE_BYTES))[0], [D, T_G]),
                A8,
                assert_trivial=True,
            )
            operand = gl.inline_asm_elementwise(BYTES_ASM, BYTES_CONSTRAINTS, [words, value_mask], gl.int8, True, 4)
            v_high = mma_v2(operand, p_high, v_high)
            if not PAIRED:
                v_low = mma_v2(operand, p_low_smem.slice(group * T_G, T_G, 1).permute([1, 0]).load(B8), v_low)
    if PAIRED:
        v_high, v_low = _pair_parts(v_high, ACC)
    return v_high * 128 + v_low


@gluon.jit
def _attend_dense(
    m_i,
    l_i,
    acc,
    q_t,
    k_ptr,
    v_ptr,
    length,
    D: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    QUERY_ROWS: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    MMA: gl.constexpr,
    SCORES: gl.constexpr,
    DENSE_SCORES: gl.constexpr,
    ACC: gl.constexpr,
):
    """Attend to ``length`` full-precision rows ``[tokens, D]`` at ``k_ptr``/``v_ptr`` (sinks, residual).
    State as the packed groups': ``m_i``, ``l_i`` ``[QUERY_ROWS]`` in ``gl.SliceLayout(0, SCORES)``,
    ``acc`` ``[D, QUERY_ROWS]`` in ``ACC``. With paired columns (``QUERY_ROWS < BLOCK_Q``) ``q_t`` holds
    each head in both columns of its pair: the scores are the even columns' (``DENSE_SCORES``), and p
    goes to the even columns only."""
    PAIRED: gl.constexpr = QUERY_ROWS < BLOCK_Q
    T: gl.constexpr = DENSE_T
    t_k = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, A)), 1)
    d_k = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, A)), 0)
    c_v = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, A)), 1)
    t_v = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(0, A)), 0)
    t_s = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, DENSE_SCORES)), 1)
    for start in range(0, length, T):
        k = gl.load(k_ptr + (start + t_k) * D + d_k, mask=(start + t_k) < length, other=0.0)
        v = gl.load(v_ptr + (start + t_v) * D + c_v, mask=(start + t_v) < length, other=0.0)
        scores = mma_v2(k, q_t, gl.zeros([T, BLOCK_Q], gl.float32, layout=MMA))
        if PAIRED:
            scores = _pair_parts(scores, DENSE_SCORES)[0]
        scores = gl.where((start + t_s) < length, scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(scores, 0), gl.SliceLayout(0, SCORES)))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(scores - gl.expand_dims(gl.convert_layout(m_new, gl.SliceLayout(0, DENSE_SCORES)), 0))
        l_i = l_i * alpha + gl.convert_layout(gl.sum(p, 0), gl.SliceLayout(0, SCORES))
        alpha_acc = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, ACC)), 0)
        if PAIRED:
            p = _join_parts(p, gl.zeros_like(p), MMA)
            values = mma_v2(v, gl.convert_layout(p.to(k.dtype), B), gl.zeros([D, BLOCK_Q], gl.float32, layout=MMA))
            acc = acc * alpha_acc + _pair_parts(values, ACC)[0]
        else:
            acc = mma_v2(v, gl.convert_layout(p.to(k.dtype), B), acc * alpha_acc)
        m_i = m_new
    return m_i, l_i, acc


@gluon.jit
def _decode_split_kernel_mma(
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
    RATIO: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    QUERY_ROWS: gl.constexpr,
    D: gl.constexpr,
    T: gl.constexpr,
    T_G: gl.constexpr,
    G: gl.constexpr,
    C_HIGH: gl.constexpr,
    PLANES_HIGH: gl.constexpr,
    BITS_LOW: gl.constexpr,
    BITS_V: gl.constexpr,
    W_HIGH: gl.constexpr,
    KEY_ROWS: gl.constexpr,
    LOW_ROW: gl.constexpr,
    MMA: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    A8: gl.constexpr,
    B8: gl.constexpr,
    KEY_BYTES_HIGH: gl.constexpr,
    KEY_BYTES_LOW: gl.constexpr,
    KEY_WORDS_HIGH: gl.constexpr,
    KEY_WORDS_LOW: gl.constexpr,
    KEY_DISTANCE: gl.constexpr,
    QUERY: gl.constexpr,
    VALUE_BYTES: gl.constexpr,
    QUERY_SHARED: gl.constexpr,
    P_SHARED: gl.constexpr,
    STAGES: gl.constexpr,
    COPY_KEYS: gl.constexpr,
    COPY_VALUES: gl.constexpr,
    VALUE_SHARED: gl.constexpr,
    PARAMS_D: gl.constexpr,
    PARAMS_G: gl.constexpr,
    STAGE_TOKENS: gl.constexpr,
    PARTIALS: gl.constexpr,
    OUT: gl.constexpr,
    SCORES: gl.constexpr,
    GROUP_SCORES: gl.constexpr,
    DENSE_SCORES: gl.constexpr,
    ACC: gl.constexpr,
    TOP_CORRECTION: gl.constexpr,
    PDL: gl.constexpr = False,
):
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // num_heads).to(gl.int64)
    h = (pid_bh % num_heads).to(gl.int64)
    dtype: gl.constexpr = query_ptr.dtype.element_ty
    W_LOW: gl.constexpr = D - W_HIGH

    # Query columns: with at most 4 query heads per KV head (QUERY_ROWS = 4, BLOCK_Q = 8) the MMA's
    # 8 columns are paired: columns 2j and 2j + 1 both belong to head j, the first for the high 8-bit
    # parts of the B operands, the second for the low parts, so one MMA makes both (else high and low
    # parts are two MMAs over QUERY_ROWS = BLOCK_Q columns). A thread holds both columns of a pair:
    # the scores, the softmax and the accumulated values are per head, [tokens or D, QUERY_ROWS] in
    # SCORES and ACC (heads_layout; the MMA layout when not PAIRED).
    PAIRED: gl.constexpr = QUERY_ROWS < BLOCK_Q

    # Query^T [D, BLOCK_Q] in the B-operand layout (PAIRED: head j in columns 2j and 2j + 1); scores
    # in the log2 domain (qk_scale has log2(e)).
    d_b = gl.arange(0, D, layout=gl.SliceLayout(1, B))
    head_b = gl.expand_dims(gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, B)) // (BLOCK_Q // QUERY_ROWS), 0)
    q_cols = query_ptr + b * s_qb + (h * RATIO + head_b) * s_qh + gl.expand_dims(d_b, 1)
    _wait_for_previous_kernel(PDL)
    q_natural = (gl.load(q_cols, mask=head_b < RATIO, other=0.0).to(gl.float32) * qk_scale).to(dtype)

    m_i = gl.full([QUERY_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, SCORES))
    l_i = gl.zeros([QUERY_ROWS], gl.float32, layout=gl.SliceLayout(0, SCORES))
    acc = gl.zeros([D, QUERY_ROWS], gl.float32, layout=ACC)  # rows: channels

    # Sinks: split 0 only.
    n_sink = gl.where(split == 0, gl.minimum(gl.load(sink_len_ptr + b), sink_cap), 0)
    m_i, l_i, acc = _attend_dense(
        m_i,
        l_i,
        acc,
        q_natural,
        sink_k_ptr + b * s_skb + h * s_skh,
        sink_v_ptr + b * s_svb + h * s_svh,
        n_sink,
        D,
        BLOCK_Q,
        QUERY_ROWS,
        A,
        B,
        MMA,
        SCORES,
        DENSE_SCORES,
        ACC,
    )

    # Packed groups: this split's slice of the sequence's groups, taken STAGE_GROUPS at a time (a stage:
    # one or, for 64-token groups in 128-token steps, two groups; a step's groups share its softmax
    # update and value accumulators, each has its own query operands).
    STAGE_GROUPS: gl.constexpr = T // T_G
    GROUP_STEPS: gl.constexpr = G // T_G
    n_groups = gl.minimum(gl.load(num_groups_ptr + b), group_cap)
    per_split = gl.cdiv(gl.cdiv(n_groups, num_splits), STAGE_GROUPS) * STAGE_GROUPS
    group_end = gl.minimum(split * per_split + per_split, n_groups)

    # Shared buffers: STAGES stages of key groups (one read as operands, the others' copies in flight).
    # (Buffers are indexed along their first dim; the layouts describe the rest.)
    SHARED_2D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SHARED_1D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scale_dtype: gl.constexpr = k_scale_ptr.dtype.element_ty
    SHARED_3D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    W_TILE: gl.constexpr = W_HIGH if W_HIGH > 0 else W_LOW  # both key tiles' width
    # Each stage: its groups' key words (the tiles' planes, _copy_offsets) and value words one group after the other.
    key_smem = gl.allocate_shared_memory(gl.int32, [STAGES, STAGE_GROUPS * KEY_ROWS, W_TILE // 4, 4], SHARED_3D)
    key_param_smem = gl.allocate_shared_memory(
        scale_dtype, [STAGES, 2, STAGE_GROUPS * D], SHARED_2D
    )  # [stage, 0]: scales, [stage, 1]: zeros
    V_COLUMNS: gl.constexpr = BITS_V * (D // 32)
    value_smem = gl.allocate_shared_memory(gl.int32, [STAGES, STAGE_GROUPS * V_COLUMNS * 4, G // 4], VALUE_SHARED)
    # p * token scale in 8-bit parts (see below), [BLOCK_Q, T]: the values' B operands of a step
    # (both parts in p_high_smem when PAIRED).
    p_high_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_Q, T], P_SHARED)
    p_low_smem = p_high_smem
    if not PAIRED:
        p_low_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_Q, T], P_SHARED)
    value_param_smem = gl.allocate_shared_memory(scale_dtype, [STAGES, 2, STAGE_GROUPS * G], SHARED_2D)
    kc_high = kc_high_ptr + b * s_khb + h * s_khh
    kc_low = kc_low_ptr + b * s_klb + h * s_klh
    k_scale = k_scale_ptr + b * s_ksb + h * s_ksh
    k_zero = k_zero_ptr + b * s_kzb + h * s_kzh
    v_codes = vc_ptr + b * s_vcb + h * s_vch
    v_scale = v_scale_ptr + b * s_vsb + h * s_vsh
    v_zero = v_zero_ptr + b * s_vzb + h * s_vzh

    # Key tiles: stored channels [0, W_HIGH) (PLANES_HIGH planes) and [W_HIGH, D) (BITS_LOW planes).
    # Their levels (planes, or pairs of planes as 2-bit fields) are 8-bit operands (a row's codes read
    # 2^bit times too large, see _key_level_scores) met by the query times the group's channel scales
    # in two 8-bit parts (high, low: 15 significant bits), made once per group by all warps together
    # into shared memory (see _query_operands): two buffers per tile, or one of both parts when
    # PAIRED, with BLOCK_Q rows per group of the stage; every level of a tile meets the same operands.
    # Both tiles are W_TILE wide.
    order_ptrs = order_ptr + b * s_ob + h * s_oh
    QUERY_2D: gl.constexpr = gl.SliceLayout(0, QUERY)  # [QUERY_ROWS, W_TILE]
    j_q = gl.expand_dims(gl.arange(0, QUERY_ROWS, layout=gl.SliceLayout(1, QUERY_2D)), 1)
    c_q = gl.arange(0, W_TILE, layout=gl.SliceLayout(0, QUERY_2D))
    if W_HIGH > 0:
        q_high = (
            gl.load(
                query_ptr + b * s_qb + (h * RATIO + j_q) * s_qh + gl.expand_dims(gl.load(order_ptrs + c_q), 0), mask=j_q < RATIO, other=0.0
            ).to(gl.float32)
            * qk_scale
        )
        query_hh_smem = gl.allocate_shared_memory(gl.int8, [STAGE_GROUPS * BLOCK_Q, W_TILE], QUERY_SHARED)
        query_hl_smem = query_hh_smem
        if not PAIRED:
            query_hl_smem = gl.allocate_shared_memory(gl.int8, [STAGE_GROUPS * BLOCK_Q, W_TILE], QUERY_SHARED)
    if W_LOW > 0:
        q_low = (
            gl.load(
                query_ptr + b * s_qb + (h * RATIO + j_q) * s_qh + gl.expand_dims(gl.load(order_ptrs + W_HIGH + c_q), 0),
                mask=j_q < RATIO,
                other=0.0,
            ).to(gl.float32)
            * qk_scale
        )
        query_lh_smem = gl.allocate_shared_memory(gl.int8, [STAGE_GROUPS * BLOCK_Q, W_TILE], QUERY_SHARED)
        query_ll_smem = query_lh_smem
        if not PAIRED:
            query_ll_smem = gl.allocate_shared_memory(gl.int8, [STAGE_GROUPS * BLOCK_Q, W_TILE], QUERY_SHARED)
    if W_HIGH == 0:  # placeholders of the absent tile (never read)
        q_high, query_hh_smem, query_hl_smem = q_low, query_lh_smem, query_ll_smem
    if W_LOW == 0:
        q_low, query_lh_smem, query_ll_smem = q_high, query_hh_smem, query_hl_smem
    # Per group of the stage and query head: the scores' scale and offset, handed to the scores' layout in shared memory.
    column_scale_smem = gl.allocate_shared_memory(gl.float32, [STAGE_GROUPS * QUERY_ROWS], SHARED_1D)
    column_offset_smem = gl.allocate_shared_memory(gl.float32, [STAGE_GROUPS * QUERY_ROWS], SHARED_1D)
    max_smem = gl.allocate_shared_memory(gl.float32, [WARPS, QUERY_ROWS], SHARED_2D)  # per warp: its rows' maxima

    # Value field words: 8-bit operands like the keys' (row c read field c % 4 of its bytes: 4^(c % 4)
    # times its code; the top field 64 * (code - 2), its high bit stored inverted).
    rows_acc = gl.arange(0, D, layout=gl.SliceLayout(1, ACC))
    value_unit = gl.expand_dims(gl.exp2(-2.0 * (rows_acc % 4).to(gl.float32)), 1)
    value_mask = gl.expand_dims(0x03030303 << (2 * (gl.arange(0, D, layout=gl.SliceLayout(1, A8)) % 4)), 1)
    # The top fields' rows read each code short by TOP_CORRECTION (top_field_correction).
    value_top = gl.expand_dims(gl.where(rows_acc % 4 == 3, TOP_CORRECTION, 0.0), 1)
    l_rows = gl.zeros([T, QUERY_ROWS], gl.float32, layout=SCORES)  # per-thread partial sums over the packed tokens, see below
    zero_rows = l_rows
    scale_rows = l_rows
    step_rows = gl.expand_dims(gl.arange(0, T, layout=gl.SliceLayout(1, SCORES)), 1)

    group_start = split * per_split
    copy_offsets = _copy_offsets(
        D, G, C_HIGH, PLANES_HIGH, BITS_LOW, BITS_V, W_HIGH, KEY_ROWS, LOW_ROW, STAGE_GROUPS, COPY_KEYS, COPY_VALUES
    )
    for i in gl.static_range(STAGES - 1):
        first = group_start + i * STAGE_GROUPS
        _copy_group_codes(
            key_smem,
            value_smem,
            i,
            first,
            group_end - first,
            kc_high,
            kc_low,
            v_codes,
            copy_offsets,
            D,
            G,
            C_HIGH,
            PLANES_HIGH,
            BITS_LOW,
            BITS_V,
        )
        async_copy.commit_group()
    for i in gl.static_range(STAGES):
        first = group_start + i * STAGE_GROUPS
        params = _load_group_params(first, group_end - first, k_scale, k_zero, v_scale, v_zero, D, G, STAGE_GROUPS, PARAMS_D, PARAMS_G)
        _store_group_params(key_param_smem, value_param_smem, i, params)
    # The first stage's operands; each later stage's are made during the value products of the one before.
    value_inverse, value_scale = _group_operands(
        key_param_smem,
        value_param_smem,
        0,
        q_high,
        q_low,
        query_hh_smem,
        query_hl_smem,
        query_lh_smem,
        query_ll_smem,
        column_scale_smem,
        column_offset_smem,
        value_unit,
        D,
        G,
        STAGE_GROUPS,
        W_HIGH,
        QUERY_ROWS,
        PAIRED,
        QUERY,
        STAGE_TOKENS,
    )
    for first in range(group_start, group_end, STAGE_GROUPS):
        # Wait for this stage's codes (the next STAGES - 2 stages' copies stay in flight); the barrier
        # also makes the stage's query operands visible and ends the last iteration's reads of its
        # buffers' words.
        async_copy.wait_group(STAGES - 2)
        _barrier()
        stage = (first - group_start) // STAGE_GROUPS % STAGES
        # Start reading the scales and zeros of the stage STAGES on (they wait in registers until this
        # stage is done with its own).
        ahead = first + STAGES * STAGE_GROUPS
        params = _load_group_params(ahead, group_end - ahead, k_scale, k_zero, v_scale, v_zero, D, G, STAGE_GROUPS, PARAMS_D, PARAMS_G)
        key_words = key_smem.index(stage)
        value_words = value_smem.index(stage)
        value_params = value_param_smem.index(stage).reshape([2 * STAGE_GROUPS * G])
        for step in gl.static_range(GROUP_STEPS):
            for group in gl.static_range(STAGE_GROUPS):
                group_scores = _group_scores(
                    key_words,
                    query_hh_smem,
                    query_hl_smem,
                    query_lh_smem,
                    query_ll_smem,
                    column_scale_smem,
                    column_offset_smem,
                    group,
                    step,
                    G,
                    T_G,
                    KEY_ROWS,
                    LOW_ROW,
                    PLANES_HIGH,
                    BITS_LOW,
                    W_HIGH,
                    W_LOW,
                    BLOCK_Q,
                    QUERY_ROWS,
                    PAIRED,
                    MMA,
                    A8,
                    B8,
                    KEY_BYTES_HIGH,
                    KEY_BYTES_LOW,
                    KEY_WORDS_HIGH,
                    KEY_WORDS_LOW,
                    KEY_DISTANCE,
                    GROUP_SCORES,
                )
                if group == 0:
                    scores = group_scores
                else:
                    # The split's last stage may hold one group: the other's tokens take no part.
                    scores = gl.where(step_rows < (group_end - first) * G, _join_groups(scores, group_scores, SCORES), float("-inf"))

            token_scale = gl.expand_dims(value_params.slice(step * T, T).load(gl.SliceLayout(1, SCORES)).to(gl.float32), 1)
            token_zero = gl.expand_dims(
                value_params.slice(STAGE_GROUPS * G + step * T, T).load(gl.SliceLayout(1, SCORES)).to(gl.float32), 1
            )
            m_new = gl.maximum(m_i, _column_max(scores, max_smem, PARTIALS, SCORES))
            if step == GROUP_STEPS - 1:
                # Refill the last stage's buffers with the codes of the stage STAGES - 1 on, and this
                # stage's with the scales and zeros of the stage STAGES on. Here, after _column_max's
                # barrier, because Triton fences a write to a buffer and a read of it, in any part, with
                # a barrier: after the barrier that opens the stage, the copy would need one of its own
                # before the key words (another stage of the same buffers) are read. Every read of this
                # stage's token scales is done by now.
                ahead = first + (STAGES - 1) * STAGE_GROUPS
                _copy_group_codes(
                    key_smem,
                    value_smem,
                    (ahead - group_start) // STAGE_GROUPS % STAGES,
                    ahead,
                    group_end - ahead,
                    kc_high,
                    kc_low,
                    v_codes,
                    copy_offsets,
                    D,
                    G,
                    C_HIGH,
                    PLANES_HIGH,
                    BITS_LOW,
                    BITS_V,
                )
                async_copy.commit_group()
                _store_group_params(key_param_smem, value_param_smem, stage, params)
            alpha = gl.exp2(m_i - m_new)
            alpha_row = gl.expand_dims(alpha, 0)
            p = gl.exp2(scores - gl.expand_dims(m_new, 0))
            # p . (zero + code * scale) = (p * scale) . code + p . zero. The sums over tokens (of p, of
            # p * zero, of p * scale for the top fields) stay per thread, rescaled like acc, and are
            # reduced once after the loop.
            l_i = l_i * alpha
            l_rows = l_rows * alpha_row + p
            zero_rows = zero_rows * alpha_row + p * token_zero
            p_scaled = p * token_scale
            scale_rows = scale_rows * alpha_row + p_scaled
            p_high, p_low = _split_8bit(p_scaled * value_inverse)
            if PAIRED:
                p_high_smem.store(gl.permute(_int8(_join_parts(p_high, p_low, MMA)), [1, 0]))
            else:
                p_high_smem.store(gl.permute(_int8(p_high), [1, 0]))
                p_low_smem.store(gl.permute(_int8(p_low), [1, 0]))
            _barrier()  # every warp's tokens of p are in shared memory
            values = (
                _step_values(
                    value_words,
                    p_high_smem,
                    p_low_smem,
                    value_mask,
                    step,
                    D,
                    T_G,
                    STAGE_GROUPS,
                    BITS_V,
                    BLOCK_Q,
                    PAIRED,
                    MMA,
                    A8,
                    B8,
                    VALUE_BYTES,
                    ACC,
                ).to(gl.float32)
                * value_scale
            )
            alpha_acc = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, ACC), assert_trivial=True), 0)
            acc = acc * alpha_acc + values
            m_i = m_new
            if step == GROUP_STEPS - 1:
                # The next stage's operands, independent of this stage's value products (the barriers
                # above ended every warp's reads of the query operands and column factors of this stage).
                next_value_inverse, next_value_scale = _group_operands(
                    key_param_smem,
                    value_param_smem,
                    (first + STAGE_GROUPS - group_start) // STAGE_GROUPS % STAGES,
                    q_high,
                    q_low,
                    query_hh_smem,
                    query_hl_smem,
                    query_lh_smem,
                    query_ll_smem,
                    column_scale_smem,
                    column_offset_smem,
                    value_unit,
                    D,
                    G,
                    STAGE_GROUPS,
                    W_HIGH,
                    QUERY_ROWS,
                    PAIRED,
                    QUERY,
                    STAGE_TOKENS,
                )
        value_inverse = next_value_inverse
        value_scale = next_value_scale
    async_copy.wait_group(0)
    l_i += gl.sum(l_rows, 0)
    acc += gl.expand_dims(gl.convert_layout(gl.sum(zero_rows, 0), gl.SliceLayout(0, ACC)), 0)
    acc += value_top * gl.expand_dims(gl.convert_layout(gl.sum(scale_rows, 0), gl.SliceLayout(0, ACC)), 0)

    _let_next_kernel_launch(PDL)  # the merge kernel's programs start while the last splits finish
    # Residual: last split only.
    n_res = gl.where(split == num_splits - 1, gl.minimum(gl.load(res_len_ptr + b), residual_cap), 0)
    m_i, l_i, acc = _attend_dense(
        m_i,
        l_i,
        acc,
        q_natural,
        res_k_ptr + b * s_rkb + h * s_rkh,
        res_v_ptr + b * s_rvb + h * s_rvh,
        n_res,
        D,
        BLOCK_Q,
        QUERY_ROWS,
        A,
        B,
        MMA,
        SCORES,
        DENSE_SCORES,
        ACC,
    )

    # Partials [B, Hq, splits] and [B, Hq, splits, D], contiguous float32.
    j_s = gl.arange(0, QUERY_ROWS, layout=gl.SliceLayout(0, SCORES))
    rows = (b * num_heads * RATIO + h * RATIO + j_s) * num_splits + split
    j_ok = j_s < RATIO
    gl.store(m_out_ptr + rows, m_i, mask=j_ok)
    gl.store(l_out_ptr + rows, l_i, mask=j_ok)
    acc = gl.convert_layout(acc, OUT)  # [D, QUERY_ROWS]
    j_o = gl.arange(0, QUERY_ROWS, layout=gl.SliceLayout(0, OUT))
    rows_o = (b * num_heads * RATIO + h * RATIO + j_o) * num_splits + split
    d_o = gl.arange(0, D, layout=gl.SliceLayout(1, OUT))
    gl.store(acc_out_ptr + gl.expand_dims(rows_o, 0) * D + gl.expand_dims(d_o, 1), acc, mask=gl.expand_dims(j_o < RATIO, 0))


def default_splits(query: torch.Tensor, kv_programs: int, max_groups: int, group_size: int) -> int:
    """Split count: :func:`~.common.wave_filling_splits` over 4 program slots per
    multiprocessor: the most splits that fit in one wave if they fill it at least 95%, else the fewest
    that fill every slot in waves at least 95% full (``group_size`` is not used by this rule; the
    callers pass it). One wave where it can be filled: at batch 8 (64 KV programs on 528 slots) 8
    splits fill one wave to 97%, where filling every slot would take 16 splits in two waves.

    The kernel launches with at most ``MAX_REGISTERS`` = 128 registers per thread (uncapped it takes
    142, three programs per multiprocessor) and ``STAGES`` = 3. Its instructions depend on
    shared-memory loads closely, so it needs the fourth program's warps to hide their latency; with
    128-token steps a fifth (96 registers) is no faster. The stage count and the slots filled are
    chosen for large batches on an H200 (``python benchmarks/bench_attention.py --sweep-mma`` and
    ``--sweep-occupancy`` time the alternatives): 2 and 4 stages are about as fast as 3 there, and
    filling 4 slots beats filling 2, 3 or 5 at batch 1 and 32.
    """
    return wave_filling_splits(4 * multiprocessors(query.device.index), kv_programs, max_groups)


@functools.cache
def kernel_constants(
    head_dim: int,
    ratio: int,
    group_size: int,
    num_high: int,
    bits_high: int,
    bits_low: int,
    bits_value: int,
    stages: int = STAGES,
) -> dict:
    """The split kernel's constexpr arguments for a cache of these shapes (the launcher's, and
    those of an offline build, which compiles the kernel without a GPU). Cached: do not mutate."""
    high_width = high_tile_width(head_dim, num_high)
    block_q = max(8, triton.next_power_of_2(ratio))
    paired = paired_columns(ratio)
    query_rows = block_q // 2 if paired else block_q
    tokens = step_tokens(group_size, bits_value)
    group_tokens = group_step_tokens(group_size, bits_value)
    stage_groups = tokens // group_tokens
    planes_high = bits_high - bits_low
    key_distance = key_word_distance(group_size, head_dim, bits_low)
    assert key_distance and key_distance == key_word_distance(group_size, num_high, planes_high), "thread-owned words (supports_shapes)"
    kernel_layouts = layouts(head_dim, high_width, query_rows, stage_groups, group_tokens, key_distance)
    mma = kernel_layouts["MMA"]
    tile = high_width if 0 < high_width < head_dim else head_dim  # both key tiles' width
    # The key words' shared buffer: the first tile's low and high planes, the second's low planes from
    # row low_row on, padded to a power of two of at least the copy layout's rows (quad_layout).
    words = group_size // 32
    low_row = (bits_low + planes_high) * words if high_width > 0 else 0
    used_rows = low_row + (bits_low * words if high_width < head_dim else 0)
    key_rows = max(triton.next_power_of_2(used_rows), NUM_WARPS * 32 // min(32, tile // 4))
    return dict(
        RATIO=ratio,
        BLOCK_Q=block_q,
        QUERY_ROWS=query_rows,
        D=head_dim,
        T=tokens,
        T_G=group_tokens,
        G=group_size,
        C_HIGH=num_high,
        PLANES_HIGH=planes_high,
        BITS_LOW=bits_low,
        BITS_V=bits_value,
        TOP_CORRECTION=top_field_correction(bits_value),
        W_HIGH=high_width,
        KEY_ROWS=key_rows,
        LOW_ROW=low_row,
        KEY_DISTANCE=key_distance,
        STAGES=stages,
        COPY_KEYS=quad_layout(tile // 4),
        COPY_VALUES=value_copy_layout(group_size),
        VALUE_SHARED=value_shared_layout(group_size, group_tokens),
        QUERY_SHARED=operand_shared_layout(tile, block_q, tile),
        P_SHARED=operand_shared_layout(tokens, block_q, group_tokens),
        # [2, stage groups * D or G] scales and zeros, lanes along the columns; keys: where a stage has
        # two groups, two consecutive channels per thread (one 32-bit load)
        PARAMS_D=gl.BlockedLayout([2, stage_groups], [1, 32], [1, NUM_WARPS], [1, 0]),
        PARAMS_G=gl.BlockedLayout([2, 1], [1, 32], [1, NUM_WARPS], [1, 0]),
        # [1, stage groups * G]: the stage's token scales in every warp
        STAGE_TOKENS=gl.BlockedLayout([1, stage_groups * group_size // 32], [1, 32], [NUM_WARPS, 1], [1, 0]),
        PARTIALS=partials_layout(query_rows, paired),
        OUT=gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1]),
        SCORES=heads_layout(tokens) if paired else mma,
        GROUP_SCORES=heads_layout(group_tokens) if paired else mma,
        DENSE_SCORES=heads_layout(DENSE_T.value) if paired else mma,
        ACC=heads_layout(head_dim) if paired else mma,
        **kernel_layouts,
    )


def mma_decode_attention(
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
    max_registers: int | None = MAX_REGISTERS,
    stages: int = STAGES,
) -> torch.Tensor:
    """Launch the Gluon split kernel and the shared merge kernel (``split_and_merge``); arguments as
    ``decode_attention``.

    The caller checks :func:`supports`. ``num_splits`` (default :func:`default_splits`),
    ``max_registers`` (per thread, Triton's ``maxnreg``; None: the compiler's choice) and ``stages`` (shared buffers of key groups) are for benchmarks that sweep them.
    """
    if stages < 2:
        raise ValueError(f"stages must be at least 2 (one stage read while the next is copied), got {stages}")
    batch, q_heads, head_dim = query.shape
    heads = sink_keys.shape[1]
    group_cap, planes_high, words, c_high = key_codes_high.shape[2:]
    num_splits = default_splits(query, batch * heads, group_cap, 32 * words) if num_splits is None else num_splits
    constants = dict(
        kernel_constants(
            head_dim,
            q_heads // heads,
            32 * words,
            c_high,
            planes_high + key_codes_low.shape[3],
            key_codes_low.shape[3],
            value_codes.shape[3],
            stages,
        ),
        **launch_options(max_registers),
    )
    return split_and_merge(
        _decode_split_kernel_mma,
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


def launch_options(max_registers: int | None) -> dict:
    """The split kernel's compile options: :data:`NUM_WARPS` warps and ``max_registers`` per thread
    (Triton's ``maxnreg``; None: the compiler's choice)."""
    if max_registers is not None and (not isinstance(max_registers, int) or max_registers <= 0):
        raise ValueError(f"max_registers must be a positive int or None; got {max_registers!r}")
    return {"num_warps": NUM_WARPS, **({} if max_registers is None else {"maxnreg": max_registers})}


def compile_offline(
    head_dim: int,
    ratio: int,
    group_size: int,
    num_high: int,
    bits_high: int,
    bits_low: int,
    bits_value: int,
    dtype: torch.dtype,
    capability: int = 90,
    max_registers: int | None = MAX_REGISTERS,
):
    """The split kernel for a cache of these shapes, compiled for a GPU of compute ``capability`` (90:
    H100/H200) on any machine, GPU or not: Triton's compiled kernel (``.asm["ptx"]``, ``["cubin"]``).
    The constexprs are the launcher's (:func:`kernel_constants`); pointers and strides are specialized
    as divisible by 16, as a launch on such a cache specializes them. For the sm_90 build test and
    ``benchmarks/bench_kernel_instructions.py``; needs the compiler, so not under ``TRITON_INTERPRET=1``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype}")
    kernel = _decode_split_kernel_mma
    constants = kernel_constants(head_dim, ratio, group_size, num_high, bits_high, bits_low, bits_value)
    pointer_types = {name: "*i32" for name in ("kc_high_ptr", "kc_low_ptr", "vc_ptr", "sink_len_ptr", "num_groups_ptr", "res_len_ptr")}
    pointer_types.update(order_ptr="*i64", m_out_ptr="*fp32", l_out_ptr="*fp32", acc_out_ptr="*fp32")
    floats = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]

    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name.endswith("_ptr"):
            return pointer_types.get(name, floats)
        return "fp32" if name == "qk_scale" else "i32"

    signature = {name: arg_type(name) for name in kernel.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name not in constants and (name.endswith("_ptr") or name.startswith("s_"))
    }
    options = launch_options(max_registers)
    return triton.compile(GluonASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", capability, 32), options=options)
