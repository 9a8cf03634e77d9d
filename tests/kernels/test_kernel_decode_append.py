"""Static-cache decode append (interpreted Triton: in-place flush + append) vs the PyTorch reference."""

import pytest
import torch
from kernel_cases import LAYOUTS, num_high, random_order, seeded

from pnmix_patch.kernels.decode_append import (
    decode_append,
    decode_append_reference,
    decode_rotate_append,
    rotate_half_reference,
    triton_decode_append,
)
from pnmix_patch.reference.quantize import scale_dtype_for

# The interpreter evaluates masked-off lanes with numpy, which warns about inf - inf or 1 / 0.
pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")

HEADS = 2


def static_state(generator, layout, head_dim, dtype, sink_len, residual_len, num_groups, sink_cap, residual_cap, group_cap):
    """Random arguments of ``decode_append``: every slot holds random data, lengths as given."""
    _, group, bits_high, bits_low = LAYOUTS[layout]
    batch, high, words = len(sink_len), num_high(layout, head_dim), group // 32
    scale_dtype = scale_dtype_for(dtype)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=generator).to(dtype)

    def codes(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)

    return [
        randn(batch, HEADS, head_dim),
        randn(batch, HEADS, head_dim),  # the new token's key and value
        random_order(batch, HEADS, head_dim, high, generator),
        randn(batch, HEADS, sink_cap, head_dim),
        randn(batch, HEADS, sink_cap, head_dim),
        torch.tensor(sink_len, dtype=torch.int32),
        randn(batch, HEADS, residual_cap, head_dim) * (1 + 3 * torch.rand(head_dim, generator=generator)).to(dtype),
        randn(batch, HEADS, residual_cap, head_dim),
        torch.tensor(residual_len, dtype=torch.int32),
        codes(batch, HEADS, group_cap, bits_high - bits_low, words, high),
        codes(batch, HEADS, group_cap, bits_low, words, head_dim),
        randn(batch, HEADS, group_cap, head_dim, dtype=scale_dtype),
        randn(batch, HEADS, group_cap, head_dim, dtype=scale_dtype),
        codes(batch, HEADS, group_cap * group, 2, head_dim // 32),
        randn(batch, HEADS, group_cap * group, 1, dtype=scale_dtype),
        randn(batch, HEADS, group_cap * group, 1, dtype=scale_dtype),
        torch.tensor(num_groups, dtype=torch.int32),
        torch.tensor([False, True] + [False] * (batch - 2)),  # overflowed: a set flag stays set
        torch.zeros(batch, dtype=torch.int32),  # arrivals: zero before and after a step
        True,
    ]


def check(args):
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    decode_append_reference(*expected)
    triton_decode_append(*args)
    for index, (got, want) in enumerate(zip(args, expected)):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want), f"argument {index} differs"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_append_and_flush_match_reference(layout, dtype):
    """One sequence per case: sink slot, residual slot, last residual slot, flush, flush into
    the last free groups, full storage (overflow), empty residual."""
    group = LAYOUTS[layout][1]
    residual_cap = 128
    per_flush = residual_cap // group
    group_cap = 3 * per_flush
    args = static_state(
        seeded(),
        layout,
        64,
        dtype,
        sink_len=[5, 8, 8, 8, 8, 8, 8],
        residual_len=[0, 17, residual_cap - 1, residual_cap, residual_cap, residual_cap, 0],
        num_groups=[0, per_flush, 0, per_flush, 2 * per_flush, group_cap, per_flush],
        sink_cap=8,
        residual_cap=residual_cap,
        group_cap=group_cap,
    )
    check(args)
    sink_len, residual_len, num_groups, overflowed = args[5], args[8], args[16], args[17]
    assert sink_len.tolist() == [6] + [8] * 6
    assert residual_len.tolist() == [0, 18, residual_cap, 1, 1, residual_cap, 1]
    assert num_groups.tolist() == [0, per_flush, 0, 2 * per_flush, 3 * per_flush, group_cap, per_flush]
    assert overflowed.tolist() == [False, True, False, False, False, True, False]


