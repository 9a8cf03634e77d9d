"""Helpers shared by the kernels: the quantizer's arithmetic step for step, where the key codes' words
are stored, programmatic dependent launch, and the split-K launch and merge of the two
decode-attention kernels.

The pack kernels must produce the *bit-identical* codes, scales and zeros of
:mod:`pnmix_patch.reference.quantize`, so these device functions repeat its float32 arithmetic
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
import math
import os

import torch
import triton
import triton.language as tl

from pnmix_patch.reference.quantize import key_word_distance

PDL = os.environ.get("PNMIX_PDL", "0") == "1"
"""Launch the decode step's kernels (``pnmix::gemv``, ``gemv_stacked``, ``gemv_swiglu``, ``decode_append``
and the decode-attention split and merge kernels) with programmatic dependent launch where the GPU and
Triton have it (:func:`has_pdl`, :func:`launch_pdl`). Off unless ``PNMIX_PDL=1`` is set at import;
:func:`programmatic_dependent_launch` overrides it within a block (:class:`~pnmix_patch.GraphedDecodeStep`
turns it on around its own warm-up and capture, with Inductor's kernels launched the same way). On an
H200, graphed, with both the library's and Inductor's kernels launched so, a decode step takes
0.968-0.971x its time without PDL at 32K and 0.990-0.993x at 1K (Qwen3-8B and Llama-3.1-8B;
``benchmarks/bench_decode.py --pdl-ab``, ``docs/performance.md``)."""

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
    ``b``'s byte ``i`` becomes byte ``b`` of word ``i`` (:func:`pnmix_patch.reference.quantize.transpose_byte_quads`,
    the operand order of the packed codes). Distinct bits, so the sum is their OR."""
    N: tl.constexpr = words.shape[0]
    byte = tl.arange(0, 4)
    parts = (tl.reshape(words, [N // 4, 4])[:, :, None] >> (8 * byte)[None, None, :]) & 0xFF  # [run, word i, byte b]
    return tl.reshape(tl.sum(parts << (8 * byte)[None, :, None], 1), [N])


@triton.jit
def compacted_field_word(half, lane_row, lane_column, PART: tl.constexpr):
    """Where the field word of lane (``lane_row``, ``lane_column``) of half ``half`` of a pair of slots
    is stored when it lies in the last partial chunk (``PART`` channels) of a key codes tensor
    (:func:`pnmix_patch.reference.quantize.compact_key_fields`): the pair's words of lanes that hold
    channels are pooled, the first half's lane by lane then the second half's, and split over the
    pair's two slots, ``PART`` words each. Returns the slot within the pair, the word's column after
    the whole chunks, and whether the lane holds channels at all."""
    LANES_FIRST: tl.constexpr = min(PART, 16) // 4
    LANES_SECOND: tl.constexpr = (PART - min(PART, 16)) // 4
    pool = tl.where(half == 0, lane_row * LANES_FIRST, 8 * LANES_FIRST + lane_row * LANES_SECOND) + lane_column
    return pool // PART, pool % PART, lane_column < tl.where(half == 0, LANES_FIRST, LANES_SECOND)


def key_word_distances(codes_high: torch.Tensor, codes_low: torch.Tensor) -> dict:
    """The constexprs ``HIGH_DISTANCE`` and ``LOW_DISTANCE`` of the kernels that write or read these
    key codes tensors ``[B, H, groups, b, G/32, C]``: each tensor's word order
    (``quantize.key_word_distance``)."""
    group_size = 32 * codes_high.shape[4]
    return dict(
        HIGH_DISTANCE=key_word_distance(group_size, codes_high.shape[-1], codes_high.shape[3]),
        LOW_DISTANCE=key_word_distance(group_size, codes_low.shape[-1], codes_low.shape[3]),
    )


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


# Split-K decode attention: shared by the Triton (decode_attention) and Gluon (decode_attention_mma) split kernels.


@triton.jit
def merge_splits_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    overflow_ptr,
    num_q_heads,
    num_splits,
    s_ob,
    s_oh,
    s_od,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_OVERFLOW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge the splits of one (sequence, query head): log-sum-exp weighted sum; zeros for no
    valid token, NaN where a split's sum is NaN (a non-finite cached value) and for a sequence
    flagged in ``overflow_ptr`` (when ``HAS_OVERFLOW``)."""
    row = tl.program_id(0)
    b = row // num_q_heads
    hq = row % num_q_heads
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    wait_for_previous_kernel(PDL)

    m = tl.load(m_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + row * num_splits + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(
        acc_ptr + (row * num_splits + offs_s)[:, None] * D + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    let_next_kernel_launch(PDL)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split -> 0
    denominator = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0)
    out = tl.where(denominator == 0, 0.0, out / denominator)  # no valid token -> zeros; NaN stays NaN
    if HAS_OVERFLOW:
        out = tl.where(tl.load(overflow_ptr + b) != 0, float("nan"), out)
    tl.store(out_ptr + b * s_ob + hq * s_oh + offs_d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_WAVE_FILL = 0.95
"""Least fraction of the program slots of all waves that the split programs keep busy: a last
wave that is barely started costs almost a whole wave (``bench_attention.py --sweep-splits``: at batch 8, 576
programs on 528 slots take 408 µs, 512 programs 305 µs)."""


@functools.cache
def wave_filling_splits(slots: int, kv_programs: int, max_chunks: int) -> int:
    """The split count whose programs fill ``slots`` program slots: the most that fit in one wave if they fill
    it at least ``MIN_WAVE_FILL``, else the fewest that fill every slot in waves at least that full; at most
    one per chunk and 128. Cached per shape (the launch runs every decode step)."""
    limit = max(1, min(max_chunks, 128))
    # One wave, as many splits as fit: the fewest groups per split (more splits in one wave only
    # shorten each; fewer leave slots idle or, at ceil(groups / splits), lengthen the longest).
    one_wave = min(limit, slots // max(kv_programs, 1))
    if kv_programs and one_wave >= 1 and kv_programs * one_wave >= MIN_WAVE_FILL * slots:
        return one_wave
    for splits in range(1, limit + 1):
        programs = kv_programs * splits
        if programs >= slots and programs >= MIN_WAVE_FILL * slots * math.ceil(programs / slots):
            return splits
    return limit


def kernel_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the split kernel indexes it: any batch/head strides, the dims below
    contiguous (views sliced along the group dim, or along the token dim from a multiple of the
    key group size, qualify); copied otherwise."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[2:]), reversed(tensor.stride()[2:])):
        if size > 1 and stride != expected:
            return nonempty(tensor.contiguous())
        expected *= size
    return nonempty(tensor)


def split_and_merge(
    split_kernel,
    constants: dict,
    num_splits: int,
    overflowed: torch.Tensor | None,
    scaling: float,
    query,
    order,
    sink_keys,
    sink_values,
    sink_len,
    key_codes_high,
    key_codes_low,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    num_groups,
    residual_keys,
    residual_values,
    residual_len,
) -> torch.Tensor:
    """Run ``split_kernel`` (the Triton one of ``decode_attention``, or the Gluon one of ``decode_attention_mma``: same
    arguments) on the grid ``(B * H, num_splits)`` with ``constants`` (its constexprs and launch
    options), then the merge kernel; returns ``[B, Hq, D]``."""
    batch, q_heads, head_dim = query.shape
    heads = sink_keys.shape[1]
    capacities = (sink_keys.shape[2], key_codes_high.shape[2], residual_keys.shape[2])  # before the views: empty ones become one element
    m = query.new_empty(batch, q_heads, num_splits, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = query.new_empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32)
    out = torch.empty_like(query)
    tensors = [
        kernel_view(t)
        for t in (
            query,
            order,
            sink_keys,
            sink_values,
            key_codes_high,
            key_codes_low,
            key_scale,
            key_zero,
            value_codes,
            value_scale,
            value_zero,
            residual_keys,
            residual_values,
        )
    ]
    query, order, sink_keys, sink_values, key_codes_high, key_codes_low, key_scale, key_zero = tensors[:8]
    value_codes, value_scale, value_zero, residual_keys, residual_values = tensors[8:]
    pdl = launch_pdl(query)
    split_kernel[(batch * heads, num_splits)](
        query,
        order,
        sink_keys,
        sink_values,
        sink_len,
        key_codes_high,
        key_codes_low,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        num_groups,
        residual_keys,
        residual_values,
        residual_len,
        m,
        l,
        acc,
        scaling * math.log2(math.e),
        heads,
        num_splits,
        *capacities,
        *(stride for t in tensors for stride in t.stride()[:2]),
        PDL=pdl,
        launch_pdl=pdl,
        **constants,
    )
    merge_splits_kernel[(batch * q_heads,)](
        m,
        l,
        acc,
        out,
        m if overflowed is None else overflowed,
        q_heads,
        num_splits,
        *out.stride(),
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits),
        HAS_OVERFLOW=overflowed is not None,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return out
