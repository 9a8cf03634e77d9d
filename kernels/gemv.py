"""One token through a linear layer: ``y = W x + b`` read at the memory's speed (``pnmix::gemv``).

At batch 1 a decode step is bound by reading the weights once: Llama-3.1-8B's step reads
15.0 GB of them. cuBLAS's one-token products through ``F.linear`` read the attention's smaller
weights (``[1024, 4096]``, ``[4096, 4096]``) well below the device's copy bandwidth; this kernel reads
every weight shape of the 8B models closer to it (``benchmarks/bench_decode.py --gemv`` times whole
steps with it).

The kernel is a plain one: one program per output row, the row read in ``BLOCK_K``-element
chunks (16 bytes per thread and load at 4 warps, bf16), multiplied by the same chunk of ``x`` in
float32 and summed once at the end. Rows are independent, so the N programs spread over the
whole GPU even for the 1,024 rows of a K or V projection (8 warps there: fewer rows, more bytes
in flight per program).

The same kernel serves up to three weights stacked in one launch (``torch.ops.pnmix.gemv_stacked``:
a layer's q, k and v projections, read as one ``[N_q + 2 N_kv, K]`` product without concatenating
the weights): a step then pays one launch and one tail instead of three. On an H200 Llama-3.1-8B's
q/k/v take 14.5 us stacked, as long as one concatenated weight, against 19.0 us in three launches.

Registered as ``torch.ops.pnmix.gemv`` (``custom_op`` + ``register_fake``, and a backward so that a
patched model still trains) and ``torch.ops.pnmix.gemv_stacked`` (inference only): CPU and other
devices run :func:`gemv_reference` / :func:`gemv_stacked_reference` (``F.linear``), CUDA runs Triton
for contiguous 16- and 32-bit weights. Used by :func:`pnmix_patch.patch_gemv`.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import launch_pdl, let_next_kernel_launch, wait_for_previous_kernel

BLOCK_K = 1024
"""Elements of a row read per iteration. Over 256, 512 or 1024 columns, 1 to 16 rows per program and 4 or
8 warps, one row per program is the fastest for every weight shape of the two 8B models on an H200,
with 1024 columns (512 is no faster for the down projections)."""
FEW_ROWS = 2048
"""Up to this many rows the kernel launches 8 warps per program, else 4 (the best measured for 1,024 rows
and for 4,096 and more, respectively)."""


MAX_STACKED = 3
"""Weights one launch of :func:`triton_gemv_stacked` reads (a layer's q, k and v projections)."""


@triton.jit
def _load_block(ptr, cols, remaining, EVEN_K: tl.constexpr):
    """Float32 ``ptr[cols]``, zeros from ``remaining`` on; with ``EVEN_K`` unmasked (16-byte vector loads)."""
    if EVEN_K:
        return tl.load(ptr + cols).to(tl.float32)
    return tl.load(ptr + cols, mask=cols < remaining, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    K,
    END0,
    END1,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # y = [W0; W1; W2] x (+ [b0; b1; b2]), one row per program: rows [0, END0) of y come from W0,
    # [END0, END1) from W1, the rest from W2 (one weight: END0 = END1 = N). The weight is picked
    # with selects, not branches, so that the row pointer keeps its known 16-byte alignment.
    row = tl.program_id(0)
    past0 = row >= END0
    past1 = row >= END1
    local_row = row - tl.where(past1, END1, tl.where(past0, END0, 0))
    w_row = tl.where(past1, w2_ptr, tl.where(past0, w1_ptr, w0_ptr)) + local_row.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    # The weight's first block is read before waiting for the kernel that writes x (with PDL).
    first = _load_block(w_row, cols, K, EVEN_K)
    wait_for_previous_kernel(PDL)
    acc = first * _load_block(x_ptr, cols, K, EVEN_K)
    for start in range(BLOCK_K, K, BLOCK_K):
        acc += _load_block(w_row + start, cols, K - start, EVEN_K) * _load_block(x_ptr + start, cols, K - start, EVEN_K)
    let_next_kernel_launch(PDL)
    y = tl.sum(acc, 0)
    if HAS_BIAS:
        y += tl.load(tl.where(past1, b2_ptr, tl.where(past0, b1_ptr, b0_ptr)) + local_row).to(tl.float32)
    tl.store(y_ptr + row, y.to(y_ptr.dtype.element_ty))


def block_for(k: int, block_k: int = BLOCK_K) -> tuple[int, bool]:
    """``(BLOCK_K, EVEN_K)`` of a one-token product over ``k`` columns, read ``block_k`` at a time at most
    (``k = 0``: masked, so that the kernel's first block, read outside its loop, touches no memory)."""
    block = min(block_k, triton.next_power_of_2(max(k, 1)))
    return block, k > 0 and k % block == 0


def triton_gemv_stacked(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """Launch :func:`_gemv_kernel` once for 1 to :data:`MAX_STACKED` products of one ``x [K]``: contiguous
    ``weights [N_i, K]`` and ``biases [N_i]`` (one per weight, or none); returns their outputs end to
    end, ``[sum N_i]`` in ``x``'s dtype."""
    rows = [w.shape[0] for w in weights]
    k = weights[0].shape[1]
    out = torch.empty(sum(rows), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    padded_weights = weights + weights[:1] * (MAX_STACKED - len(weights))  # unused slots: never selected
    padded_biases = [b.contiguous() for b in biases] or [out]  # unread without HAS_BIAS
    padded_biases += padded_biases[:1] * (MAX_STACKED - len(padded_biases))
    block, even = block_for(k)
    pdl = launch_pdl(x)
    end0, end1 = (list(itertools.accumulate(rows)) + [out.numel()] * MAX_STACKED)[:2]  # [N0, N0 + N1] or N
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on the tensors' GPU
        _gemv_kernel[(out.numel(),)](
            x.contiguous(),
            *padded_weights,
            *padded_biases,
            out,
            k,
            end0,
            end1,
            HAS_BIAS=bool(biases),
            BLOCK_K=block,
            EVEN_K=even,
            PDL=pdl,
            launch_pdl=pdl,
            num_warps=8 if out.numel() <= FEW_ROWS else 4,
        )
    return out


def triton_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_gemv_kernel` for one product: ``x [K]``, ``weight [N, K]`` contiguous, ``bias [N]``
    or None; returns ``[N]`` in ``x``'s dtype."""
    return triton_gemv_stacked(x, [weight], [] if bias is None else [bias])


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one token ``x [K]``: ``[N]``."""
    return F.linear(x, weight, bias)


def gemv_stacked_reference(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """The products of one token ``x [K]`` with each of ``weights`` (plus ``biases``, if any), end to end."""
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))])


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


def _check_stacked(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> None:
    if not 1 <= len(weights) <= MAX_STACKED:
        raise ValueError(f"gemv_stacked takes 1 to {MAX_STACKED} weights; got {len(weights)}")
    if biases and len(biases) != len(weights):
        raise ValueError(f"gemv_stacked takes one bias per weight or none; got {len(biases)} biases for {len(weights)} weights")
    for weight, bias in zip(weights, biases or [None] * len(weights)):
        _check(x, weight, bias)


def _triton_serves(weights: list[torch.Tensor]) -> bool:
    return all(w.is_contiguous() and w.dtype in (torch.float16, torch.bfloat16, torch.float32) for w in weights)


@torch.library.custom_op("pnmix::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``weight @ x + bias`` for one token: ``x [K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[N]``,
    all of one dtype. This default implementation is :func:`gemv_reference`; CUDA runs Triton. With
    :data:`~pnmix_patch.kernels.common.PDL` the kernel reads the weight's first block before waiting for
    the previous kernel: the weight must not be written by the kernels just before (weights are not)."""
    _check(x, weight, bias)
    return gemv_reference(x, weight, bias)


@gemv.register_kernel("cuda")
def _gemv_cuda(x, weight, bias):
    _check(x, weight, bias)
    if _triton_serves([weight]):
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
    return (grad @ weight if needs_x else None, torch.outer(grad, x) if needs_weight else None, grad if needs_bias else None)


gemv.register_autograd(_gemv_backward, setup_context=_gemv_setup_context)


@torch.library.custom_op("pnmix::gemv_stacked", mutates_args=())
def gemv_stacked(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """The products of one token ``x [K]`` with 1 to 3 ``weights [N_i, K]`` (a layer's q, k and v
    projections) in one launch, plus ``biases [N_i]`` (one per weight, or an empty list), returned end
    to end: ``[sum N_i]``, all of one dtype. Inference only (no backward): :mod:`pnmix_patch.linear`
    calls it when no gradient is needed. This default implementation is
    :func:`gemv_stacked_reference`; CUDA runs Triton. The weights are read early with PDL, as in :func:`gemv`."""
    _check_stacked(x, weights, biases)
    return gemv_stacked_reference(x, weights, biases)


@gemv_stacked.register_kernel("cuda")
def _gemv_stacked_cuda(x, weights, biases):
    _check_stacked(x, weights, biases)
    if _triton_serves(weights):
        return triton_gemv_stacked(x, weights, biases)
    return gemv_stacked_reference(x, weights, biases)


@gemv_stacked.register_fake
def _gemv_stacked_fake(x, weights, biases):
    _check_stacked(x, weights, biases)
    return x.new_empty(sum(w.shape[0] for w in weights))
