"""Reference quantizers and bit-plane packing (pnmix_patch.reference.quantize)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pnmix_patch.reference.quantize import (
    channel_order,
    compact_key_fields,
    decode,
    dequantize_keys,
    dequantize_values,
    encode,
    expand_key_fields,
    key_word_distance,
    keys_from_operand_order,
    keys_to_operand_order,
    minmax_params,
    pack_bits,
    partial_chunk_lanes,
    quantize_keys,
    quantize_values,
    scale_dtype_for,
    thread_owned_keys,
    transpose_byte_quads,
    unpack_bits,
    unpack_keys,
    unpack_stored_keys,
    unpack_values,
    values_from_operand_order,
    values_to_operand_order,
)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)
FP16_EPS = 2.0**-10  # fp16 has a 10-bit mantissa: relative rounding <= 2^-11
ABS_TOL = 1e-6  # fp16 subnormal spacing is 2^-24 ~ 6e-8

groups_of_floats = st.lists(
    st.lists(st.floats(-1000, 1000, allow_nan=False, width=32), min_size=2, max_size=64),
    min_size=1,
    max_size=4,
).map(lambda rows: [row + [row[0]] * (64 - len(row)) for row in rows])  # pad rows to a common length


def round_trip(x, bits, midpoint, dim=-1):
    scale, zero = minmax_params(x, bits, dim, midpoint, torch.float16)
    codes = encode(x, scale, zero, bits)
    return scale, zero, codes, decode(codes, scale, zero)


def group_stats(x, dim=-1):
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return low, high, high - low, x.abs().amax(dim, keepdim=True)


def tolerance(x, dim=-1):
    _, _, value_range, magnitude = group_stats(x, dim)
    return FP16_EPS * (value_range + magnitude) + ABS_TOL


# ---------------------------------------------------------------- scalar quantizer


@SETTINGS
@given(rows=groups_of_floats, bits=st.sampled_from([1, 2, 3]))
def test_minmax_error_bound_without_correction(rows, bits):
    x = torch.tensor(rows, dtype=torch.float32)
    scale, zero, codes, x_hat = round_trip(x, bits, midpoint=False)
    assert scale.dtype == zero.dtype == torch.float16
    assert codes.dtype == torch.int32
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1
    assert torch.isfinite(x_hat).all()
    error = (x - x_hat).abs()
    bound = scale.float() / 2 + tolerance(x)
    assert (error <= bound).all(), float((error - bound).max())


@SETTINGS
@given(rows=groups_of_floats, bits=st.sampled_from([2, 3]))
def test_midpoint_correction_only_changes_one_bit(rows, bits):
    x = torch.tensor(rows, dtype=torch.float32)
    plain = round_trip(x, bits, midpoint=False)
    corrected = round_trip(x, bits, midpoint=True)
    for a, b in zip(plain, corrected):
        assert torch.equal(a, b)


@SETTINGS
@given(rows=groups_of_floats)
def test_one_bit_correction_levels_and_error(rows):
    x = torch.tensor(rows, dtype=torch.float32)
    _, _, codes, x_hat = round_trip(x, 1, midpoint=True)
    low, _, value_range, _ = group_stats(x)
    tol = tolerance(x)
    lower, upper = low + 0.25 * value_range, low + 0.75 * value_range
    on_lower = (x_hat - lower).abs() <= tol
    on_upper = (x_hat - upper).abs() <= tol
    assert (on_lower | on_upper).all()
    # the nearest level: error at most a quarter of the range
    assert ((x - x_hat).abs() <= 0.25 * value_range + tol).all()
    assert int(codes.min()) >= 0 and int(codes.max()) <= 1


def test_one_bit_correction_levels_exact_example():
    x = torch.tensor([[0.0, 0.1, 0.49, 0.51, 0.9, 1.0, 1.0, 0.0]])
    _, _, codes, x_hat = round_trip(x, 1, midpoint=True)
    assert codes.tolist() == [[0, 0, 0, 1, 1, 1, 1, 0]]
    torch.testing.assert_close(x_hat, torch.tensor([[0.25, 0.25, 0.25, 0.75, 0.75, 0.75, 0.75, 0.25]]))
    _, _, _, plain = round_trip(x, 1, midpoint=False)
    torch.testing.assert_close(plain, torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]))


def test_one_bit_correction_halves_error_on_uniform_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(256, 128, generator=gen) * 4.0 - 1.0
    plain = (x - round_trip(x, 1, midpoint=False)[3]).abs().mean()
    corrected = (x - round_trip(x, 1, midpoint=True)[3]).abs().mean()
    # expected: range/4 vs range/8
    assert corrected < 0.6 * plain
    assert plain.item() == pytest.approx(1.0, rel=0.05)
    assert corrected.item() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("midpoint", [False, True])
def test_constant_group_is_exact(bits, midpoint):
    x = torch.full((3, 64), 0.375)
    x[1] = -2.5
    x[2] = 0.0
    scale, zero, codes, x_hat = round_trip(x, bits, midpoint)
    assert (scale == 0).all()
    assert (codes == 0).all()
    assert torch.equal(x_hat, x)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("midpoint", [False, True])
def test_non_finite_group_reads_nan(bad, midpoint):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    x[1, 17] = bad
    scale, zero, codes, x_hat = round_trip(x, 1, midpoint)
    assert torch.isnan(scale[1]).all() and torch.isnan(zero[1]).all()
    assert torch.isnan(x_hat[1]).all()
    assert torch.isfinite(x_hat[[0, 2]]).all()
    assert int(codes.min()) >= 0 and int(codes.max()) <= 1


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
    ],
)
def test_scale_dtype_for(dtype, expected):
    assert scale_dtype_for(dtype) == expected


# ---------------------------------------------------------------- bit packing


@SETTINGS
@given(
    bits=st.sampled_from([1, 2, 3, 4, 8, 9]),  # 9: unpack_bits' int32 path
    prefix=st.lists(st.integers(1, 3), max_size=3),
    words=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(bits, prefix, words, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 32 * words
    codes = torch.randint(0, 2**bits, (*prefix, n), generator=gen, dtype=torch.int32)
    codes[..., -1] = 2**bits - 1  # the top bit of the last word is set: the int32 sign bit
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (*prefix, bits, words)
    unpacked = unpack_bits(packed)
    assert unpacked.dtype == torch.int32
    assert torch.equal(unpacked, codes)


@pytest.mark.parametrize("tokens", [32, 64, 128, 256])
def test_three_bit_codes_use_three_bits(tokens):
    codes = torch.randint(0, 8, (2, 5, tokens), generator=torch.Generator().manual_seed(tokens), dtype=torch.int32)
    packed = pack_bits(codes, 3)
    assert packed.numel() == 2 * 5 * 3 * tokens // 32
    assert packed.numel() * 32 == codes.numel() * 3


def test_pack_bits_layout():
    # bit t % 32 of word t // 32 of plane p is bit p of code t
    codes = torch.zeros(64, dtype=torch.int32)
    codes[5] = 0b101
    codes[31] = 0b010
    codes[40] = 0b111
    packed = pack_bits(codes, 3)
    expected = torch.tensor([[1 << 5, 1 << 8], [-(2**31), 1 << 8], [1 << 5, 1 << 8]], dtype=torch.int32)
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("n", [1, 16, 33, 48, 100])
def test_pack_bits_rejects_bad_length(n):
    with pytest.raises(ValueError) as info:
        pack_bits(torch.zeros(2, n, dtype=torch.int32), 2)
    assert str(n) in str(info.value) and "multiple of 32" in str(info.value)


# ---------------------------------------------------------------- operand order


def random_words(*shape, seed=0):
    return torch.randint(-(2**31), 2**31, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int64).to(torch.int32)


def bit(word, position) -> int:
    return (int(word) >> position) & 1


def test_transpose_byte_quads_known_words():
    words = torch.tensor([0x03020100, 0x13121110, 0x23222120, 0x33323130, 0x7F], dtype=torch.int32)
    out = transpose_byte_quads(words, 0)
    assert out.tolist() == [0x30201000, 0x31211101, 0x32221202, 0x33231303, 0x7F]  # the fifth word: a run of one, plain
    assert torch.equal(transpose_byte_quads(out, 0), words)


@pytest.mark.parametrize(
    "rows, channels, planes",
    [
        (4, 64, 3),
        (2, 64, 3),
        (8, 32, 3),
        (6, 32, 3),
        (2, 26, 3),
        (3, 64, 3),
        (2, 4, 3),
        (2, 2, 3),
        (2, 0, 3),
        (4, 64, 4),
        (2, 32, 2),
        (2, 32, 1),
        (2, 52, 2),
        (4, 20, 4),
        (2, 16, 2),
        (2, 44, 2),
        (2, 26, 2),
        (2, 52, 3),
    ],
)
def test_keys_in_operand_order_hold_the_documented_bits(rows, channels, planes):
    """Every plane's bits where the module docstring puts them: thread-owned words with each pair of
    planes as two words of 2-bit fields (a last partial chunk's compacted) and an odd last plane as a
    plane, or byte quads."""
    plain = random_words(2, planes, rows, channels, seed=rows * 100 + channels + planes)  # [groups, planes, word rows, C]
    ordered = keys_to_operand_order(plain)
    assert ordered.shape == plain.shape
    group_size = 32 * rows
    owned = thread_owned_keys(group_size, channels, planes)
    assert owned == (group_size % 64 == 0 and (channels % 32 == 0 or (planes % 2 == 0 and channels % 4 == 0)))
    distance = 64 if group_size % 128 == 0 else 32
    assert key_word_distance(group_size, channels, planes) == (distance if owned else 0)  # what the kernels are given
    runs = 4 * (channels // 4)
    full, part = channels - channels % 32, channels % 32
    lanes = (min(part, 16) // 4, (part - min(part, 16)) // 4)
    for p in range(planes):
        in_pair = p < planes - planes % 2
        for c in range(channels):
            for t in range((c + p) % 5, group_size, 5):
                if owned:  # token (block, tile, tile pair, row half, lane row), channel (chunk, half, lane column, byte)
                    block, tile, pair, row_half, lane_row = t // (2 * distance), t // distance % 2, t % distance // 16, t // 8 % 2, t % 8
                    chunk, half, lane_column, byte = c // 32, c // 16 % 2, c // 4 % 4, c % 4
                    row, column = block * (distance // 16) + pair, 32 * chunk + 4 * lane_row + lane_column
                    slot = p - p % 2 + half
                    if in_pair and c >= full:  # the partial chunk: its halves' words pooled, part words per slot
                        pool = (0 if half == 0 else 8 * lanes[0]) + lane_row * lanes[half] + lane_column
                        slot, column = p - p % 2 + pool // part, full + pool % part
                    if in_pair:  # slot 2m + half, bit 8 byte + 4 tile + 2 row half + p % 2
                        got = bit(ordered[1, slot, row, column], 8 * byte + 4 * tile + 2 * row_half + p % 2)
                    else:
                        got = bit(ordered[1, p, row, column], 8 * byte + 4 * tile + 2 * half + row_half)
                elif c < runs:  # bit 8i + j of word 4q + b is token 8b + j of channel 4q + i
                    got = bit(ordered[1, p, t // 32, 4 * (c // 4) + t % 32 // 8], 8 * (c % 4) + t % 8)
                else:
                    got = bit(ordered[1, p, t // 32, c], t % 32)
                assert got == bit(plain[1, p, t // 32, c], t % 32)
    assert torch.equal(keys_from_operand_order(ordered), plain)


@pytest.mark.parametrize(
    "rows, channels, planes",
    [
        (4, 64, 3),
        (2, 32, 3),
        (2, 26, 3),
        (3, 64, 3),
        (2, 0, 3),
        (4, 32, 9),
        (2, 26, 9),
        (4, 64, 1),
        (4, 64, 2),
        (2, 32, 4),
        (4, 32, 8),
        (4, 32, 10),
        (2, 52, 2),
        (4, 20, 4),
        (2, 0, 2),
    ],
)
def test_unpack_keys_reads_the_stored_codes(rows, channels, planes):
    """Codes of 1 to 4 bits (field words alone, or with an odd last plane), 8, and 9 or 10 (past the
    bytes the codes are combined in up to 8 bits); a compacted partial chunk."""
    plain = random_words(2, planes, rows, channels, seed=channels + planes)  # [groups, planes, word rows, C]
    codes = unpack_keys(keys_to_operand_order(plain))
    assert codes.shape == (2, 32 * rows, channels)
    assert torch.equal(codes, unpack_bits(plain.permute(0, 3, 1, 2)).transpose(-1, -2))


@pytest.mark.parametrize(
    "channels, lanes", [(52, (4, 1)), (20, (4, 1)), (16, (4, 0)), (44, (3, 0)), (8, (2, 0)), (28, (4, 3)), (64, (0, 0))]
)
def test_compacted_chunk_keeps_the_words_of_lanes_with_channels(channels, lanes):
    """A last partial chunk's field words: only lanes that hold channels are stored (2 words per
    channel and word row, so the tensor keeps its shape), and expanding puts them back with zeros
    for the others."""
    assert partial_chunk_lanes(channels) == lanes
    padded = -(-channels // 32) * 32
    words = random_words(2, 4, 3, padded, seed=channels)  # [groups, 2 pairs of slots, word rows, C']
    last = words[..., padded - 32 :].unflatten(-1, (8, 4))  # [..., lane row, lane column]
    for slot in range(4):
        last[:, slot, :, :, lanes[slot % 2] :] = 0  # lanes without channels hold no bits
    compact = compact_key_fields(words, channels)
    assert compact.shape == (2, 4, 3, channels)
    assert torch.equal(compact[..., : channels - channels % 32], words[..., : channels - channels % 32])
    assert torch.equal(expand_key_fields(compact), words)


def test_unpack_stored_keys_adds_the_high_planes_above_the_low_ones():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 8, (2, 64, 32), generator=gen)  # selected channels first: 12 of 3 bits, 20 of 1
    codes[..., 12:] &= 1
    high = keys_to_operand_order(pack_bits(codes[..., :12].transpose(-1, -2) >> 1, 2).movedim(-3, -1))
    low = keys_to_operand_order(pack_bits(codes.transpose(-1, -2) & 1, 1).movedim(-3, -1))
    assert torch.equal(unpack_stored_keys(high, low), codes)


@pytest.mark.parametrize("tokens, block, bits", [(64, 32, 2), (70, 32, 2), (20, 8, 3), (3, 8, 2), (8, 4, 1), (12, 4, 4)])
def test_values_in_operand_order_hold_the_documented_bits(tokens, block, bits):
    words = 2
    plain = random_words(1, 2, tokens, bits, words, seed=tokens)
    ordered = values_to_operand_order(plain, block)
    assert ordered.shape == plain.shape
    flat = ordered[0, 1].reshape(-1)
    full = tokens - tokens % block
    for t in range(tokens):
        for p in range(bits):
            for w in range(words):
                for i in range(0, 32, 5):
                    channel, inverted = 32 * w + i, 0
                    if t < full and p < bits - bits % 2:
                        # plane pairs as 2-bit fields: bits 2k, 2k + 1 of byte b of word u (one per 16
                        # channels) hold channel 16u + 4b + k, bit 7 of every byte inverted
                        column, position = (p // 2) * 2 * words + channel // 16, 2 * (channel % 16) + p % 2
                        inverted = int(position % 8 == 7)
                    else:  # bit planes: bit c % 32 of word c // 32 of plane p
                        column, position = p * words + w, i
                    if t < full:  # byte i of word (column, b, tq) of the block is byte b of token 4tq + i's word column
                        within = t % block
                        index = (t - within) * bits * words + (column * 4 + position // 8) * (block // 4) + within // 4
                        got = bit(flat[index], 8 * (within % 4) + position % 8) ^ inverted
                    else:
                        got = bit(ordered[0, 1, t, column // words, column % words], position)
                    assert got == bit(plain[0, 1, t, p, w], i)
    assert torch.equal(values_from_operand_order(ordered, block), plain)


@pytest.mark.parametrize(
    "tokens, block, bits", [(64, 32, 2), (70, 32, 2), (20, 8, 3), (3, 8, 2), (8, 4, 1), (12, 4, 4), (44, 8, 5), (16, 8, 8)]
)
def test_unpack_values_reads_the_codes_the_planes_hold(tokens, block, bits):
    """The value codes read straight from the words in operand order (field words, the odd last plane,
    the plain partial block) are those of the bit planes they were made from."""
    plain = random_words(2, 3, tokens, bits, 2, seed=tokens + bits)
    assert torch.equal(unpack_values(values_to_operand_order(plain, block), block), unpack_bits(plain))


@pytest.mark.parametrize("block", [0, 6, -4])
def test_values_operand_order_rejects_a_bad_token_block(block):
    with pytest.raises(ValueError, match=f"multiple of 4.*got {block}"):
        values_to_operand_order(random_words(1, 1, 8, 1, 1), block)
    with pytest.raises(ValueError, match=f"multiple of 4.*got {block}"):
        quantize_values(torch.zeros(1, 1, 8, 32), 2, 32, True, block)


# ---------------------------------------------------------------- keys


def test_channel_order_selected_first_ascending():
    mask = torch.tensor([[False, True, False, True, True, False], [True, False, False, False, False, True]])
    assert channel_order(mask).tolist() == [[1, 3, 4, 0, 2, 5], [0, 5, 1, 2, 3, 4]]
    assert channel_order(torch.ones(1, 4, dtype=torch.bool)).tolist() == [[0, 1, 2, 3]]
    assert channel_order(torch.zeros(1, 4, dtype=torch.bool)).tolist() == [[0, 1, 2, 3]]


def random_channel_mask(batch, heads, head_dim, num_high, gen):
    """Per (b, h) random choice of num_high channels."""
    scores = torch.rand(batch, heads, head_dim, generator=gen)
    mask = torch.zeros(batch, heads, head_dim, dtype=torch.bool)
    if num_high:
        mask.scatter_(-1, scores.topk(num_high, -1).indices, True)
    return mask


def make_keys(batch, heads, tokens, head_dim, gen, dtype=torch.float32):
    # every channel has its own offset, so a channel read back in the wrong place is caught
    offsets = torch.arange(head_dim, dtype=torch.float32) * 3.0 - head_dim
    return (torch.randn(batch, heads, tokens, head_dim, generator=gen) + offsets).to(dtype)


def reference_keys(keys, channel_mask, group_size, bits_high, bits_low, midpoint):
    """Independent per-channel fake quantization (fp16 scale/zero), original channel order."""
    batch, heads, tokens, head_dim = keys.shape
    x = keys.float().reshape(batch, heads, tokens // group_size, group_size, head_dim)
    low, high = x.amin(3, keepdim=True), x.amax(3, keepdim=True)
    value_range = high - low
    bits = torch.where(channel_mask, bits_high, bits_low)[:, :, None, None, :]
    levels = (2**bits - 1).float()
    scale, zero = value_range / levels, low
    if midpoint:
        one = bits == 1
        scale = torch.where(one, 0.5 * value_range, scale)
        zero = torch.where(one, low + 0.25 * value_range, zero)
    scale, zero = scale.half().float(), zero.half().float()
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.minimum(torch.round((x - zero) * inverse).clamp_min(0), levels)
    x_hat = (zero + codes * scale).reshape(batch, heads, tokens, head_dim)
    return x_hat, scale.squeeze(3), zero.squeeze(3), codes.to(torch.int32)


@pytest.mark.parametrize("num_high, bits_high, bits_low", [(8, 3, 1), (26, 3, 1), (0, 3, 1), (32, 2, 2), (16, 4, 2)])
@pytest.mark.parametrize("midpoint", [True, False])
def test_quantize_keys_matches_reference(num_high, bits_high, bits_low, midpoint):
    gen = torch.Generator().manual_seed(num_high * 10 + bits_high)
    batch, heads, tokens, head_dim, group = 2, 3, 128, 32, 64
    keys = make_keys(batch, heads, tokens, head_dim, gen)
    mask = random_channel_mask(batch, heads, head_dim, num_high, gen)
    codes_high, codes_low, scale, zero = quantize_keys(keys, mask, num_high, group, bits_high, bits_low, midpoint)
    groups = tokens // group
    assert codes_high.shape == (batch, heads, groups, bits_high - bits_low, group // 32, num_high)
    assert codes_low.shape == (batch, heads, groups, bits_low, group // 32, head_dim)
    assert codes_high.dtype == codes_low.dtype == torch.int32
    assert scale.shape == zero.shape == (batch, heads, groups, head_dim)
    assert scale.dtype == zero.dtype == torch.float16

    expected, ref_scale, ref_zero, ref_codes = reference_keys(keys, mask, group, bits_high, bits_low, midpoint)
    out = dequantize_keys(codes_high, codes_low, scale, zero, mask)
    assert out.shape == keys.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    # scale / zero are stored selected-first
    order = channel_order(mask)[:, :, None, :].expand(-1, -1, groups, -1)
    torch.testing.assert_close(scale.float(), ref_scale.gather(-1, order), rtol=0, atol=0)
    torch.testing.assert_close(zero.float(), ref_zero.gather(-1, order), rtol=0, atol=0)
    # packed layout: [B, H, groups, planes, G/32, C], bit planes along tokens, stored channel order, operand
    # order: the low planes of every channel, the upper ones of the selected channels
    stored_codes = ref_codes.gather(-1, order[:, :, :, None, :].expand(-1, -1, -1, group, -1))
    for packed, part in ((codes_high, stored_codes[..., :num_high] >> bits_low), (codes_low, stored_codes & ((1 << bits_low) - 1))):
        plain = keys_from_operand_order(packed)
        assert torch.equal(unpack_bits(plain.permute(0, 1, 2, 5, 3, 4)).transpose(-1, -2), part)


def test_dequantize_keys_with_a_mask_per_group():
    # per-group re-selection: every group packed with its own channel order reads back in place
    gen = torch.Generator().manual_seed(11)
    batch, heads, group, head_dim, groups, num_high = 2, 2, 64, 32, 3, 8
    keys = make_keys(batch, heads, groups * group, head_dim, gen)
    masks = torch.stack([random_channel_mask(batch, heads, head_dim, num_high, gen) for _ in range(groups)], dim=2)
    parts = [quantize_keys(keys[:, :, g * group : (g + 1) * group], masks[:, :, g], num_high, group, 4, 2, True) for g in range(groups)]
    packed = [torch.cat(tensors, dim=2) for tensors in zip(*parts)]
    out = dequantize_keys(*packed, masks)
    for g in range(groups):
        expected, *_ = reference_keys(keys[:, :, g * group : (g + 1) * group], masks[:, :, g], group, 4, 2, True)
        torch.testing.assert_close(out[:, :, g * group : (g + 1) * group], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("midpoint", [True, False])
def test_quantize_keys_error_and_range(midpoint):
    gen = torch.Generator().manual_seed(3)
    batch, heads, tokens, head_dim, group, num_high = 2, 2, 256, 64, 128, 26
    keys = make_keys(batch, heads, tokens, head_dim, gen)
    mask = random_channel_mask(batch, heads, head_dim, num_high, gen)
    out = dequantize_keys(*quantize_keys(keys, mask, num_high, group, 3, 1, midpoint), mask)

    grouped = keys.reshape(batch, heads, tokens // group, group, head_dim)
    low, high, value_range, _ = group_stats(grouped, 3)
    tol = tolerance(grouped, 3)
    rec = out.reshape(grouped.shape)
    assert torch.isfinite(rec).all()
    assert ((rec >= low - tol) & (rec <= high + tol)).all()

    error = (rec - grouped).abs()
    selected = mask[:, :, None, None, :].expand_as(error)
    bound = torch.where(selected, value_range / 14, value_range * (0.25 if midpoint else 0.5)) + tol
    assert (error <= bound).all()  # half a 3-bit step / nearest 1-bit level
    relative = error / value_range
    assert relative[selected].mean() < 0.5 * relative[~selected].mean()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("midpoint", [True, False])
def test_quantize_keys_constant_channel_exact(dtype, midpoint):
    gen = torch.Generator().manual_seed(4)
    keys = make_keys(1, 2, 64, 32, gen, dtype)
    keys[0, 0, :, 3] = 1.5  # a selected channel (below)
    keys[0, 1, :32, 20] = -0.25  # an unselected channel, first group only
    keys[0, 1, :, 0] = 0.0
    mask = torch.zeros(1, 2, 32, dtype=torch.bool)
    mask[..., :8] = True
    codes_high, codes_low, scale, zero = quantize_keys(keys, mask, 8, 32, 3, 1, midpoint)
    assert scale.dtype == scale_dtype_for(dtype)
    out = dequantize_keys(codes_high, codes_low, scale, zero, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0, :, 3], torch.full((64,), 1.5))
    assert torch.equal(out[0, 1, :32, 20], torch.full((32,), -0.25))
    assert torch.equal(out[0, 1, :, 0], torch.zeros(64))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("selected", [True, False])
def test_quantize_keys_non_finite_group_reads_nan(bad, selected):
    gen = torch.Generator().manual_seed(5)
    batch, heads, tokens, head_dim, group = 2, 2, 96, 32, 32
    keys = make_keys(batch, heads, tokens, head_dim, gen)
    mask = random_channel_mask(batch, heads, head_dim, 10, gen)
    channels = torch.nonzero(mask[1, 0] == selected).flatten()
    channel = int(channels[1])
    keys[1, 0, 40, channel] = bad  # token 40: group 1 of (b=1, h=0)
    out = dequantize_keys(*quantize_keys(keys, mask, 10, group, 3, 1, True), mask)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[1, 0, 32:64, channel] = True
    assert torch.isnan(out[nan]).all()
    assert torch.isfinite(out[~nan]).all()


# ---------------------------------------------------------------- values


@SETTINGS
@given(
    bits=st.sampled_from([1, 2, 3]),
    midpoint=st.booleans(),
    group=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(1e-3, 100.0),
)
def test_quantize_values_round_trip(bits, midpoint, group, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(2, 2, 5, 128, generator=gen) * spread + torch.randn(2, 2, 5, 1, generator=gen)
    codes, scale, zero = quantize_values(values, bits, group, midpoint, 4)  # 5 tokens: a block of 4 and one left
    assert codes.shape == (2, 2, 5, bits, 4) and codes.dtype == torch.int32
    assert scale.shape == zero.shape == (2, 2, 5, 128 // group) and scale.dtype == torch.float16
    out = dequantize_values(codes, scale, zero, 4)
    assert out.shape == values.shape

    grouped = values.reshape(2, 2, 5, 128 // group, group)
    rec = out.reshape(grouped.shape)
    low, high, value_range, _ = group_stats(grouped)
    tol = tolerance(grouped)
    assert ((rec >= low - tol) & (rec <= high + tol)).all()
    if bits == 1 and midpoint:
        bound = 0.25 * value_range + tol
    else:
        bound = scale.float().unsqueeze(-1) / 2 + tol
    assert ((rec - grouped).abs() <= bound).all()


def test_quantize_values_two_bit_known_codes():
    values = torch.tensor([0.0, 1.0, 2.0, 3.0] * 8 + [10.0] * 32).view(1, 1, 1, 64)
    codes, scale, zero = quantize_values(values, 2, 32, True, 4)  # one token: plain words
    assert scale.tolist() == [[[[1.0, 0.0]]]] and zero.tolist() == [[[[0.0, 10.0]]]]
    assert unpack_bits(codes).flatten().tolist() == [0, 1, 2, 3] * 8 + [0] * 32
    assert torch.equal(dequantize_values(codes, scale, zero, 4), values)


@pytest.mark.parametrize("midpoint", [True, False])
def test_quantize_values_constant_token_group_exact(midpoint):
    values = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(6))
    values[0, 1, 2, 32:] = 0.625
    values[0, 0, 0, :32] = 0.0
    out = dequantize_values(*quantize_values(values, 1, 32, midpoint, 4), 4)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1, 2, 32:], values[0, 1, 2, 32:])
    assert torch.equal(out[0, 0, 0, :32], values[0, 0, 0, :32])


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_quantize_values_non_finite_group_reads_nan(bad):
    values = torch.randn(2, 2, 4, 64, generator=torch.Generator().manual_seed(7))
    values[1, 0, 2, 40] = bad
    out = dequantize_values(*quantize_values(values, 2, 32, True, 4), 4)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[1, 0, 2, 32:] = True
    assert torch.isnan(out[nan]).all()
    assert torch.isfinite(out[~nan]).all()


def test_quantize_values_bf16_scale_dtype():
    values = torch.randn(1, 1, 2, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    codes, scale, zero = quantize_values(values, 2, 64, True, 4)
    assert scale.dtype == zero.dtype == torch.bfloat16
    out = dequantize_values(codes, scale, zero, 4)
    value_range = values.float().amax(-1, keepdim=True) - values.float().amin(-1, keepdim=True)
    assert ((out - values.float()).abs() <= value_range / 6 + 2**-7 * (value_range + values.float().abs().amax())).all()
