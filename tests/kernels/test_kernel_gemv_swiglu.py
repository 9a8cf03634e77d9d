"""``pnmix::gemv_swiglu``: the Triton kernel (interpreted on CPU) against the MLP's own arithmetic in float64, and the op."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import seeded
from test_kernel_gemv import assert_close_to_float64

from pnmix_patch.kernels.gemv_swiglu import BLOCK_K, _gemv_swiglu_cuda, gemv_swiglu, triton_gemv_swiglu

# (rows, columns): no column, a single row and column, columns at, under and over the block and two blocks.
SHAPES = [(3, 0), (1, 1), (3, 31), (5, BLOCK_K - 1), (4, BLOCK_K), (3, BLOCK_K + 1), (17, 2 * BLOCK_K + 7)]


def inputs(rows: int, columns: int, dtype: torch.dtype, with_bias: bool, generator: torch.Generator):
    x = torch.randn(columns, generator=generator).to(dtype)
    gate, up = (torch.randn(rows, columns, generator=generator).to(dtype) for _ in range(2))
    biases = [torch.randn(rows, generator=generator).to(dtype) if with_bias else None for _ in range(2)]
    return x, gate, up, *biases


def float64_swiglu(x, gate, up, gate_bias, up_bias) -> torch.Tensor:
    def product(w, b):
        return F.linear(x.double(), w.double(), None if b is None else b.double())

    return F.silu(product(gate, gate_bias)) * product(up, up_bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows, columns", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_gemv_swiglu_matches_float64(rows, columns, dtype, with_bias):
    args = inputs(rows, columns, dtype, with_bias, seeded())
    got = triton_gemv_swiglu(*args)
    assert got.dtype == dtype and got.shape == (rows,)
    # silu(g) * u grows like the sums themselves (~sqrt(K)): the sums' absolute error scaled by it.
    assert_close_to_float64(got / (columns**0.5 + 1), float64_swiglu(*args) / (columns**0.5 + 1), columns)


def test_launcher_on_cpu_tensors_runs_triton_and_falls_back_for_strided_weights(monkeypatch):
    import pnmix_patch.kernels.gemv_swiglu as module

    x, gate, up, _, _ = inputs(6, 10, torch.float16, False, seeded())
    launched = []
    monkeypatch.setattr(module, "triton_gemv_swiglu", lambda *args: launched.append(1) or triton_gemv_swiglu(*args))
    want = float64_swiglu(x, gate, up, None, None).float()
    torch.testing.assert_close(_gemv_swiglu_cuda(x, gate, up, None, None).float(), want, atol=1e-2, rtol=1e-2)
    assert launched == [1]
    strided = up.t().contiguous().t()
    torch.testing.assert_close(_gemv_swiglu_cuda(x, gate, strided, None, None).float(), want, atol=1e-2, rtol=1e-2)
    assert launched == [1]


def test_triton_gemv_swiglu_no_rows():
    assert triton_gemv_swiglu(torch.ones(8), torch.ones(0, 8), torch.ones(0, 8)).shape == (0,)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_swiglu_op(with_bias):
    args = inputs(6, 40, torch.bfloat16, with_bias, seeded())
    torch.library.opcheck(torch.ops.pnmix.gemv_swiglu.default, args)
    x, gate, up, gate_bias, up_bias = args
    assert torch.equal(gemv_swiglu(*args), F.silu(F.linear(x, gate, gate_bias)) * F.linear(x, up, up_bias))


@pytest.mark.parametrize(
    "up, gate_bias, up_bias, error, message",
    [
        (torch.ones(3, 8), None, None, ValueError, r"gate and up weights of one shape; got \(4, 8\) and \(3, 8\)"),
        (torch.ones(4, 8), torch.ones(4), None, ValueError, "both biases or neither"),
        (torch.ones(4, 7), None, None, ValueError, r"got x \(8,\) and weight \(4, 7\)"),
        (torch.ones(4, 8, dtype=torch.float16), None, None, TypeError, "one dtype"),
    ],
)
def test_gemv_swiglu_op_rejects_bad_inputs(up, gate_bias, up_bias, error, message):
    with pytest.raises(error, match=message):
        gemv_swiglu(torch.ones(8), torch.ones(4, 8), up, gate_bias, up_bias)
