"""A gated MLP's first half for one token: ``silu(W_gate x + b_gate) * (W_up x + b_up)`` (``pnmix::gemv_swiglu``).

Llama, Mistral and Qwen MLPs compute ``down_proj(silu(gate_proj(x)) * up_proj(x))``. At one token the
gate and up products are two weight reads of ``[I, K]`` each plus an elementwise kernel; here one
launch reads both (program ``i`` takes row ``i`` of each, two float32 accumulators fed in the same
loop, so twice the bytes in flight per program) and applies the activation to the two sums before a
single rounding, so the ``[I]`` gate and up vectors are never written.

Rounding differs from the model's own forward, which rounds the gate and up products and the
activation to the weight's dtype in turn: this kernel keeps them in float32 (closer to the exact
value). The CPU implementation is that forward itself (:func:`gemv_swiglu_reference`), so CPU results
do not move.

Registered as ``torch.ops.pnmix.gemv_swiglu`` (``custom_op`` + ``register_fake``; inference only, no
backward: :mod:`pnmix_patch.linear` calls it when no gradient is needed). CUDA runs
:func:`triton_gemv_swiglu` for contiguous 16- and 32-bit weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import launch_pdl, let_next_kernel_launch, wait_for_previous_kernel
from .gemv import _check, _load_block, _triton_serves, block_for

BLOCK_K = 512
"""Elements of each row read per iteration (4 warps: 8 bytes per thread and load, twice per
iteration). On an H200 (K = 4096) 512 columns and 4 warps are the fastest of seven shapes for both
8B models' gate/up weights (Llama-3.1-8B, 2 x [14336, 4096]; Qwen3-8B, 2 x [12288, 4096])."""


@triton.jit
def _gemv_swiglu_kernel(
    x_ptr,
    gate_ptr,
    up_ptr,
    gate_bias_ptr,
    up_bias_ptr,
    y_ptr,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    row_start = row.to(tl.int64) * K  # the same row of both [I, K] weights
    cols = tl.arange(0, BLOCK_K)
    # The weights' first blocks are read before waiting for the kernel that writes x (with PDL).
    gate_first = _load_block(gate_ptr + row_start, cols, K, EVEN_K)
    up_first = _load_block(up_ptr + row_start, cols, K, EVEN_K)
    wait_for_previous_kernel(PDL)
    x = _load_block(x_ptr, cols, K, EVEN_K)
    gate_acc = gate_first * x
    up_acc = up_first * x
    for start in range(BLOCK_K, K, BLOCK_K):
        x = _load_block(x_ptr + start, cols, K - start, EVEN_K)
        gate_acc += _load_block(gate_ptr + row_start + start, cols, K - start, EVEN_K) * x
        up_acc += _load_block(up_ptr + row_start + start, cols, K - start, EVEN_K) * x
    let_next_kernel_launch(PDL)
    gate = tl.sum(gate_acc, 0)
    up = tl.sum(up_acc, 0)
    if HAS_BIAS:
        gate += tl.load(gate_bias_ptr + row).to(tl.float32)
        up += tl.load(up_bias_ptr + row).to(tl.float32)
    tl.store(y_ptr + row, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty))


def triton_gemv_swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch :func:`_gemv_swiglu_kernel`: ``x [K]``, contiguous ``gate_weight`` and ``up_weight [I, K]``,
    both biases ``[I]`` or neither; returns ``[I]`` in ``x``'s dtype."""
    rows, k = gate_weight.shape
    out = torch.empty(rows, device=x.device, dtype=x.dtype)
    if rows == 0:
        return out
    block, even = block_for(k, BLOCK_K)
    has_bias = gate_bias is not None
    pdl = launch_pdl(x)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on the tensors' GPU
        _gemv_swiglu_kernel[(rows,)](
            x.contiguous(),
            gate_weight,
            up_weight,
            gate_bias.contiguous() if has_bias else out,
            up_bias.contiguous() if has_bias else out,
            out,
            k,
            HAS_BIAS=has_bias,
            BLOCK_K=block,
            EVEN_K=even,
            PDL=pdl,
            launch_pdl=pdl,
            num_warps=4,
        )
    return out


def gemv_swiglu_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)``, as the models compute it."""
    return F.silu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)


def _check_swiglu(x, gate_weight, up_weight, gate_bias, up_bias) -> None:
    _check(x, gate_weight, gate_bias)
    _check(x, up_weight, up_bias)
    if gate_weight.shape != up_weight.shape:
        raise ValueError(f"gemv_swiglu needs gate and up weights of one shape; got {tuple(gate_weight.shape)} and {tuple(up_weight.shape)}")
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("gemv_swiglu takes both biases or neither; got one")


@torch.library.custom_op("pnmix::gemv_swiglu", mutates_args=())
def gemv_swiglu(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None
) -> torch.Tensor:
    """``silu(gate_weight @ x + gate_bias) * (up_weight @ x + up_bias)`` for one token: ``x [K]``, weights
    ``[I, K]``, biases ``[I]`` (both or neither) -> ``[I]``, all of one dtype. This default
    implementation is :func:`gemv_swiglu_reference`; CUDA runs Triton. The weights are read early with
    PDL, as in :func:`~pnmix_patch.kernels.gemv.gemv`."""
    _check_swiglu(x, gate_weight, up_weight, gate_bias, up_bias)
    return gemv_swiglu_reference(x, gate_weight, up_weight, gate_bias, up_bias)


@gemv_swiglu.register_kernel("cuda")
def _gemv_swiglu_cuda(x, gate_weight, up_weight, gate_bias, up_bias):
    _check_swiglu(x, gate_weight, up_weight, gate_bias, up_bias)
    if _triton_serves([gate_weight, up_weight]):
        return triton_gemv_swiglu(x, gate_weight, up_weight, gate_bias, up_bias)
    return gemv_swiglu_reference(x, gate_weight, up_weight, gate_bias, up_bias)


@gemv_swiglu.register_fake
def _gemv_swiglu_fake(x, gate_weight, up_weight, gate_bias, up_bias):
    _check_swiglu(x, gate_weight, up_weight, gate_bias, up_bias)
    return x.new_empty(gate_weight.shape[0])
