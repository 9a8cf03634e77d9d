"""``pnmix::gemv``: the Triton kernel (interpreted on CPU) against ``F.linear``, and the op itself."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import seeded

from pnmix_patch.kernels.gemv import BLOCK_K, gemv, triton_gemv

# (rows, columns): a single row and column, columns at, under and over the block and two blocks,
# a number of rows that is not a power of two.
SHAPES = [(1, 1), (3, 31), (5, BLOCK_K - 1), (4, BLOCK_K), (3, BLOCK_K + 1), (17, 2 * BLOCK_K + 7)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows, columns", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_gemv_matches_linear(rows, columns, dtype, with_bias):
    generator = seeded()
    weight = torch.randn(rows, columns, generator=generator).to(dtype)
    x = torch.randn(columns, generator=generator).to(dtype)
    bias = torch.randn(rows, generator=generator).to(dtype) if with_bias else None
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = triton_gemv(x, weight, bias)
    assert got.dtype == dtype and got.shape == (rows,)
    # float32 sums in another order than float64; the result rounded once to dtype.
    tolerance = (1e-5 if dtype == torch.float32 else 1e-3) * (columns**0.5 + 1)
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_triton_gemv_no_rows():
    assert triton_gemv(torch.ones(8), torch.ones(0, 8)).shape == (0,)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_op(with_bias):
    generator = seeded()
    weight = torch.randn(6, 40, generator=generator, dtype=torch.bfloat16)
    x = torch.randn(40, generator=generator, dtype=torch.bfloat16)
    bias = torch.randn(6, generator=generator, dtype=torch.bfloat16) if with_bias else None
    torch.library.opcheck(torch.ops.pnmix.gemv.default, (x, weight, bias))
    assert torch.equal(gemv(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    "x, weight, bias, message",
    [
        (torch.ones(2, 8), torch.ones(4, 8), None, r"x \[K\] and weight \[N, K\]; got x \(2, 8\)"),
        (torch.ones(7), torch.ones(4, 8), None, r"got x \(7,\) and weight \(4, 8\)"),
        (torch.ones(8), torch.ones(4, 8), torch.ones(3), r"bias must be \[N\] = \[4\]; got \(3,\)"),
        (torch.ones(8), torch.ones(4, 8, dtype=torch.float16), None, "one dtype; got x torch.float32, weight torch.float16"),
    ],
)
def test_gemv_op_rejects_bad_inputs(x, weight, bias, message):
    with pytest.raises((ValueError, TypeError), match=message):
        gemv(x, weight, bias)
