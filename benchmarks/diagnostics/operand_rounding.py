"""How the Gluon decode kernel's 8-bit query operands round the key scores, three ways (CPU, no GPU).

    python benchmarks/diagnostics/operand_rounding.py [--trials 200]

An emulation of the arithmetic only (not the kernel): pnmix-1's key layout (64 channels of 3
bits, 64 of 1 bit, one 128-token group quantized by min-max per channel), a random query, and the
scores ``codes @ (q * scale)`` made from operands split into two 8-bit parts (``round(y)`` and
``round(128 (y - round(y)))``, 15 significant bits) with one scale per query head:

- per plane (the tenth session's kernel): plane p's operand is ``2^p y``, the scale set by the
  largest ``|q * scale| * 2^(b - 1)``;
- one operand, planes by Horner's scheme with a common plane 0 (``ef98a1e``): the scale set by the
  largest ``|q * scale|``, which the 1-bit channels' larger scales dominate;
- one operand, the tiles' top planes aligned (``top_aligned_planes.patch`` beside this file, run on
  the H200 and not adopted, see RESULTS): a tile of fewer planes enters the scheme late and its
  operand is ``q * scale * 2^-shift``.

Prints the mean relative error of the scores against float64 for each.
"""

import argparse

import torch


def split_rounded(y: torch.Tensor) -> torch.Tensor:
    """``y`` as its two 8-bit parts carry it: ``round(y) + round(128 (y - round(y))) / 128``."""
    high = torch.round(y)
    return high + torch.round(128 * (y - high)) / 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    bits = torch.tensor([3] * 64 + [1] * 64)
    weight = 2.0 ** -(bits.max() - bits).double()  # top-aligned: 2^-shift per channel's tile
    errors = {"per plane": [], "one operand, common plane 0": [], "one operand, top planes aligned": []}
    for _ in range(args.trials):
        keys = torch.randn(128, 128, dtype=torch.float64) * (1 + 3 * torch.rand(128, dtype=torch.float64))
        low, high = keys.min(0).values, keys.max(0).values
        scale = (high - low) / (2**bits - 1)
        codes = torch.minimum(torch.round((keys - low) / scale), (2**bits - 1).double())
        x = torch.randn(128, dtype=torch.float64) * scale
        exact = codes @ x
        peak = (x.abs() * 2.0 ** (bits - 1)).max()
        per_plane = sum(((codes.long() >> p) & 1).double() @ split_rounded(2**p * x * 127 / peak) for p in range(3)) * peak / 127
        peak = x.abs().max()
        common = codes @ split_rounded(x * 127 / peak) * peak / 127
        peak = (x * weight).abs().max()
        aligned = codes @ (split_rounded(x * weight * 127 / peak) / weight) * peak / 127
        for name, scores in zip(errors, (per_plane, common, aligned)):
            errors[name].append(float((scores - exact).norm() / exact.norm()))
    for name, values in errors.items():
        print(f"{name:34s} mean relative error of the scores {sum(values) / len(values):.2e}")


if __name__ == "__main__":
    main()
