"""Cases and random inputs shared by the kernel tests.

The tests run the Triton launchers in Triton's CPU interpreter: ``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` before anything imports the kernels. The interpreter
cannot do bf16 arithmetic, so the tests use fp16 and fp32, and it costs about a
millisecond per program, so shapes stay small.
"""

from __future__ import annotations

import torch

from pnmix_patch.reference.quantize import channel_order, quantize_keys, quantize_values

# name: (pair ratio r, G, b_H, b_L); "r0" selects no pair (C_hi = 0).
LAYOUTS = {
    "pnmix-1": (0.5, 128, 3, 1),
    "pnmix-2": (0.4, 64, 3, 1),
    "kivi-2": (1.0, 128, 2, 2),
    "r0": (0.0, 64, 3, 1),
}
WIDE_LAYOUTS = {
    "4-2": (0.25, 128, 4, 2),  # Kitty's widths
    "8-4": (0.5, 32, 8, 4),  # the widest codes, shortest group
    "g256": (0.5, 256, 3, 1),  # pnmix-1's widths, groups of two 128-token steps
    "4-4": (1.0, 128, 4, 4),  # every channel at 4 bits: the largest integer key sums
    "r25": (0.25, 128, 3, 1),  # pnmix-1's widths, 32 of 128 channels selected: a key tile of 2-bit fields and a plane
    "r40": (0.4, 128, 3, 1),  # pnmix-2's channels (52 of 128: a compacted last chunk) in 128-token groups
}


def seeded(seed: int = 1234) -> torch.Generator:
    """A seeded generator: every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(seed)


def num_high(layout: str, head_dim: int) -> int:
    """Channels of selected pairs: ``2 * round(r * D / 2)`` as in ``PNMixConfig``."""
    return 2 * round({**LAYOUTS, **WIDE_LAYOUTS}[layout][0] * head_dim / 2)


def random_order(batch: int, heads: int, head_dim: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """``channel_order`` of a random mask with ``high`` selected channels per head."""
    mask = torch.rand(batch, heads, head_dim, generator=generator).argsort(-1) < high
    return channel_order(mask)


def mask_of(order: torch.Tensor, high: int) -> torch.Tensor:
    return torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :high], True)


def decode_inputs(
    generator: torch.Generator,
    layout: str,
    head_dim: int,
    ratio: int,
    dtype: torch.dtype,
    sink_len: list[int],
    num_groups: list[int],
    residual_len: list[int],
    heads: int = 2,
    sink_cap: int = 32,
    group_cap: int = 3,
    residual_cap: int = 128,
    garbage: float = float("nan"),
    value_group: int | None = None,
    value_bits: int = 2,
) -> tuple:
    """Random arguments of ``decode_attention`` for a cache with the given per-sequence lengths
    (values quantized to ``value_bits``, one group per ``value_group`` channels, default the head).

    Slots past each sequence's lengths hold ``garbage`` (NaN by default): a kernel that
    reads them would return NaN.
    """
    _, group, bits_high, bits_low = {**LAYOUTS, **WIDE_LAYOUTS}[layout]
    batch, high = len(sink_len), num_high(layout, head_dim)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    order = random_order(batch, heads, head_dim, high, generator)
    keys = randn(batch, heads, group_cap * group, head_dim) * (1 + 3 * torch.rand(head_dim, generator=generator))
    values = randn(batch, heads, group_cap * group, head_dim)
    packed_keys = quantize_keys(keys.to(dtype), mask_of(order, high), high, group, bits_high, bits_low, True)
    packed_values = quantize_values(values.to(dtype), value_bits, value_group or head_dim, True, group)
    lengths = [torch.tensor(x, dtype=torch.int32) for x in (sink_len, num_groups, residual_len)]
    for tensor in packed_keys[2:]:  # key scale/zero of unused groups
        for b, n in enumerate(num_groups):
            tensor[b, :, n:] = garbage
    for tensor in packed_values[1:]:  # value scale/zero of unused tokens
        for b, n in enumerate(num_groups):
            tensor[b, :, n * group :] = garbage

    def dense(capacity, valid):
        tensor = randn(batch, heads, capacity, head_dim).to(dtype)
        for b, n in enumerate(valid):
            tensor[b, :, n:] = garbage
        return tensor

    query = randn(batch, heads * ratio, head_dim).to(dtype)
    return (
        query,
        order,
        dense(sink_cap, sink_len),
        dense(sink_cap, sink_len),
        lengths[0],
        *packed_keys,
        *packed_values,
        lengths[1],
        dense(residual_cap, residual_len),
        dense(residual_cap, residual_len),
        lengths[2],
        head_dim**-0.5,
    )
