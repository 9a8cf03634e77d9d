"""``pnmix::gemv`` and ``pnmix::gemv_stacked``: the Triton kernel (interpreted on CPU) against ``F.linear``, and the ops themselves."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import seeded

from pnmix_patch.kernels.gemv import BLOCK_K, _gemv_cuda, _gemv_stacked_cuda, gemv, gemv_stacked, triton_gemv, triton_gemv_stacked

# (rows, columns): no column, a single row and column, columns at, under and over the block and two blocks,
# a number of rows that is not a power of two.
SHAPES = [(3, 0), (1, 1), (3, 31), (5, BLOCK_K - 1), (4, BLOCK_K), (3, BLOCK_K + 1), (17, 2 * BLOCK_K + 7)]


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
    assert_close_to_float64(got, want, columns)


def assert_close_to_float64(got: torch.Tensor, want: torch.Tensor, columns: int) -> None:
    # float32 sums in another order than float64 (absolute error growing like sqrt(K)), then one
    # rounding to dtype (relative).
    atol = (1e-6 if got.dtype == torch.float32 else 1e-5) * (columns**0.5 + 1)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-6 if got.dtype == torch.float32 else 1e-3)


def test_launcher_on_cpu_tensors_runs_triton_and_falls_back_for_strided_weights(monkeypatch):
    """``_gemv_cuda`` called on CPU tensors (the kernel interpreted): contiguous weights go to Triton,
    strided ones (and inputs of any stride) to ``F.linear``, same results."""
    import pnmix_patch.kernels.gemv as module

    generator = seeded()
    weight = torch.randn(40, 7, generator=generator, dtype=torch.float16)
    x = torch.randn(80, generator=generator, dtype=torch.float16)[::2]  # strided input
    bias = torch.randn(7, generator=generator, dtype=torch.float16)
    launched = []
    monkeypatch.setattr(module, "triton_gemv", lambda *args: launched.append(1) or triton_gemv(*args))
    want = F.linear(x.float(), weight.t().float(), bias.float())
    torch.testing.assert_close(_gemv_cuda(x, weight.t().contiguous(), bias).float(), want, atol=1e-2, rtol=1e-3)
    assert launched == [1]
    torch.testing.assert_close(_gemv_cuda(x, weight.t(), bias).float(), want, atol=1e-2, rtol=1e-3)
    assert launched == [1]


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


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_op_gradients(with_bias):
    generator = seeded()
    x = torch.randn(5, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=generator, dtype=torch.float64, requires_grad=True) if with_bias else None
    assert torch.autograd.gradcheck(gemv, (x, weight, bias))


@pytest.mark.parametrize(
    "x, weight, bias, error, message",
    [
        (torch.ones(2, 8), torch.ones(4, 8), None, ValueError, r"x \[K\] and weight \[N, K\]; got x \(2, 8\)"),
        (torch.ones(7), torch.ones(4, 8), None, ValueError, r"got x \(7,\) and weight \(4, 8\)"),
        (torch.ones(8), torch.ones(4, 8), torch.ones(3), ValueError, r"bias must be \[N\] = \[4\]; got \(3,\)"),
        (torch.ones(8), torch.ones(4, 8, dtype=torch.float16), None, TypeError, "one dtype; got x torch.float32, weight torch.float16"),
        (torch.ones(8), torch.ones(4, 8, device="meta"), None, ValueError, "one device; got x on cpu, weight on meta"),
    ],
)
def test_gemv_op_rejects_bad_inputs(x, weight, bias, error, message):
    with pytest.raises(error, match=message):
        gemv(x, weight, bias)


# Rows of each stacked weight: one to three weights, single rows, uneven sizes (q, k, v-like).
STACKS = [(3,), (2, 5), (4, 1, 3), (1, 1, 1), (4, 0, 3), (0, 2), (2, 0)]  # a weight of no rows anywhere in a stack


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("columns", [0, 31, BLOCK_K, BLOCK_K + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_gemv_stacked_matches_linear(stack, columns, dtype, with_bias):
    generator = seeded()
    weights = [torch.randn(rows, columns, generator=generator).to(dtype) for rows in stack]
    biases = [torch.randn(rows, generator=generator).to(dtype) for rows in stack] if with_bias else []
    x = torch.randn(columns, generator=generator).to(dtype)
    want = torch.cat([F.linear(x.double(), w.double(), b.double() if with_bias else None) for w, b in zip(weights, biases or weights)])
    got = triton_gemv_stacked(x, weights, biases)
    assert got.dtype == dtype and got.shape == (sum(stack),)
    assert_close_to_float64(got, want, columns)


def test_stacked_launcher_on_cpu_tensors_falls_back_for_strided_weights(monkeypatch):
    import pnmix_patch.kernels.gemv as module

    generator = seeded()
    weights = [torch.randn(9, 4, generator=generator, dtype=torch.float16) for _ in range(3)]
    x = torch.randn(9, generator=generator, dtype=torch.float16)
    launched = []
    monkeypatch.setattr(module, "triton_gemv_stacked", lambda *args: launched.append(1) or triton_gemv_stacked(*args))
    want = torch.cat([F.linear(x.float(), w.t().float()) for w in weights])
    torch.testing.assert_close(_gemv_stacked_cuda(x, [w.t().contiguous() for w in weights], []).float(), want, atol=1e-2, rtol=1e-3)
    assert launched == [1]
    torch.testing.assert_close(
        _gemv_stacked_cuda(x, [weights[0].t().contiguous(), weights[1].t(), weights[2].t()], []).float(), want, atol=1e-2, rtol=1e-3
    )
    assert launched == [1]


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_stacked_op(with_bias):
    generator = seeded()
    weights = [torch.randn(rows, 40, generator=generator, dtype=torch.bfloat16) for rows in (6, 2, 2)]
    biases = [torch.randn(w.shape[0], generator=generator, dtype=torch.bfloat16) for w in weights] if with_bias else []
    x = torch.randn(40, generator=generator, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pnmix.gemv_stacked.default, (x, weights, biases))
    want = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases or [None] * 3)])
    assert torch.equal(gemv_stacked(x, weights, biases), want)


@pytest.mark.parametrize(
    "weights, biases, error, message",
    [
        ([], [], ValueError, "1 to 3 weights; got 0"),
        ([torch.ones(2, 8)] * 4, [], ValueError, "1 to 3 weights; got 4"),
        ([torch.ones(2, 8)] * 2, [torch.ones(2)], ValueError, "one bias per weight or none; got 1 biases for 2 weights"),
        ([torch.ones(2, 8), torch.ones(2, 7)], [], ValueError, r"got x \(8,\) and weight \(2, 7\)"),
        ([torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16)], [], TypeError, "one dtype"),
    ],
)
def test_gemv_stacked_op_rejects_bad_inputs(weights, biases, error, message):
    with pytest.raises(error, match=message):
        gemv_stacked(torch.ones(8), weights, biases)
