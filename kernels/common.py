"""Helpers shared by the Triton kernels: the quantizer's arithmetic, step for step.

The pack kernels must produce the *bit-identical* codes, scales and zeros of
:mod:`pnmix_patch.quantize`, so these device functions repeat its float32 arithmetic
exactly (see that module's docstring for the formulas):

- ``1 / scale`` and ``range / (2**b - 1)`` use ``tl.div_rn`` (IEEE round-to-nearest),
  not Triton's default fast division, which may differ in the last bit;
- ``torch.round`` rounds half to even, rebuilt here from ``floor``;
- NaN codes become 0 (``torch.nan_to_num``) and non-finite groups get NaN scale and zero;
- kernels using :func:`encode` are launched with ``enable_fp_fusion=False``: otherwise
  the compiler fuses ``(x - zero) * inverse + 0.5`` into one FMA, which skips the
  rounding of the product that torch does and flips codes that sit near a tie.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from pnmix_patch.quantize import key_word_distance

PDL = os.environ.get("PNMIX_PDL", "0") == "1"
"""Launch the decode step's kernels (``pnmix::gemv``, ``gemv_stacked``, ``gemv_swiglu``, ``decode_append``
and the decode-attention split and merge kernels) with programmatic dependent launch where the GPU and
Triton have it (:func:`has_pdl`, :func:`launch_pdl`). Off unless ``PNMIX_PDL=1`` is set at import;
:func:`programmatic_dependent_launch` overrides it within a block (:class:`~pnmix_patch.GraphedDecodeStep`
turns it on around its own warm-up and capture, with Inductor's kernels launched the same way). Measured
on an H200 (``benchmarks/bench_decode.py --pdl-ab``, graphed, both the library's and Inductor's kernels
with PDL; ``benchmarks/RESULTS.md``, twenty-fourth session): 0.968-0.971x the step's time at 32K and
0.990-0.993x at 1K (medians of turns, Qwen3-8B and Llama-3.1-8B); the library's kernels alone (twenty-second
session, with an earlier placement of the signal) gained nothing."""

_pdl_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar("pnmix_pdl", default=None)


@contextlib.contextmanager
def programmatic_dependent_launch(enabled: bool):
    """Within the block the library's kernels launch with programmatic dependent launch if ``enabled``
    (where :func:`has_pdl`), and without it if not, whatever :data:`PDL` says; a CUDA graph captured in
    the block records its launches so. The setting is the calling thread's (a context variable): other
    threads keep theirs, and it is restored on leaving the block, also by an exception."""
    token = _pdl_override.set(enabled)
    try:
        yield
    finally:
        _pdl_override.reset(token)


def pdl_requested() -> bool:
    """The switch :func:`launch_pdl` reads: :func:`programmatic_dependent_launch`'s where the calling
    thread is in such a block, else :data:`PDL`."""
    override = _pdl_override.get()
    return PDL if override is None else override


@triton.jit
def round_half_even(y):
    """``torch.round`` of float32 ``y``: nearest integer, ties to even.

    ``y + 0.5`` is exact for ``|y| < 2**23``; above that every float32 is already an
    integer and callers clamp the code to ``2**bits - 1`` anyway.
    """
    r = tl.floor(y + 0.5)
    odd = (r * 0.5 - tl.floor(r * 0.5)) != 0.0
    return tl.where((r - y == 0.5) & odd, r - 1.0, r)


@triton.jit
def minmax_scale_zero(low, high, nonfinite, levels, MIDPOINT: tl.constexpr):
    """Float32 scale and zero of min-max quantization (``quantize.minmax_params``).

    ``levels`` is ``2**bits - 1`` (float32, broadcast against ``low``; 1 means a 1-bit
    group); ``nonfinite`` counts the inf/NaN elements of each group.
    """
    value_range = high - low
    scale = tl.div_rn(value_range, levels)
    zero = low
    if MIDPOINT:
        # 0.25 * range is exact, so a fused multiply-add gives the same zero as torch.
        scale = tl.where(levels == 1.0, 0.5 * value_range, scale)
        zero = tl.where(levels == 1.0, low + 0.25 * value_range, low)
    scale = tl.where(nonfinite > 0, float("nan"), scale)
    zero = tl.where(nonfinite > 0, float("nan"), zero)
    return scale, zero


@triton.jit
def encode(x, scale, zero, levels):
    """Int32 codes of float32 ``x`` for the *stored* (16-bit, widened) ``scale``/``zero``."""
    inverse = tl.where(scale > 0.0, tl.div_rn(1.0, scale), 0.0)
    y = (x - zero) * inverse
    code = tl.minimum(tl.maximum(round_half_even(y), 0.0), levels)
    # NaN (non-finite group, or 0 * inf) encodes as 0, like torch.nan_to_num.
    return tl.where(y != y, 0.0, code).to(tl.int32)


@triton.jit
def transpose_byte_quads(words):
    """``words`` ``[N]`` (int32, ``N`` a multiple of 4) with each run of four byte-transposed: word
    ``b``'s byte ``i`` becomes byte ``b`` of word ``i`` (:func:`pnmix_patch.quantize.transpose_byte_quads`,
    the operand order of the packed codes). Distinct bits, so the sum is their OR."""
    N: tl.constexpr = words.shape[0]
    byte = tl.arange(0, 4)
    parts = (tl.reshape(words, [N // 4, 4])[:, :, None] >> (8 * byte)[None, None, :]) & 0xFF  # [run, word i, byte b]
    return tl.reshape(tl.sum(parts << (8 * byte)[None, :, None], 1), [N])


def key_word_distances(codes_high: torch.Tensor, codes_low: torch.Tensor) -> dict:
    """The constexprs ``HIGH_DISTANCE`` and ``LOW_DISTANCE`` of the kernels that write or read these
    key codes tensors ``[B, H, groups, b, G/32, C]``: each tensor's word order
    (``quantize.key_word_distance``)."""
    group_size = 32 * codes_high.shape[4]
    return dict(HIGH_DISTANCE=key_word_distance(group_size, codes_high.shape[-1]),
                LOW_DISTANCE=key_word_distance(group_size, codes_low.shape[-1]))


def nonempty(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a one-element stand-in when it is empty.

    Empty tensors (no low-bit channels, no sinks, ...) may have a null data pointer,
    which Triton refuses as an argument; the kernels never read them (every access
    is masked or sits in a zero-trip loop), so any valid pointer does.
    """
    return tensor if tensor.numel() else tensor.new_zeros((1,) * tensor.dim())