def test_no_sinks_and_no_packed_storage():
    """``sink_tokens=0`` (the token goes straight to the residual) and an fp16-preset cache
    (no groups: a full residual overflows instead of flushing)."""
    no_sinks = static_state(
        seeded(),
        "pnmix-1",
        64,
        torch.float16,
        sink_len=[0, 0],
        residual_len=[128, 3],
        num_groups=[0, 1],
        sink_cap=0,
        residual_cap=128,
        group_cap=2,
    )
    check(no_sinks)
    assert no_sinks[8].tolist() == [1, 4] and no_sinks[16].tolist() == [1, 1]
    unquantized = static_state(
        seeded(),
        "pnmix-1",
        64,
        torch.float32,
        sink_len=[4, 4],
        residual_len=[160, 9],
        num_groups=[0, 0],
        sink_cap=4,
        residual_cap=160,
        group_cap=0,
    )
    check(unquantized)
    assert unquantized[8].tolist() == [160, 10] and unquantized[17].tolist() == [True, True]


def test_value_codes_not_contiguous_below_the_head_are_refused():
    """The flush writes a group's value words by offset (operand order): strided codes would be
    written wrong, so the launch refuses them, naming the strides."""
    args = static_state(
        seeded(),
        "pnmix-1",
        64,
        torch.float16,
        sink_len=[4],
        residual_len=[3],
        num_groups=[0],
        sink_cap=4,
        residual_cap=128,
        group_cap=2,
    )
    args[13] = args[13].transpose(3, 4).contiguous().transpose(3, 4)  # value codes [.., tokens, planes, words], planes innermost
    with pytest.raises(ValueError, match=r"value_codes must be contiguous below the head dim.*strides"):
        triton_decode_append(*args)


def test_decode_append_op():
    args = static_state(
        seeded(),
        "pnmix-2",
        64,
        torch.float16,
        sink_len=[3, 8],
        residual_len=[0, 128],
        num_groups=[0, 2],
        sink_cap=8,
        residual_cap=128,
        group_cap=4,
    )
    torch.library.opcheck(torch.ops.pnmix.decode_append.default, args)
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    decode_append_reference(*expected)
    decode_append(*args)
    assert all(torch.equal(a, b) for a, b in zip(args, expected) if isinstance(a, torch.Tensor))


