"""Triton decode attention (interpreted) vs the float32 PyTorch reference."""

import pytest
import torch
from kernel_cases import LAYOUTS, decode_inputs, mask_of, seeded

from pnmix_patch.kernels.common import wave_filling_splits
from pnmix_patch.kernels.decode_attention import decode_attention_reference, triton_decode_attention
from pnmix_patch.reference.quantize import dequantize_keys, dequantize_values

# The interpreter evaluates masked-off lanes with numpy, which warns about inf - inf or 1 / 0.
pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}


def check(args, dtype, **launch):
    got = triton_decode_attention(*args, **launch)
    want = decode_attention_reference(*args)
    assert got.shape == want.shape == args[0].shape and got.dtype == args[0].dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    return got


CASES = [
    (layout, head_dim, ratio)
    for layout in LAYOUTS
    for head_dim in (64, 128)
    for ratio in (1, 4, 7)
    if (layout, head_dim, ratio) != ("kivi-2", 128, 7)  # 23 of the 24 combinations, to keep the suite short
] + [("pnmix-2", 96, 4)]  # a head dim that is not a power of two


@pytest.mark.parametrize("layout, head_dim, ratio", CASES)
def test_decode_matches_reference(layout, head_dim, ratio):
    generator = seeded()
    dtype = (torch.float16, torch.float32)[(head_dim // 64 + ratio) % 2]
    args = decode_inputs(generator, layout, head_dim, ratio, dtype, sink_len=[32, 7, 0], num_groups=[3, 0, 2], residual_len=[1, 128, 65])
    check(args, dtype)


@pytest.mark.parametrize("layout, dtype", [("4-2", torch.float16), ("8-4", torch.float32), ("r25", torch.float16)])
@pytest.mark.parametrize("value_group", [None, 32])
def test_decode_wide_codes_and_value_groups(layout, dtype, value_group):
    """4- and 8-bit key codes (pairs of planes as 2-bit fields, or byte quads at 32-token groups), 3-bit
    codes in a 32-channel tensor (a pair and a plane), and values in several channel groups per token."""
    generator = seeded()
    args = decode_inputs(
        generator,
        layout,
        128,
        4,
        dtype,
        sink_len=[3, 0],
        num_groups=[3, 2],
        residual_len=[5, 128],
        value_group=value_group,
    )
    check(args, dtype)


@pytest.mark.parametrize("layout", ["pnmix-1", "pnmix-2"])  # G = 128 and 64
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_lengths_around_boundaries(layout, dtype):
    """Each sequence sits at, just under or just over a block, group or capacity edge."""
    generator = seeded()
    group = LAYOUTS[layout][1]
    args = decode_inputs(
        generator,
        layout,
        64,
        4,
        dtype,
        sink_len=[31, 32, 0, 1, 32, 0, 5],
        num_groups=[0, 1, 2, 3, 3, 1, 2],
        residual_len=[group - 1, group, group + 1, 63, 64, 65, 128],
        residual_cap=max(128, group + 1),
    )
    check(args, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_split_merge(num_splits):
    """Any split count gives the same softmax, also with splits that get no chunk (16 > 6 chunks)."""
    generator = seeded()
    args = decode_inputs(generator, "pnmix-2", 64, 7, torch.float32, sink_len=[32, 3], num_groups=[3, 1], residual_len=[100, 1])
    check(args, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("value_bits", [1, 3, 4])
def test_decode_value_widths(value_bits):
    """Value codes of 1 and 3 bits (a last bit plane; the Triton kernel serves them on GPU too) and 4
    bits (two field words), at a head dim that is not a power of two."""
    args = decode_inputs(
        seeded(value_bits),
        "pnmix-1",
        96,
        4,
        torch.float32,
        sink_len=[3, 0],
        num_groups=[2, 1],
        residual_len=[5, 128],
        value_bits=value_bits,
    )
    check(args, torch.float32)


@pytest.mark.parametrize(
    "kv_programs, max_chunks, splits",
    [(8, 256, 66), (64, 128, 8), (256, 512, 2), (512, 128, 1), (4640, 64, 1), (160, 512, 13), (8, 32, 32), (8, 40, 40), (0, 64, 64)],
)
def test_split_count_fills_one_wave_or_whole_waves(kv_programs, max_chunks, splits):
    """On 528 program slots (an H200 at 4 per multiprocessor): the most splits that fit in one wave
    when they fill 95% of it (8 KV programs: 66; 64: 8, not the 16 of two full waves), else the fewest
    whose waves are 95% full (160: 3 would fill 91% of one wave, 13 fill four waves to 98%); never
    more than the chunks; an empty batch (0 programs) gets the old rule's answer, no error."""
    assert wave_filling_splits(528, kv_programs, max_chunks) == splits


def test_decode_empty_segments():
    """No sink, group or residual capacity at all, and a sequence with no valid token."""
    generator = seeded()
    args = decode_inputs(
        generator,
        "pnmix-1",
        64,
        4,
        torch.float32,
        sink_len=[0, 0],
        num_groups=[0, 0],
        residual_len=[0, 3],
        sink_cap=0,
        group_cap=0,
    )
    assert args[2].numel() == 0 and args[5].numel() == 0
    out = check(args, torch.float32, num_splits=3)
    assert torch.all(out[0] == 0)

    args = decode_inputs(generator, "kivi-2", 64, 1, torch.float32, sink_len=[0], num_groups=[0], residual_len=[0])
    assert torch.all(check(args, torch.float32) == 0)


def test_overflowed_sequences_read_nan():
    """The static cache's overflow flag turns that sequence's rows into NaN, in the merge kernel."""
    generator = seeded()
    args = decode_inputs(generator, "pnmix-1", 64, 4, torch.float16, sink_len=[4, 32, 1], num_groups=[2, 1, 0], residual_len=[9, 64, 3])
    overflowed = torch.tensor([False, True, False])
    got = triton_decode_attention(*args, overflowed, num_splits=2)
    want = decode_attention_reference(*args, overflowed)
    assert got[1].isnan().all() and want[1].isnan().all()
    torch.testing.assert_close(got[[0, 2]].float(), want[[0, 2]].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[[0, 2]], triton_decode_attention(*args, num_splits=2)[[0, 2]], atol=0, rtol=0)


def test_non_finite_group_reads_nan():
    """A live key group with a NaN zero makes its sequence's rows NaN (as the reference's), whichever
    split holds it; the other sequences are untouched."""
    args = list(decode_inputs(seeded(), "pnmix-1", 64, 4, torch.float16, sink_len=[3, 3], num_groups=[2, 2], residual_len=[5, 5]))
    args[8] = args[8].clone()
    args[8][0, :, 1, 0] = float("nan")  # key zero: sequence 0, group 1, channel 0
    want = decode_attention_reference(*args)
    for splits in (1, 2):
        got = triton_decode_attention(*args, num_splits=splits)
        assert want[0].isnan().all() and got[0].isnan().all()
        torch.testing.assert_close(got[1].float(), want[1].float(), atol=1e-2, rtol=1e-2)


def test_decode_strided_views():
    """Views sliced along the token/group dims are read in place; a transposed tensor is copied."""
    generator = seeded()
    args = decode_inputs(generator, "pnmix-2", 64, 4, torch.float16, sink_len=[4, 32], num_groups=[2, 1], residual_len=[9, 64])
    args = list(args)
    want = decode_attention_reference(*args)
    query = torch.zeros(2, 8, 3, 64, dtype=torch.float16)
    query[:, :, 1] = args[0]
    args[0] = query[:, :, 1]  # head stride 3 * D
    for index in (2, 3, 13, 14):  # sinks and residual: capacity cut, data unchanged
        args[index] = args[index][:, :, : 64 if index > 3 else 32]
    for index in (5, 6, 7, 8):  # packed keys: groups past the longest sequence cut off
        args[index] = args[index][:, :, :2]
    for index in (9, 10, 11):
        args[index] = args[index][:, :, : 2 * 64]
    args[3] = args[3].transpose(2, 3).contiguous().transpose(2, 3)  # channel-major: not inner contiguous
    assert not args[0].is_contiguous() and not args[5].is_contiguous() and not args[3].is_contiguous()
    got = triton_decode_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_reference_matches_naive_attention():
    """The reference (the op's CPU implementation) against a per-sequence loop."""
    generator = seeded()
    args = decode_inputs(generator, "pnmix-2", 64, 4, torch.float32, sink_len=[3, 0], num_groups=[2, 1], residual_len=[5, 0])
    (
        query,
        order,
        sink_k,
        sink_v,
        sink_len,
        k_high,
        k_low,
        k_scale,
        k_zero,
        v_codes,
        v_scale,
        v_zero,
        num_groups,
        res_k,
        res_v,
        res_len,
        scaling,
    ) = args
    keys = dequantize_keys(k_high, k_low, k_scale, k_zero, mask_of(order, k_high.shape[-1]))
    group = 32 * k_high.shape[4]
    values = dequantize_values(v_codes, v_scale, v_zero, group)
    out = decode_attention_reference(*args)
    for b in range(2):
        n = int(num_groups[b]) * group
        k = torch.cat([sink_k[b, :, : sink_len[b]], keys[b, :, :n], res_k[b, :, : res_len[b]]], 1)
        v = torch.cat([sink_v[b, :, : sink_len[b]], values[b, :, :n], res_v[b, :, : res_len[b]]], 1)
        k, v = k.repeat_interleave(4, 0), v.repeat_interleave(4, 0)
        probs = torch.softmax(torch.einsum("hd,htd->ht", query[b], k) * scaling, -1)
        torch.testing.assert_close(out[b], torch.einsum("ht,htd->hd", probs, v))
