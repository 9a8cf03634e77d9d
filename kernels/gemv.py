"""One token through a linear layer: ``y = W x + b`` read at the memory's speed (``pnmix::gemv``).

At batch 1 a decode step is bound by reading the weights once: Llama-3.1-8B's step reads
15.0 GB of them. Measured on an H200 (``benchmarks/diagnostics/gemv_bandwidth.py``,
``benchmarks/RESULTS.md``, nineteenth session), cuBLAS's one-token products through ``F.linear`` read
the attention's smaller weights (``[1024, 4096]``, ``[4096, 4096]``) at 25-60% of the device's copy
bandwidth and the MLP's at 86-90%; every product of a Llama-3.1-8B step, one after the other in one
CUDA graph, took 4.66 ms through cuBLAS and 3.93 ms through this kernel (floor 3.56 ms).

The kernel is a plain one: one program per output row, the row read in ``BLOCK_K``-element
chunks (16 bytes per thread and load at 4 warps, bf16), multiplied by the same chunk of ``x`` in
float32 and summed once at the end. Rows are independent, so the N programs spread over the
whole GPU even for the 1,024 rows of a K or V projection (8 warps there: fewer rows, more bytes
in flight per program).

Registered as ``torch.ops.pnmix.gemv`` (``custom_op`` + ``register_fake``, and a backward so that a
patched model still trains): CPU and other devices run :func:`gemv_reference` (``F.linear``), CUDA runs
:func:`triton_gemv` for contiguous 16- and 32-bit weights. Used by :func:`pnmix_patch.patch_gemv`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_K = 1024
"""Elements of a row read per iteration. In ``gemv_bandwidth.py``'s sweep (256, 512 or 1024 columns, 1 to
16 rows per program, 4 or 8 warps) one row per program won for every weight shape of the two 8B
models on an H200, with 1024 columns for all but the down projections, where 512 won in some runs by
at most 1.3%."""
FEW_ROWS = 2048
"""Up to this many rows the kernel launches 8 warps per program, else 4 (the best measured for 1,024 rows
and for 4,096 and more, respectively)."""


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, K, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    w_row = w_ptr + row.to(tl.int64) * K
    acc = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        if EVEN_K:  # no mask: the loads stay 16-byte vectors without predicates
            x = tl.load(x_ptr + start + cols).to(tl.float32)
            acc += tl.load(w_row + start + cols).to(tl.float32) * x
        else:
            inside = start + cols < K
            x = tl.load(x_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
            acc += tl.load(w_row + start + cols, mask=inside, other=0.0).to(tl.float32) * x
    y = tl.sum(acc, 0)
    if HAS_BIAS:
        y += tl.load(b_ptr + row).to(tl.float32)
    tl.store(y_ptr + row, y.to(y_ptr.dtype.element_ty))


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_gemv_kernel`: ``x [K]``, ``weight [N, K]`` contiguous, ``bias [N]`` or None;
    returns ``[N]`` in ``x``'s dtype."""
    n, k = weight.shape
    out = torch.empty(n, device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    block = min(BLOCK_K, triton.next_power_of_2(max(k, 1)))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on the tensors' GPU
        _gemv_kernel[(n,)](
            x.contiguous(), weight, out if bias is None else bias.contiguous(), out, k,
            HAS_BIAS=bias is not None, BLOCK_K=block, EVEN_K=k % block == 0, num_warps=8 if n <= FEW_ROWS else 4,
        )  # fmt: skip
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one token ``x [K]``: ``[N]``."""
    return F.linear(x, weight, bias)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 1 or weight.dim() != 2 or x.shape[0] != weight.shape[1]:
        raise ValueError(f"gemv takes x [K] and weight [N, K]; got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv's bias must be [N] = [{weight.shape[0]}]; got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"gemv needs one dtype; got x {x.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(
            f"gemv needs one device; got x on {x.device}, weight on {weight.device}, bias on {None if bias is None else bias.device}"
        )


@torch.library.custom_op("pnmix::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``weight @ x + bias`` for one token: ``x [K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[N]``,
    all of one dtype. This default implementation is :func:`gemv_reference`; CUDA runs Triton."""
    _check(x, weight, bias)
    return gemv_reference(x, weight, bias)


@gemv.register_kernel("cuda")
def _gemv_cuda(x, weight, bias):
    _check(x, weight, bias)
    if weight.is_contiguous() and weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return triton_gemv(x, weight, bias)
    return gemv_reference(x, weight, bias)


@gemv.register_fake
def _gemv_fake(x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty(weight.shape[0])


def _gemv_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)


def _gemv_backward(ctx, grad):
    """``y = W x + b``: ``dx = W^T dy``, ``dW = dy x^T``, ``db = dy``, each only where it is needed
    (``dW`` of an LM head is as large as its weight)."""
    x, weight = ctx.saved_tensors
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad
    return (grad @ weight if needs_x else None, torch.outer(grad, x) if needs_weight else None,
            grad if needs_bias else None)  # fmt: skip


gemv.register_autograd(_gemv_backward, setup_context=_gemv_setup_context)
