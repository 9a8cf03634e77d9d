"""Triton pack kernels (interpreted) vs the reference quantizers: bit-identical outputs."""

import pytest
import torch
from kernel_cases import LAYOUTS, WIDE_LAYOUTS, mask_of, num_high, random_order, seeded

from pnmix_patch.kernels.pack_keys import triton_pack_keys
from pnmix_patch.kernels.pack_values import triton_pack_values
from pnmix_patch.reference.quantize import quantize_keys, quantize_values

# The interpreter evaluates masked-off lanes and NaN inputs with numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")


def assert_identical(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w) or torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num())


def random_keys(generator, batch, heads, tokens, head_dim, dtype):
    # Channel magnitudes spread over two orders of magnitude, like real keys.
    spread = torch.logspace(-1, 1, head_dim)[torch.randperm(head_dim, generator=generator)]
    return (torch.randn(batch, heads, tokens, head_dim, generator=generator) * spread).to(dtype)


@pytest.mark.parametrize("layout", [*LAYOUTS, *WIDE_LAYOUTS])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_pack_keys_matches_reference(layout, head_dim, dtype):
    """Every layout's codes, the wide ones' too: two pairs of planes as 2-bit fields (4 bits), 8 bits."""
    generator = seeded(head_dim)
    _, group, bits_high, bits_low = {**LAYOUTS, **WIDE_LAYOUTS}[layout]
    high = num_high(layout, head_dim)
    keys = random_keys(generator, 2, 2, 2 * group, head_dim, dtype)
    order = random_order(2, 2, head_dim, high, generator)
    got = triton_pack_keys(keys, order, high, group, bits_high, bits_low, True)
    assert_identical(got, quantize_keys(keys, mask_of(order, high), high, group, bits_high, bits_low, True))


@pytest.mark.parametrize("midpoint_correction", [True, False])
def test_pack_keys_edge_groups(midpoint_correction):
    """Constant channels, inf and NaN groups, a strided input and values on exact ties."""
    generator = seeded(7)
    group, high = 64, 32
    keys = random_keys(generator, 2, 3, 2 * group, 64, torch.float32)
    keys[0, 0, :group, 5] = 0.25  # constant channel: scale 0, every code 0
    keys[0, 1, 3, 7] = float("inf")
    keys[1, 2, 70, 40] = float("nan")
    keys[1, 0, :, 9] = torch.arange(2 * group) % 8  # 3-bit levels: codes sit on exact integers
    keys[1, 1, :, 50] = torch.arange(2 * group) % 4 * 0.5  # 1-bit ties at the midpoint
    strided = keys.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous
    order = random_order(2, 3, 64, high, generator)
    got = triton_pack_keys(strided, order, high, group, 3, 1, midpoint_correction)
    assert_identical(got, quantize_keys(keys, mask_of(order, high), high, group, 3, 1, midpoint_correction))


@pytest.mark.parametrize(
    "head_dim, group, bits, dtype",
    [
        (64, 64, 2, torch.float16),
        (128, 128, 2, torch.float32),
        (128, 32, 1, torch.float16),
        (64, 32, 3, torch.float32),
        (96, 96, 4, torch.float16),  # group and head dim not powers of two
    ],
)
def test_pack_values_matches_reference(head_dim, group, bits, dtype):
    generator = seeded(head_dim * 10 + bits)
    values = torch.randn(2, 2, 37, head_dim, generator=generator).to(dtype)  # 37: a partial block of 16 and of 32 tokens
    for token_block in (32, 64, 4):  # 64: no whole block
        got = triton_pack_values(values, bits, group, True, token_block)
        assert_identical(got, quantize_values(values, bits, group, True, token_block))


@pytest.mark.parametrize("midpoint_correction", [True, False])
def test_pack_values_edge_tokens(midpoint_correction):
    values = torch.randn(1, 2, 20, 64, generator=seeded(3))
    values[0, 0, 1] = 1.5  # constant token
    values[0, 0, 2, 3] = float("-inf")
    values[0, 1, 4, 60] = float("nan")
    values[0, 1, 5] = torch.arange(64) % 2  # 1-bit ties
    got = triton_pack_values(values, 1, 32, midpoint_correction, 8)
    assert_identical(got, quantize_values(values, 1, 32, midpoint_correction, 8))
