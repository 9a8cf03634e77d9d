"""The ``pnmix::`` custom ops: schema, fake tensors and dispatch checks, CPU = reference."""

import pytest
import torch
from kernel_cases import LAYOUTS, decode_inputs, mask_of, num_high, random_order, seeded

from pnmix_patch.kernels.decode_attention import decode_attention, decode_attention_reference
from pnmix_patch.kernels.pack_keys import pack_keys
from pnmix_patch.kernels.pack_values import pack_values
from pnmix_patch.reference.quantize import quantize_keys, quantize_values


@pytest.mark.parametrize("layout", ["pnmix-2", "kivi-2", "r0"])
def test_pack_keys_op(layout):
    generator = seeded()
    _, group, bits_high, bits_low = LAYOUTS[layout]
    high = num_high(layout, 64)
    keys = torch.randn(2, 2, 2 * group, 64, generator=generator, dtype=torch.float16)
    order = random_order(2, 2, 64, high, generator)
    args = (keys, order, high, group, bits_high, bits_low, True)
    torch.library.opcheck(torch.ops.pnmix.pack_keys.default, args)
    want = quantize_keys(keys, mask_of(order, high), high, group, bits_high, bits_low, True)
    for got, expected in zip(pack_keys(*args), want):
        assert torch.equal(got, expected)


def test_pack_values_op():
    generator = seeded()
    values = torch.randn(2, 2, 40, 64, generator=generator, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pnmix.pack_values.default, (values, 2, 64, True, 32))
    for got, expected in zip(pack_values(values, 2, 64, True, 32), quantize_values(values, 2, 64, True, 32)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_attention_op(dtype):
    generator = seeded()
    args = decode_inputs(generator, "pnmix-1", 64, 4, dtype, sink_len=[5, 0], num_groups=[1, 0], residual_len=[3, 0], garbage=0.0)
    torch.library.opcheck(torch.ops.pnmix.decode_attention.default, args)
    assert torch.equal(decode_attention(*args), decode_attention_reference(*args))
    torch.library.opcheck(torch.ops.pnmix.decode_attention.default, (*args, torch.tensor([False, False])))  # (NaN != NaN)
    flagged = decode_attention(*args, torch.tensor([True, False]))
    assert flagged[0].isnan().all() and torch.equal(flagged[1], decode_attention(*args)[1])