def rotation_inputs(generator, batch, query_heads, heads, head_dim, dtype, norms, shared_position, eps=1e-6):
    """Query ``[B, Hq, D]``, cos/sin ``[B or 1, 1, D]`` (a real table: cos^2 + sin^2 = 1), norm weights, ``eps``."""
    angles = torch.rand(1 if shared_position else batch, 1, head_dim // 2, generator=generator) * 100
    angles = torch.cat((angles, angles), -1)
    weights = [(1 + torch.randn(head_dim, generator=generator) / 4).to(dtype) for _ in range(2)] if norms else [None, None]
    return (
        torch.randn(batch, query_heads, head_dim, generator=generator).to(dtype) * 3,
        angles.cos().to(dtype),
        angles.sin().to(dtype),
        *weights,
        eps,
    )


def check_rotated(args, rotation, tolerance):
    """The kernel (interpreted) against the reference: rotated queries and the appended key within
    ``tolerance`` (0: equal; float32 norms' sums of squares may add in another order), every other tensor
    exactly."""
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    query, key = rotate_half_reference(rotation[0], expected[0], *rotation[1:])
    decode_append_reference(key, *expected[1:])
    got = triton_decode_append(*args, rotation=rotation)
    torch.testing.assert_close(got, query, atol=tolerance, rtol=tolerance)
    assert tolerance or torch.equal(got, query)
    for index, (got, want) in enumerate(zip(args, expected)):
        if index in (3, 6):  # sinks and residual keys: where the rotated key lands
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
            assert tolerance or torch.equal(got, want)
        elif isinstance(got, torch.Tensor) and index > 0:
            assert torch.equal(got, want), f"argument {index} differs"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("ratio, head_dim, shared_position", [(1, 64, False), (4, 64, True), (7, 32, False)])
def test_rotate_and_append_match_reference(dtype, norms, ratio, head_dim, shared_position):
    """``decode_rotate_append``'s kernel: q/k norms (or none) and RoPE of the query heads of each KV head
    (GQA ratios 1, 4 and 7: a padded block of rows) and of the key, then the append: into a sink, into
    the residual, and after a flush. Bit for bit in fp16 and without norms (every rounding of the
    reference is repeated); float32 norms within 1e-6. ``eps`` = 0.5, so that it matters."""
    generator = seeded()
    args = static_state(
        generator,
        "pnmix-1",
        head_dim,
        dtype,
        sink_len=[5, 8, 8],
        residual_len=[0, 17, 128],
        num_groups=[0, 1, 1],
        sink_cap=8,
        residual_cap=128,
        group_cap=3,
    )
    rotation = rotation_inputs(generator, 3, ratio * HEADS, HEADS, head_dim, dtype, norms, shared_position, eps=0.5)
    check_rotated(args, rotation, 1e-6 if norms and dtype == torch.float32 else 0)
    assert args[8].tolist() == [0, 18, 1] and args[16].tolist() == [0, 1, 2]


def test_rotation_reference_is_transformers_arithmetic():
    """:func:`rotate_half_reference` gives, bit for bit, what Qwen3's ``q_norm``/``k_norm`` modules and
    transformers' ``apply_rotary_pos_emb`` give (the code the fused kernel stands in for)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    generator = seeded()
    for dtype in (torch.float32, torch.bfloat16):
        query, cos, sin, query_weight, key_weight, eps = rotation_inputs(generator, 2, 8, 2, 64, dtype, True, False, eps=0.5)
        key = torch.randn(2, 2, 64, generator=generator).to(dtype)
        q_norm, k_norm = Qwen3RMSNorm(64, eps).to(dtype), Qwen3RMSNorm(64, eps).to(dtype)
        q_norm.weight.data, k_norm.weight.data = query_weight, key_weight
        with torch.no_grad():
            want = apply_rotary_pos_emb(q_norm(query[:, :, None]), k_norm(key[:, :, None]), cos, sin)
        got = rotate_half_reference(query, key, cos, sin, query_weight, key_weight, eps)
        assert all(torch.equal(g, w[:, :, 0]) for g, w in zip(got, want))


def test_decode_rotate_append_op_and_its_errors():
    generator = seeded()
    args = static_state(
        generator,
        "pnmix-2",
        64,
        torch.float16,
        sink_len=[3, 8],
        residual_len=[0, 128],
        num_groups=[0, 2],
        sink_cap=8,
        residual_cap=128,
        group_cap=4,
    )
    query, cos, sin, query_weight, key_weight, eps = rotation_inputs(generator, 2, 8, HEADS, 64, torch.float16, True, False)
    call = [query, args[0], args[1], cos, sin, query_weight, key_weight, eps, *args[2:]]
    torch.library.opcheck(torch.ops.pnmix.decode_rotate_append.default, call)
    with pytest.raises(ValueError, match="give both"):
        decode_rotate_append(*call[:6], None, *call[7:])
    with pytest.raises(ValueError, match=r"cos must be \[B, 1, D\] or \[1, 1, D\] with B=2, D=64; got \[2, 64\]"):
        decode_rotate_append(*call[:3], cos[:, 0], *call[4:])
    with pytest.raises(ValueError, match=r"Hq a multiple of H.*got \[2, 7, 64\]"):
        decode_rotate_append(query[:, :7], *call[1:])
    with pytest.raises(ValueError, match=r"cos is torch.float32 on cpu; the query is torch.float16 on cpu"):
        decode_rotate_append(*call[:3], cos.float(), *call[4:])
    with pytest.raises(ValueError, match=r"key_norm_weight must be \[D\] = \[64\]; got \[32\]"):
        decode_rotate_append(*call[:6], key_weight[:32], *call[7:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("norms", [True, False])
def test_rotate_and_append_on_cuda_in_bf16(norms):
    """The compiled kernel in bf16, head dim 128 and 4 query heads per KV head (Qwen3-8B's and Llama-3.1-8B's),
    against the reference, one sequence per append case."""
    generator = seeded()
    args = static_state(
        generator,
        "pnmix-1",
        128,
        torch.bfloat16,
        sink_len=[5, 8, 8],
        residual_len=[0, 17, 128],
        num_groups=[0, 1, 1],
        sink_cap=8,
        residual_cap=128,
        group_cap=3,
    )
    rotation = rotation_inputs(generator, 3, 4 * HEADS, HEADS, 128, torch.bfloat16, norms, False)
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    query, key = rotate_half_reference(rotation[0], expected[0], *rotation[1:])
    decode_append_reference(key, *expected[1:])
    on_device = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = triton_decode_append(*on_device, rotation=[r.cuda() if isinstance(r, torch.Tensor) else r for r in rotation])
    # The norm's float32 sum and square root may round otherwise than the CPU's, and a product one float32
    # ulp apart may round to the next bf16 value: a few bf16 ulps apart at most.
    torch.testing.assert_close(got.cpu(), query, atol=2e-2, rtol=2e-2)
    for index, (got, want) in enumerate(zip(on_device, expected)):
        if index in (3, 6):
            torch.testing.assert_close(got.cpu(), want, atol=2e-2, rtol=2e-2)
        elif isinstance(got, torch.Tensor) and index > 0:
            assert torch.equal(got.cpu(), want), f"argument {index} differs"