@functools.cache
def has_pdl(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` can launch with programmatic dependent launch: a
    GPU of compute capability 9.0 or newer, and a Triton whose kernels can wait and signal for it
    (``tl.extra.cuda.gdc_wait``, which older Tritons lack)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def launch_pdl(tensor: torch.Tensor) -> bool:
    """Whether a kernel working on ``tensor`` launches with programmatic dependent launch (PDL).

    At batch 1 a decode step is a chain of a few hundred short kernels, and each waits for the one
    before it to finish and for its own launch. Launched with PDL (``launch_pdl=True``), a kernel's
    programs may start as soon as every program of the previous kernel has passed
    :func:`let_next_kernel_launch` or exited (after a kernel that does not signal: once it has
    finished); they then wait in :func:`wait_for_previous_kernel` until that kernel's writes are
    visible. True for CUDA tensors where :func:`has_pdl` while :func:`pdl_requested`."""
    return pdl_requested() and tensor.is_cuda and has_pdl(tensor.device.index)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With ``PDL`` (the kernel launched with ``launch_pdl=True``, see :func:`launch_pdl`): wait until the
    previous kernel has finished and its writes are visible. Call it before the first load or store of
    memory that another kernel writes or reads: every input but constants such as weights, and every
    output. Loads of constants may come before it (they overlap the previous kernel's end)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """With ``PDL``: the next kernel may launch once every program of this one has got here (or exited).
    Call it after the main loop: its programs then start (and wait, or load their constants) while this
    kernel's last programs finish, instead of taking program slots that this kernel still needs."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
