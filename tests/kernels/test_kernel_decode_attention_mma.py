"""The Gluon decode-attention kernel: its PTX emulated on CPU, its layouts, its sm_90 build, and
(on a CUDA machine only: the interpreter cannot run Gluon) its results against the float32 reference."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from kernel_cases import LAYOUTS, decode_inputs, num_high, seeded

from pnmix_patch.kernels import decode_attention_mma as mma
from pnmix_patch.kernels.decode_attention import decode_attention_reference
from pnmix_patch.reference import quantize
from pnmix_patch.reference.quantize import dequantize_keys, pack_bits, planes_to_fields, transpose_byte_quads, values_to_operand_order

MASK = 0xFFFFFFFF


def run_ptx(asm: str, operands: list[int], outputs: int) -> list[int]:
    """Execute the kernel's PTX (``prmt.b32``, ``and.b32``) on 32-bit integers; returns ``$0 ..``."""
    registers = {f"${i}": value & MASK for i, value in enumerate(operands)}

    def value(token):
        return registers[token] if token in registers else int(token, 0) & MASK

    for line in asm.splitlines():
        match = re.match(r"(\S+) (\S+), (.*);", line.strip())
        if not match or match.group(1) == ".reg":
            continue
        op, target, args = match.group(1), match.group(2), [value(a) for a in match.group(3).split(", ")]
        if op == "prmt.b32":  # byte i of the result = byte selector[i] of {b, a}
            source = (args[1] << 32) | args[0]
            result = sum(((source >> (8 * ((args[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "and.b32":
            result = args[0] & args[1]
        else:
            raise AssertionError(f"unexpected instruction {op}")
        registers[target] = result
    return [registers[f"${i}"] for i in range(outputs)]


def byte(word: int, index: int) -> int:
    return (word >> (8 * index)) & 0xFF


def int8_elements(register: int) -> list[int]:
    return torch.tensor([byte(register, i) for i in range(4)], dtype=torch.uint8).view(torch.int8).tolist()


def test_pack_asm_takes_the_low_byte_of_each_word():
    """:data:`PACK_ASM` (what ``_int8`` runs on four float32 bit patterns): byte i of the result is
    the low byte of word i."""
    words = [0x4B40007F, 0x4B400081, 0x4B3FFFFF, 0x11223300]
    (packed,) = run_ptx(mma.PACK_ASM.value, [0, *words], 1)
    assert [byte(packed, i) for i in range(4)] == [0x7F, 0x81, 0xFF, 0x00]


@pytest.mark.parametrize("seed", [1, 2])
def test_value_field_words_are_8_bit_operands(seed):
    """Four tokens' 2-bit value codes of 16 channels (a field word each, ``quantize.planes_to_fields``)
    in operand order, ANDed with ``0x03030303 << 2k``: four int8 elements, token i's in element i,
    holding channel 4b + k's code times 4^k, and 64 * (code - 2) for the top field (k = 3)."""
    codes = torch.randint(0, 4, (4, 32), generator=torch.Generator().manual_seed(seed))
    fields = planes_to_fields(pack_bits(codes, 2))[:, :, 0].reshape(4, 2)  # [token, field word]: channels 0-15, 16-31
    transposed = [int(w) & MASK for w in transpose_byte_quads(fields[:, 0].contiguous(), 0)]
    for channel in range(16):
        b, k = channel // 4, channel % 4
        (register,) = run_ptx(mma.BYTES_ASM.value, [0, *[transposed[b]] * 4, *[0x03030303 << (2 * k)] * 4], 1)
        want = [64 * (int(codes[i, channel]) - 2) if k == 3 else 4**k * int(codes[i, channel]) for i in range(4)]
        assert int8_elements(register) == want


@pytest.mark.parametrize("value_bits", [2, 4])
def test_value_operands_rebuild_the_codes(value_bits):
    """The kernel's value arithmetic on a cache's field words, emulated: the int8 of ``byte & 3 << 2k``
    (channel row c, k = c % 4) of each field word, Horner's scheme over the words (times 4, top word
    first), the row weight ``4^-k`` and, on top-field rows, :func:`top_field_correction` added back
    give every code exactly."""
    codes = torch.randint(0, 2**value_bits, (8, 64), generator=torch.Generator().manual_seed(value_bits))
    words = planes_to_fields(pack_bits(codes, value_bits)).reshape(8, value_bits // 2, 4)  # [token, field word m, u]
    channel = torch.arange(64)
    k = channel % 4
    byte_of = (words[:, :, channel // 16] >> (8 * ((channel % 16) // 4))) & 0xFF  # [token, m, channel]
    reading = (byte_of & (3 << (2 * k))).to(torch.uint8).view(torch.int8).to(torch.float64)
    horner = torch.zeros(8, 64, dtype=torch.float64)
    for m in range(value_bits // 2 - 1, -1, -1):
        horner = horner * 4 + reading[:, m]
    rebuilt = horner * 4.0**-k + torch.where(k == 3, mma.top_field_correction(value_bits), 0.0)
    assert torch.equal(rebuilt, codes.to(torch.float64))


@pytest.mark.parametrize("tokens", [64, 128])
def test_value_byte_layout_splits_the_8_bit_operand(tokens):
    """The 8-bit A-operand layout (as Triton 3.7 prints it for ``[64, 64]``; 128 rows: a register bit
    for rows 64-127), and the value byte layout: it with rows and columns split the way the value
    words in operand order hold them, for both step sizes."""
    registers, lanes, warps = mma._a8_operand_bases(tokens, 64)
    assert registers == [[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]] + ([[64, 0]] if tokens == 128 else [])
    assert lanes == [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]] and warps == [[16, 0], [32, 0]]
    layout = mma._value_byte_layout(128, tokens)
    registers, lanes, warps = mma._a8_operand_bases(128, tokens)
    for basis, (c, t) in zip(layout.reg_bases + layout.lane_bases + layout.warp_bases, registers + lanes + warps, strict=True):
        assert basis == [c >> 2, c & 3, t >> 2, t & 3]


def linear_element(bases: tuple, register: int, lane: int, warp: int) -> list:
    """The element a linear layout's (register, lane, warp) bases ``bases`` give one register of one
    thread: the XOR of the bases of every set bit of the three indices."""
    element = [0] * len(bases[1][0])
    for dimension, index in zip(bases, (register, lane, warp), strict=True):
        for bit, basis in enumerate(dimension):
            if index >> bit & 1:
                element = [e ^ b for e, b in zip(element, basis, strict=True)]
    return element


@pytest.mark.parametrize("group_size, tokens, step", [(128, 128, 0), (256, 128, 1), (128, 64, 1), (256, 64, 2), (64, 64, 0)])
@pytest.mark.parametrize("cols", [32, 64, 128])
@pytest.mark.parametrize("planes", [1, 2])
def test_thread_owned_key_words_give_each_thread_its_operand_bits(group_size, tokens, step, cols, planes):
    """Thread-owned key words (``quantize.py``) as the kernel reads them (``_key_level_scores``): each
    thread loads the word the words' layout gives it (``_key_owned_layouts``) from the step's word
    rows; a plane's word shifted by 2 for a chunk's second half, or a pair of planes' 2-bit field
    word of the chunk's half (the second slot for the second half) shifted by the row half, then
    ANDed with its row's mask (``0x01010101`` or ``0x03030303`` shifted by ``_key_row_factors``'
    bit): every element of its 8-bit A operand is then 2^bit times the code (of one or two planes)
    of the token and channel the operand layout gives that element, for steps of 128 and 64 tokens,
    groups of 64 to 256."""
    distance = quantize.key_tile_distance(group_size)
    codes = torch.randint(0, 2**planes, (group_size, cols), generator=seeded(group_size + tokens + step + planes))
    words = quantize.keys_to_operand_order(pack_bits(codes.T, planes).permute(1, 2, 0).contiguous())  # [planes, G/32, cols]
    assert quantize.thread_owned_keys(group_size, cols, planes)
    key_bytes, key_words = mma._key_owned_layouts(cols, tokens, distance)
    operand = mma._a8_operand_bases(tokens, cols)
    # The split layout, reshaped to [T, cols], is the operand layout (the kernel's trivial conversion).
    for (tile, pair, row_half, lane_row, chunk, half, lane_column, in_register), (t, k) in zip(
        key_bytes.reg_bases + key_bytes.lane_bases + key_bytes.warp_bases, operand[0] + operand[1] + operand[2], strict=True
    ):
        assert (t, k) == (tile * distance + pair * 16 + row_half * 8 + lane_row, chunk * 32 + half * 16 + lane_column * 4 + in_register)
    word_bases = (key_words.reg_bases, key_words.lane_bases, key_words.warp_bases)
    first_row, first_tile = step * tokens // (2 * distance) * (distance // 16), step * tokens // distance % 2
    for warp in range(4):
        for lane in range(32):
            for register in range(2 ** len(operand[0])):
                t, k = linear_element(operand, register, lane, warp)
                pair, quad, lane_column = linear_element(word_bases, register, lane, warp)
                half, row_half = (k >> 4) & 1, (t >> 3) & 1
                bit = 4 * (t // distance + first_tile) + row_half
                if planes == 1:
                    word = int(words[0, first_row + pair, 4 * quad + lane_column]) & MASK
                    element = byte((word >> (2 * half)) & (0x01010101 << bit), k & 3)
                else:
                    word = int(words[half, first_row + pair, 4 * quad + lane_column]) & MASK
                    element = byte((word >> row_half) & (0x03030303 << bit), k & 3)
                assert element == (1 << bit) * int(codes[step * tokens + t, k])


@pytest.mark.parametrize("rows, columns", [(64, 8), (128, 8), (128, 16)])
def test_accumulator_bases_are_the_mma_fragment(rows, columns):
    """The accumulator bases are the PTX m16n8 fragment: lane l holds elements c0, c1 at row l / 4,
    columns 2 (l % 4) + {0, 1}, and c2, c3 eight rows below; warps 16 rows apart; further 8-column
    and 64-row tiles in registers."""
    bases = mma._accumulator_bases(rows, columns)
    column_tiles = columns // 8
    for register in range(2 ** len(bases[0])):
        tile = register >> 2
        for lane in range(32):
            for warp in range(4):
                want = [
                    lane // 4 + 8 * (register >> 1 & 1) + 16 * warp + 64 * (tile // column_tiles),
                    2 * (lane % 4) + (register & 1) + 8 * (tile % column_tiles),
                ]
                assert linear_element(bases, register, lane, warp) == want


@pytest.mark.parametrize("rows", [64, 128])
def test_heads_layout_is_the_paired_accumulator_without_its_part_column(rows):
    """:func:`heads_layout` is the 8-column accumulator fragment with column bit 0 (the part of a
    pair) dropped: lane l holds head l % 4 of the same rows, and no element twice."""
    accumulator = mma._accumulator_bases(rows, 8)
    heads = mma.heads_layout(rows)
    heads_bases = (heads.reg_bases, heads.lane_bases, heads.warp_bases)
    seen = set()
    for register in range(2 ** len(heads.reg_bases)):
        for lane in range(32):
            for warp in range(4):
                row, column = linear_element(accumulator, register << 1, lane, warp)
                got = linear_element(heads_bases, register, lane, warp)
                assert got == [row, column // 2]
                seen.add(tuple(got))
    assert len(seen) == rows * 4


@pytest.mark.parametrize(
    "layout, head_dim", [(layout, d) for layout in LAYOUTS for d in (64, 128) if (layout, d) != ("pnmix-2", 64)]
)  # pnmix-2 at head dim 64: the Triton kernel (test_supports_shapes)
def test_key_copy_layout_holds_each_quad_once(layout, head_dim):
    """The key words' buffer ``[KEY_ROWS, W / 4, 4]`` (``W``: a key tile's width) holds the first tile's
    low and high planes, the second's low planes from row ``LOW_ROW`` on, and no more rows than a
    power of two needs; its copy layout has one 16-byte quad per thread, and one CTA tile fits inside
    the buffer (no quad copied twice)."""
    _, group, bits_high, bits_low = LAYOUTS[layout]
    high = num_high(layout, head_dim)
    constants = mma.kernel_constants(head_dim, 4, group, high, bits_high, bits_low, 2)
    width, words = constants["W_HIGH"], group // 32
    assert constants["PLANES_HIGH"] == bits_high - bits_low
    tile = width if 0 < width < head_dim else head_dim
    first_rows = bits_high * words if width > 0 else 0
    used = first_rows + (bits_low * words if width < head_dim else 0)
    assert constants["LOW_ROW"] == first_rows
    layout = constants["COPY_KEYS"]
    shape = [constants["KEY_ROWS"], tile // 4, 4]
    tile = [s * t * w for s, t, w in zip(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta)]
    assert constants["KEY_ROWS"] in (triton.next_power_of_2(used), tile[0]) and constants["KEY_ROWS"] >= used
    assert layout.size_per_thread == [1, 1, 4]
    assert all(size % extent == 0 for size, extent in zip(shape, tile))


@pytest.mark.parametrize("group_size, value_bits", [(64, 2), (128, 2), (128, 4), (256, 2)])
def test_value_words_swizzle_puts_paired_rows_in_other_banks(group_size, value_bits):
    """The value words' shared layout keeps the copy's 16-byte chunks whole and puts the same chunk of
    word rows 2i and 2i + 1 (the two rows an ``ldmatrix`` matrix of the value operands reads) in
    different banks, within every column slice a step reads. Chunk address as Triton swizzles it:
    chunk ``c`` of row ``r`` lands at ``c ^ (r // per_phase % max_phase)``."""
    tokens = mma.group_step_tokens(group_size, value_bits)
    layout = mma.value_shared_layout(group_size, tokens)
    assert layout.vec == 4 and layout.order == [1, 0]
    rows, chunks = value_bits * 128 // 32 * 4, group_size // 16  # head dim 128; 16-byte chunks per row

    def bank_group(row: int, chunk: int) -> int:  # which 16-byte quarter of a 128-byte bank line
        swizzled = chunk ^ (row // layout.per_phase % layout.max_phase)
        assert swizzled // (tokens // 16) == chunk // (tokens // 16)  # stays in its step's column slice
        return (row * group_size + 16 * swizzled) // 16 % 8

    for row in range(0, rows, 2):
        for chunk in range(chunks):
            assert bank_group(row, chunk) != bank_group(row + 1, chunk)


@pytest.mark.parametrize(
    "head_dim, num_high, width", [(128, 64, 64), (128, 52, 64), (128, 128, 128), (128, 0, 0), (64, 26, 32), (128, 70, 128)]
)
def test_high_tile_width(head_dim, num_high, width):
    assert mma.high_tile_width(head_dim, num_high) == width


def test_split_8bit_arithmetic():
    """The float32 arithmetic of ``_split_8bit`` (emulated with torch float32): the low byte of
    ``y + 1.5 * 2^23`` is round(y) to nearest even, that of the second part round(128 * (y -
    round(y))), for y in [-127, 127] including ties; the parts rebuild y to 2^-8."""
    y = torch.cat([torch.linspace(-127, 127, 20001), torch.arange(-127, 128) + 0.5, torch.tensor([-0.5, 0.5, 1.5, -1.5])])
    y = y.clamp(-127, 127).to(torch.float32)
    shifted = y + mma.ROUNDING.value
    low = (y - (shifted - mma.ROUNDING.value)) * 128.0 + mma.ROUNDING.value
    high_byte = (shifted.view(torch.int32) & 0xFF).to(torch.uint8).view(torch.int8).to(torch.int32)
    low_byte = (low.view(torch.int32) & 0xFF).to(torch.uint8).view(torch.int8).to(torch.int32)
    assert torch.equal(high_byte, torch.round(y).to(torch.int32))  # torch.round: half to even
    assert torch.equal(low_byte, torch.round(128 * (y - torch.round(y))).to(torch.int32))
    assert low_byte.abs().max() <= 64
    assert ((high_byte + low_byte / 128.0) - y).abs().max() <= 2**-8


@pytest.mark.parametrize("ratio", range(1, 17))
def test_columns_pair_up_to_4_heads(ratio):
    """Paired columns (high and low parts in one MMA) for 1-4 query heads per KV head: 4 rows of
    query operands over 8 columns; otherwise one row per column, 8 or 16."""
    constants = mma.kernel_constants(128, ratio, 128, 64, 3, 1, 2)
    want = (4, 8) if ratio <= 4 else (8, 8) if ratio <= 8 else (16, 16)
    assert (constants["QUERY_ROWS"], constants["BLOCK_Q"]) == want


@pytest.mark.parametrize(
    "shapes, supported",
    [
        ((128, 128, 3, 1, 2, 1, 32, 8, 64), True),
        ((64, 64, 4, 2, 4, 1, 28, 4, 16), True),
        ((128, 256, 3, 1, 1, 1, 16, 1, 0), False),
        ((128, 256, 3, 1, 2, 1, 16, 1, 0), True),
        ((128, 64, 3, 1, 2, 1, 32, 8, 52), True),
        ((128, 128, 2, 2, 2, 1, 32, 8, 128), True),
        ((128, 192, 3, 1, 2, 1, 32, 8, 64), False),
        ((128, 32, 3, 1, 2, 1, 32, 8, 64), False),
        ((128, 128, 3, 1, 3, 1, 32, 8, 64), False),
        ((128, 128, 8, 4, 2, 1, 32, 8, 64), False),
        ((96, 128, 3, 1, 2, 1, 32, 8, 64), False),
        ((128, 128, 3, 1, 2, 2, 32, 8, 64), False),
        ((128, 128, 3, 1, 2, 1, 34, 2, 64), False),
        ((64, 64, 3, 1, 2, 1, 32, 8, 26), False),
        ((128, 128, 2, 1, 2, 1, 32, 8, 52), False),
        ((128, 128, 2, 1, 2, 1, 32, 8, 64), True),
    ],
)
def test_supports_shapes(shapes, supported):
    """Head dim, group size (a power of two, at least 64), code widths (value codes 2 or 4 bits: 2-bit fields),
    one value group per token, at most 16 query heads per KV head, the selected channels' upper planes
    in thread-owned words (pnmix-2 at head dim 64 selects 26, whose last chunk has a lane of two
    channels; an odd upper plane in a partial chunk: byte quads; both go to the Triton kernel)."""
    assert mma.supports_shapes(*shapes) is supported


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("rows, cols", [(1, 64), (2, 64), (4, 32), (4, 64), (8, 64), (16, 64), (1, 128), (4, 128), (8, 128)])
def test_query_layout_tiles_and_reduces_within_a_warp(groups, rows, cols):
    """The query operands' layout ``[groups, query heads, tile width]``: each group in its own lanes, a
    CTA tile covers each group's ``[heads, width]`` (held more than once only when it has fewer than
    ``32 / groups * 4`` elements), and from 4 heads on the warps split the heads, so the per-head
    reductions over the tile stay within a warp."""
    layout = mma.query_layout(groups, rows, cols)
    assert layout.size_per_thread[0] == layout.warps_per_cta[0] == 1 and layout.threads_per_warp[0] == groups
    tile = [s * t * w for s, t, w in zip(layout.size_per_thread[1:], layout.threads_per_warp[1:], layout.warps_per_cta[1:])]
    assert cols % tile[1] == 0 and (rows % tile[0] == 0 or rows * cols < 32 // groups * mma.NUM_WARPS)
    assert layout.size_per_thread[2] <= 4 * groups and layout.threads_per_warp[1] * layout.threads_per_warp[2] == 32 // groups
    if rows >= mma.NUM_WARPS:
        assert layout.warps_per_cta[2] == 1


def compile_for_sm90(layout: str, head_dim: int, ratio: int, dtype_name: str) -> str:
    """PTX of the split kernel built for an H100/H200 (sm_90) on this machine for a ``kernel_cases``
    layout; run without ``TRITON_INTERPRET`` (the interpreter replaces the language functions the
    compiler needs)."""
    _, group, bits_high, bits_low = LAYOUTS[layout]
    return mma.compile_offline(head_dim, ratio, group, num_high(layout, head_dim), bits_high, bits_low, 2, getattr(torch, dtype_name)).asm[
        "ptx"
    ]


@pytest.mark.parametrize(
    "layout, head_dim, ratio, dtype", [("pnmix-1", 128, 4, "bfloat16"), ("pnmix-2", 128, 7, "float16"), ("r0", 64, 7, "float16")]
)
def test_kernel_builds_for_sm90(layout, head_dim, ratio, dtype):
    """Compiles for sm_90 on this CPU (a separate process without the interpreter): the layouts are
    valid, every operand conversion is free (``assert_trivial``), the 8-bit MMA and the asynchronous
    copies of the codes are there."""
    code = (
        "import sys; sys.path.insert(0, 'tests/kernels'); import test_kernel_decode_attention_mma as t; "
        f"ptx = t.compile_for_sm90({layout!r}, {head_dim}, {ratio}, {dtype!r}); "
        "print(ptx.count('mma.sync.aligned.m16n8k32'), ptx.count('cp.async.c'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    mma_count, copy_count = map(int, result.stdout.split()[-2:])
    assert mma_count > 0 and copy_count > 0


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need a CUDA GPU")


def on_cuda(args: tuple) -> tuple:
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def assert_matches_reference_on_cuda(args: tuple, dtype: torch.dtype, splits=(None,)) -> None:
    """The Gluon kernel takes the call and, at each split count (None: its default), has no NaN and
    matches the float32 reference: elementwise within 5e-2 (bf16) or 1e-2 (fp16), relative error
    under a quarter of that. Tolerances of the earlier 16-bit operands (8 significant bits); the
    8-bit parts carry 15, and the sinks and residual are still bf16 products. Not tightened: the
    errors of these cases were not measured."""
    args = on_cuda(args)
    assert mma.supports(args[0], args[5], args[6], args[9], args[10], args[2].shape[1])
    want = decode_attention_reference(*args).float()
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-2
    for count in splits:
        got = mma.mma_decode_attention(*args, num_splits=count).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        assert (got - want).norm() / want.norm() < tolerance / 4


CUDA_CASES = [
    ("pnmix-1", 128, 4, torch.bfloat16),
    ("pnmix-1", 128, 4, torch.float16),
    ("pnmix-1", 64, 4, torch.bfloat16),
    ("pnmix-1", 128, 1, torch.bfloat16),
    ("pnmix-1", 128, 7, torch.float16),
    ("pnmix-2", 128, 4, torch.bfloat16),
    ("r40", 128, 4, torch.float16),
    ("r0", 64, 7, torch.float16),
    ("kivi-2", 128, 4, torch.bfloat16),
    ("kivi-2", 64, 1, torch.float16),
    ("r0", 128, 4, torch.bfloat16),
]


@requires_cuda
@pytest.mark.parametrize("layout, head_dim, ratio, dtype", CUDA_CASES)
@pytest.mark.parametrize(
    "lengths",
    [
        dict(sink_len=[32, 7, 0], num_groups=[3, 0, 2], residual_len=[1, 128, 65]),
        dict(sink_len=[31, 0, 1], num_groups=[1, 3, 2], residual_len=[63, 64, 0]),
    ],
)
def test_matches_reference_on_cuda(layout, head_dim, ratio, dtype, lengths):
    assert_matches_reference_on_cuda(decode_inputs(seeded(), layout, head_dim, ratio, dtype, **lengths), dtype, (None, 1, 3))


@requires_cuda
@pytest.mark.parametrize(
    "layout, ratio, dtype, value_bits",
    [("4-2", 4, torch.bfloat16, 2), ("pnmix-1", 4, torch.float16, 4), ("kivi-2", 7, torch.float16, 4), ("r25", 4, torch.bfloat16, 2)],
)
def test_wide_codes_match_reference_on_cuda(layout, ratio, dtype, value_bits):
    """Kitty's 4-bit keys (two pairs of planes as 2-bit fields), 4-bit values (two field words per
    row: 4 bits take the 64-token step), and a first key tile whose chunks differ in kind at a level
    (``r25``: 2-bit fields in the 32 selected channels, a plane in the others). 1- and 3-bit values
    (a bit plane) go to the Triton kernel."""
    args = decode_inputs(
        seeded(), layout, 128, ratio, dtype, sink_len=[32, 0, 5], num_groups=[3, 2, 1], residual_len=[7, 128, 0], value_bits=value_bits
    )
    assert mma.step_tokens(128, value_bits) == (64 if value_bits == 4 else 128)
    for odd in (1, 3):
        odd_bits = decode_inputs(seeded(), layout, 128, ratio, dtype, sink_len=[1], num_groups=[1], residual_len=[1], value_bits=odd)
        assert not mma.supports(*(odd_bits[i].cuda() for i in (0, 5, 6, 9, 10)), odd_bits[2].shape[1])
    assert_matches_reference_on_cuda(args, dtype)


@requires_cuda
@pytest.mark.parametrize("layout, ratio", [("pnmix-1", 2), ("pnmix-1", 3), ("pnmix-1", 8), ("kivi-2", 16), ("g256", 4), ("g256", 7)])
def test_other_head_ratios_and_two_steps_per_group_on_cuda(layout, ratio):
    """Paired columns with 2 and 3 heads, 8 and 16 heads in two MMAs, and 256-token groups (two
    128-token steps per group) against the reference."""
    args = decode_inputs(seeded(), layout, 128, ratio, torch.bfloat16, sink_len=[32, 0, 9], num_groups=[3, 1, 2], residual_len=[1, 128, 40])
    assert_matches_reference_on_cuda(args, torch.bfloat16, (None, 2))


def largest_value_sums(value_bits: int, dtype: torch.dtype) -> tuple:
    """Inputs whose step sums of 8-bit value products are the largest possible: every key code and
    group parameter equal (every p = 1), every value code at its largest, one value scale for all
    tokens (every 8-bit part of p is 127). One sequence of 3 groups, nothing else."""
    args = list(decode_inputs(seeded(), "pnmix-1", 128, 4, dtype, sink_len=[0], num_groups=[3], residual_len=[0], value_bits=value_bits))
    for index in (5, 6):  # key codes
        args[index] = torch.zeros_like(args[index])
    for index in (7, 8):  # key scales and zeros: group 0's everywhere
        args[index] = args[index][:, :, :1].expand_as(args[index]).contiguous()
    args[9] = values_to_operand_order(torch.full_like(args[9], -1), 128)  # every value code bit (plain words)
    args[10] = torch.full_like(args[10], 0.25)  # value scales
    return tuple(args)


def test_largest_value_sums_are_well_formed():
    """On CPU: the inputs of the int32-headroom case below give every token the same weight, so the
    result is the mean over tokens of zero + 0.25 * (2^b - 1) (the reference and the Triton kernel)."""
    from pnmix_patch.kernels.decode_attention import triton_decode_attention

    for value_bits in (2, 4):
        args = largest_value_sums(value_bits, torch.float16)
        want = decode_attention_reference(*args).float()
        zero = args[11].float()[0, :, :, 0]  # [heads, tokens]
        mean = (zero + 0.25 * (2**value_bits - 1)).mean(-1)  # [heads]
        expected = mean.repeat_interleave(4)[:, None].expand(-1, 128)
        torch.testing.assert_close(want[0], expected, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(triton_decode_attention(*args).float(), want, atol=1e-2, rtol=1e-2)


@requires_cuda
@pytest.mark.parametrize("value_bits", [2, 4])
def test_largest_value_sums_fit_int32_on_cuda(value_bits):
    """Large integer value sums of a step come out right: every code at its largest (the field
    words' rows read 4^k * 3, the top fields 64; 2-bit values at 128 tokens: 128 x 127 x 64 x 128 =
    1.3e8, 6% of int32; 4-bit at 64 tokens 15%). With bit planes these were the largest sums (93%
    of int32); the largest magnitude now is a top-field code 0 (-128), twice these."""
    args = on_cuda(largest_value_sums(value_bits, torch.float16))
    want = decode_attention_reference(*args).float()
    torch.testing.assert_close(mma.mma_decode_attention(*args).float(), want, atol=1e-2, rtol=1e-2)


def largest_key_sums(dtype: torch.dtype) -> tuple:
    """Inputs whose integer key sums are the largest possible: 4-bit codes in every channel with every
    bit set (the top bit cleared for odd tokens, so that the scores differ), one key scale and the
    same query element everywhere (every 8-bit part of q * scale is 127): 128 channels x 15 x 127 x
    128 = 3.1e7 per score, 4.0e9 once the high part's weight 128 is applied (past int32). One sequence
    of 3 groups, nothing else."""
    args = list(decode_inputs(seeded(), "4-4", 128, 4, dtype, sink_len=[0], num_groups=[3], residual_len=[0]))
    assert args[5].shape[3] == 0  # every code in the low tensor's 4 planes
    plain = torch.full_like(args[6], -1)
    plain[:, :, :, 3] = 0x55555555  # plane 3 (the top bit): even tokens only
    args[6] = quantize.keys_to_operand_order(plain)
    args[0] = torch.ones_like(args[0])
    args[7] = torch.full_like(args[7], 0.01)  # key scales
    args[8] = torch.zeros_like(args[8])  # key zeros
    return tuple(args)


def test_largest_key_sums_are_well_formed():
    """On CPU: in the inputs of the case below every channel's key is 15 * 0.01 at even tokens and
    7 * 0.01 at odd ones, and the reference and the Triton kernel agree on them."""
    from pnmix_patch.kernels.decode_attention import triton_decode_attention

    args = largest_key_sums(torch.float16)
    mask = torch.ones(args[1].shape, dtype=torch.bool)  # every channel selected
    keys = dequantize_keys(args[5], args[6], args[7].float(), args[8].float(), mask)
    expected = torch.tensor([0.15, 0.07]).repeat(keys.shape[2] // 2)[None, None, :, None].expand_as(keys)
    torch.testing.assert_close(keys, expected, atol=1e-4, rtol=1e-3)
    want = decode_attention_reference(*args).float()
    assert torch.isfinite(want).all()
    torch.testing.assert_close(triton_decode_attention(*args).float(), want, atol=1e-2, rtol=1e-2)


@requires_cuda
def test_largest_key_sums_on_cuda():
    """The largest integer key sums (4-bit codes everywhere, thread-owned words: rows read their codes
    up to 2^5 times too large) come out right: ``128 * high + low`` stays inside int32."""
    args = on_cuda(largest_key_sums(torch.float16))
    want = decode_attention_reference(*args).float()
    torch.testing.assert_close(mma.mma_decode_attention(*args).float(), want, atol=1e-2, rtol=1e-2)


@requires_cuda
def test_non_finite_group_gives_nan_on_cuda():
    """A live key group with a NaN zero makes its sequence's result NaN (as the reference's), and only its."""
    args = list(decode_inputs(seeded(), "pnmix-1", 128, 4, torch.bfloat16, sink_len=[3, 3], num_groups=[2, 2], residual_len=[5, 5]))
    args[8] = args[8].clone()
    args[8][0, :, 1, 0] = float("nan")  # key zero: sequence 0, group 1, channel 0
    args = on_cuda(args)
    want = decode_attention_reference(*args).float()
    got = mma.mma_decode_attention(*args).float()
    assert want[0].isnan().all() and got[0].isnan().all()
    torch.testing.assert_close(got[1], want[1], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("preset, group_size, ratio, stage_groups", [("pnmix-1", 128, 4, 1), ("pnmix-2", 64, 4, 2), ("pnmix-2", 64, 7, 2)])
def test_launch_passes_every_kernel_argument(monkeypatch, preset, group_size, ratio, stage_groups):
    """On CPU: the launcher hands the Gluon kernel each of its parameters once, with the register cap
    and, for 64-token groups, steps of 128 tokens over two groups (recorded, not run)."""
    calls = []

    class Recorder:
        arg_names = mma._decode_split_kernel_mma.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(mma, "_decode_split_kernel_mma", Recorder())
    monkeypatch.setattr(mma, "default_splits", lambda query, kv_programs, max_groups, group_size: 2)
    args = decode_inputs(seeded(), preset, 128, ratio, torch.bfloat16, sink_len=[3, 0], num_groups=[1, 2], residual_len=[5, 0])
    mma.mma_decode_attention(*args)
    ((grid, positional, keywords),) = calls
    assert grid == (2 * 2, 2)
    names = Recorder.arg_names
    options = {"num_warps", "maxnreg", "launch_pdl"}  # launch options
    assert keywords["maxnreg"] == mma.MAX_REGISTERS
    assert keywords["T"] == 128 and keywords["T"] // keywords["T_G"] == stage_groups
    assert keywords["PDL"] is keywords["launch_pdl"] is False  # CPU tensors: no programmatic dependent launch
    assert len(positional) + len(keywords) - len(options) == len(names)
    assert set(keywords) - options == set(names[len(positional) :])
    assert positional[names.index("group_cap")] == args[5].shape[2]
    assert keywords["D"] == 128 and keywords["G"] == group_size and keywords["BLOCK_Q"] == 8
    with pytest.raises(ValueError, match="max_registers must be a positive int or None; got '96'"):
        mma.mma_decode_attention(*args, max_registers="96")
