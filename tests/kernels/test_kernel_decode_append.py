"""Static-cache decode append (interpreted Triton: in-place flush + append) vs the PyTorch reference."""

import pytest
import torch
from kernel_cases import LAYOUTS, num_high, random_order, seeded

from pnmix_patch.kernels.decode_append import decode_append, decode_append_reference, triton_decode_append
from pnmix_patch.quantize import scale_dtype_for

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
        randn(batch, HEADS, head_dim), randn(batch, HEADS, head_dim),  # the new token's key and value
        random_order(batch, HEADS, head_dim, high, generator),
        randn(batch, HEADS, sink_cap, head_dim), randn(batch, HEADS, sink_cap, head_dim),
        torch.tensor(sink_len, dtype=torch.int32),
        randn(batch, HEADS, residual_cap, head_dim) * (1 + 3 * torch.rand(head_dim, generator=generator)).to(dtype),
        randn(batch, HEADS, residual_cap, head_dim),
        torch.tensor(residual_len, dtype=torch.int32),
        codes(batch, HEADS, group_cap, bits_high, words, high),
        codes(batch, HEADS, group_cap, bits_low, words, head_dim - high),
        randn(batch, HEADS, group_cap, head_dim, dtype=scale_dtype), randn(batch, HEADS, group_cap, head_dim, dtype=scale_dtype),
        codes(batch, HEADS, group_cap * group, 2, head_dim // 32),
        randn(batch, HEADS, group_cap * group, 1, dtype=scale_dtype), randn(batch, HEADS, group_cap * group, 1, dtype=scale_dtype),
        torch.tensor(num_groups, dtype=torch.int32),
        torch.tensor([False, True] + [False] * (batch - 2)),  # overflowed: a set flag stays set
        torch.zeros(batch, dtype=torch.int32),  # arrivals: zero before and after a step
        True,
    ]  # fmt: skip


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
        seeded(), layout, 64, dtype,
        sink_len=[5, 8, 8, 8, 8, 8, 8],
        residual_len=[0, 17, residual_cap - 1, residual_cap, residual_cap, residual_cap, 0],
        num_groups=[0, per_flush, 0, per_flush, 2 * per_flush, group_cap, per_flush],
        sink_cap=8, residual_cap=residual_cap, group_cap=group_cap,
    )  # fmt: skip
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
        seeded(), "pnmix-1", 64, torch.float16, sink_len=[0, 0], residual_len=[128, 3], num_groups=[0, 1],
        sink_cap=0, residual_cap=128, group_cap=2,
    )  # fmt: skip
    check(no_sinks)
    assert no_sinks[8].tolist() == [1, 4] and no_sinks[16].tolist() == [1, 1]
    unquantized = static_state(
        seeded(), "pnmix-1", 64, torch.float32, sink_len=[4, 4], residual_len=[160, 9], num_groups=[0, 0],
        sink_cap=4, residual_cap=160, group_cap=0,
    )  # fmt: skip
    check(unquantized)
    assert unquantized[8].tolist() == [160, 10] and unquantized[17].tolist() == [True, True]


def test_decode_append_op():
    args = static_state(
        seeded(), "pnmix-2", 64, torch.float16, sink_len=[3, 8], residual_len=[0, 128], num_groups=[0, 2],
        sink_cap=8, residual_cap=128, group_cap=4,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.pnmix.decode_append.default, args)
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    decode_append_reference(*expected)
    decode_append(*args)
    assert all(torch.equal(a, b) for a, b in zip(args, expected) if isinstance(a, torch.Tensor))
