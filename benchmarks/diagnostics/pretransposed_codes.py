"""What the Gluon decode kernel would gain from codes stored in its operand order (GPU; a bound for issue 3).

    python benchmarks/diagnostics/pretransposed_codes.py [--out DIR]

The kernel copies each key group's codes into shared memory, byte-transposes them there into the
words its 8-bit MMA operands are made of (``TRANSPOSE_ASM``), and reads those. A cache that stored
the transposed words would skip the transposes. ``pretransposed_codes.patch`` is that kernel: it
reads the staged words as operands (three shared stages instead of two plus the transposed
buffers: the same shared memory), every other instruction as before. This script applies the patch
to a copy of ``kernels/decode_attention_mma.py`` (``git apply`` in a temporary folder), feeds it
caches converted to that order on the host (:func:`transpose_key_quads`,
:func:`transpose_value_groups`), and, side by side in one process (CUDA-graph replays):

- checks that its outputs equal the current kernel's bit for bit (same MMA operands, same
  arithmetic), ragged and full shapes;
- times the current kernel, the patched one, and the patched one with ``COPY_CODES = False``: no
  code is copied at all, the kernel computing on whatever shared memory holds. That last time is a
  floor for any change to how the codes reach shared memory (a format, a copy scheme): what is left
  is the operand reads and the arithmetic.

Qwen3-8B heads, bf16, the presets and cache builder of ``bench_attention.py``. Writes
``pretransposed_codes.json`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_attention import KV_HEADS, PRESETS, build_cache, median_ms  # noqa: E402
from kernel_ab import load_baseline, relative_error  # noqa: E402

from pnmix_patch.kernels import decode_attention_mma as current  # noqa: E402
from pnmix_patch.kernels.decode_attention import decode_attention_reference  # noqa: E402

KERNEL = HERE.parents[1] / "kernels" / "decode_attention_mma.py"
SHAPES = {"pnmix-1": [(1, 32768), (8, 16384), (32, 16384), (32, 32768), (32, 65536), (64, 16384)],
          "pnmix-2": [(32, 32768)], "kivi-2": [(32, 32768)]}  # fmt: skip
CHECK_SHAPES = [(8, 4096), (3, 5000)]


def transpose_key_quads(codes: torch.Tensor) -> torch.Tensor:
    """Key words ``[..., C]`` (word c: 32 tokens of stored channel c, byte b: tokens 8b .. 8b + 7)
    with each quad of channels byte-transposed: word 4q + b holds byte b of channels 4q .. 4q + 3
    (byte i: channel 4q + i), the words ``TRANSPOSE_ASM`` makes. Needs ``C % 4 == 0``."""
    if codes.shape[-1] % 4:
        raise ValueError(f"key channels per tensor must be a multiple of 4 to transpose by quads, got {codes.shape[-1]}")
    if codes.numel() == 0:  # kivi-2's empty tensor of other channels
        return codes
    quads = codes.contiguous().view(torch.uint8).unflatten(-1, (codes.shape[-1] // 4, 4, 4))  # [..., q, i, b]
    return quads.transpose(-1, -2).contiguous().flatten(-3).view(torch.int32)


def transpose_value_groups(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Value words ``[B, H, T, b_V, D / 32]`` with each key group's ``G`` tokens rearranged into the
    order the kernel reads: ``[b_V * D / 32 * 4, G / 4]`` words, row 4 * column + b, column tq: byte b
    of word column ``column`` (plane p, channels 32w ..) of tokens 4tq .. 4tq + 3 (byte i: token 4tq + i)."""
    batch, heads, tokens, bits, words = codes.shape
    u8 = codes.contiguous().view(torch.uint8).reshape(batch, heads, tokens // group_size, group_size // 4, 4, bits * words, 4)
    return u8.permute(0, 1, 2, 5, 6, 3, 4).contiguous().view(torch.int32).reshape(batch, heads, tokens, bits, words)


def pretransposed(cache: tuple) -> tuple:
    """``cache`` (``build_cache``'s arguments) with its key and value codes in the patched kernel's order."""
    cache = list(cache)
    cache[5], cache[6] = transpose_key_quads(cache[5]), transpose_key_quads(cache[6])
    cache[9] = transpose_value_groups(cache[9], 32 * cache[5].shape[4])
    return tuple(cache)


def patched_kernel(patch: Path, folder: str):
    """The current kernel file with ``patch`` applied, loaded as a module of ``pnmix_patch.kernels``."""
    (Path(folder) / "kernels").mkdir()
    shutil.copy(KERNEL, Path(folder) / "kernels" / KERNEL.name)
    subprocess.run(["git", "apply", str(patch)], cwd=folder, check=True)
    return load_baseline(str(Path(folder) / "kernels" / KERNEL.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", default=str(HERE / "pretransposed_codes.patch"))
    parser.add_argument("--out", default=str(HERE.parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    started = time.time()
    folder = tempfile.TemporaryDirectory()  # kept until the end: Triton reads the kernel's source file
    variant = patched_kernel(Path(args.patch), folder.name)
    checks, rows = [], []
    for dtype in (torch.bfloat16, torch.float16):
        for preset, config in PRESETS.items():
            for batch, tokens in CHECK_SHAPES:
                cache = build_cache(config, batch, tokens, dtype, device, ragged=True)
                got, want = variant.mma_decode_attention(*pretransposed(cache)), current.mma_decode_attention(*cache)
                check = {"preset": preset, "dtype": str(dtype), "batch": batch, "context": tokens, "ragged": True,
                         "identical": bool(torch.equal(got, want)),
                         "error_vs_reference": relative_error(got, decode_attention_reference(*cache))}  # fmt: skip
                checks.append(check)
                print(f"  check {preset} {dtype} B={batch} T={tokens}: identical={check['identical']} "
                      f"error {check['error_vs_reference']:.2e}", flush=True)
    for preset, shapes in SHAPES.items():
        for batch, tokens in shapes:
            cache = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, device)
            converted = pretransposed(cache)
            identical = bool(torch.equal(variant.mma_decode_attention(*converted), current.mma_decode_attention(*cache)))
            row = {"preset": preset, "batch": batch, "context": tokens, "identical": identical,
                   "current_ms": median_ms(lambda: current.mma_decode_attention(*cache)),
                   "pretransposed_ms": median_ms(lambda: variant.mma_decode_attention(*converted))}  # fmt: skip
            variant.COPY_CODES = False
            variant.kernel_constants.cache_clear()
            row["no_code_copies_ms"] = median_ms(lambda: variant.mma_decode_attention(*converted))
            variant.COPY_CODES = True
            variant.kernel_constants.cache_clear()
            row["pretransposed_speedup"] = row["current_ms"] / row["pretransposed_ms"]
            row["no_code_copies_speedup"] = row["current_ms"] / row["no_code_copies_ms"]
            rows.append(row)
            print(f"  {preset} B={batch:3d} T={tokens:6d}: current {row['current_ms'] * 1e3:8.1f} us, pretransposed "
                  f"{row['pretransposed_ms'] * 1e3:8.1f} ({row['pretransposed_speedup']:.2f}x, identical={identical}), "
                  f"no code copies {row['no_code_copies_ms'] * 1e3:8.1f} ({row['no_code_copies_speedup']:.2f}x)", flush=True)
            del cache, converted
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "seconds": round(time.time() - started, 1),
              "command": " ".join(["python benchmarks/diagnostics/pretransposed_codes.py"] + sys.argv[1:]),
              "kv_heads": KV_HEADS, "checks": checks, "timings": rows}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "pretransposed_codes.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
