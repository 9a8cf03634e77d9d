"""PolarQuant's key format: polar encoding, its error bound, and the table-lookup logits."""

import math

import pytest
import torch

from pnmix_patch.reference.attention import key_logits
from pnmix_patch.reference.polar import (
    bin_center_params,
    dequantize_polar_keys,
    polar_coordinates,
    polar_key_logits,
    quantize_polar_keys,
)

G = 64


def structured_keys(seed, heads=2, tokens=2 * G, head_dim=32):
    """Keys whose pairs have very different radii, as RoPE keys with an outlier pair do."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(head_dim, generator=gen).mul(4).exp()
    return torch.randn(1, heads, tokens, head_dim, generator=gen) * scales


def test_bin_centres_reconstruct_a_known_group_within_half_a_bin():
    # radius 0 .. 4 at 2 bits: bins of width 1, read back at 0.5, 1.5, 2.5, 3.5
    x = torch.tensor([0.0, 0.9, 1.2, 2.0, 3.99, 4.0]).view(1, 6)
    scale, zero = bin_center_params(x, 2, 1, torch.float16)
    assert float(scale) == 1.0 and float(zero) == 0.5
    from pnmix_patch.reference.quantize import decode, encode

    codes = encode(x, scale, zero, 2)
    assert codes.tolist() == [[0, 0, 1, 2, 3, 3]]  # 2.0 is a tie between levels 1.5 and 2.5: round half to even
    assert decode(codes, scale, zero).tolist() == [[0.5, 0.5, 1.5, 2.5, 3.5, 3.5]]  # the ends are exactly half a bin off


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (2, 2), (4, 2)])
def test_round_trip_error_is_within_the_bin_bound(bits, pairing):
    radius_bits, angle_bits = bits
    keys = structured_keys(seed=sum(bits))
    stored = quantize_polar_keys(keys, G, radius_bits, angle_bits, pairing)
    restored = dequantize_polar_keys(*stored, pairing)

    radius, angle = (part.reshape(1, 2, 2, G, -1) for part in polar_coordinates(keys, pairing))
    radius_hat, angle_hat = (part.reshape(1, 2, 2, G, -1) for part in polar_coordinates(restored, pairing))
    radius_range = radius.amax(3, keepdim=True) - radius.amin(3, keepdim=True)
    angle_range = angle.amax(3, keepdim=True) - angle.amin(3, keepdim=True)
    # half a bin, plus the rounding of the 16-bit zero and scale (relative 2**-11 of the values they carry)
    radius_bound = radius_range / 2 ** (radius_bits + 1) + 2**-10 * radius.amax(3, keepdim=True)
    angle_bound = angle_range / 2 ** (angle_bits + 1) + 2**-10 * 2 * math.pi
    assert (radius_hat - radius).abs().le(radius_bound).all()
    angle_error = torch.remainder(angle_hat - angle + math.pi, 2 * math.pi) - math.pi
    assert angle_error.abs().le(angle_bound + 1e-6).all()
    # the pair's vector: |r e^(ia) - r^ e^(ia^)| <= |r - r^| + r^ |a - a^|
    first, second = restored.reshape(1, 2, 2, G, 32), keys.reshape(1, 2, 2, G, 32)
    if pairing == "half":
        vector_error = torch.hypot(*(first - second).split(16, -1))
    else:
        vector_error = torch.hypot((first - second)[..., 0::2], (first - second)[..., 1::2])
    assert vector_error.le(radius_bound + radius_hat * angle_bound + 1e-4).all()
    # and the bound is not vacuous: at 2 bits the error is a sizeable part of it
    if bits == (2, 2):
        assert vector_error.amax() > 0.1 * (radius_bound + radius_hat * angle_bound).amax()


def test_more_bits_reconstruct_closer():
    keys = structured_keys(seed=7)
    errors = [(dequantize_polar_keys(*quantize_polar_keys(keys, G, b, b, "half"), "half") - keys).norm() for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.02 * errors[0]


def test_constant_group_reads_back_and_non_finite_group_reads_nan():
    keys = torch.full((1, 1, 2 * G, 32), 0.75)
    keys[..., 16:] = -0.5  # every pair is (0.75, -0.5): a constant radius and angle
    keys[:, :, G + 3, 4] = float("inf")
    restored = dequantize_polar_keys(*quantize_polar_keys(keys, G, 4, 4, "half"), "half")
    torch.testing.assert_close(restored[:, :, :G], keys[:, :, :G], atol=2e-3, rtol=0)
    assert torch.isnan(restored[:, :, G:, 4]).all() and torch.isnan(restored[:, :, G:, 20]).all()  # the pair of the inf
    assert torch.isfinite(restored[:, :, G:, 5]).all()


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_table_lookup_logits_equal_the_products_with_rebuilt_keys(pairing):
    keys = structured_keys(seed=3)
    query = torch.randn(1, 4, 5, 32, generator=torch.Generator().manual_seed(4)) * 3
    stored = quantize_polar_keys(keys, G, 4, 3, pairing)
    looked_up = polar_key_logits(query, *stored, pairing)
    assert looked_up.shape == (1, 4, 5, 2 * G)
    torch.testing.assert_close(looked_up, key_logits(query, dequantize_polar_keys(*stored, pairing)), atol=2e-3, rtol=1e-4)
