"""Decode attention of chosen presets beside bf16 SDPA at chosen shapes: the quick A/B of a kernel change.

``bench_attention.py`` times the full matrix (every preset, the Triton kernel, copy bandwidth, flush
cost, correctness checks) in about four minutes of GPU time; this script times only what it is asked,
in the same way (one layer of the Qwen3-8B head shape, ``common.build_cache``, median of CUDA-graph
replays, bf16 SDPA over an uncompressed cache of the same length in the same process), after two
checks per preset: the CUDA key packer against the PyTorch reference (bit-identical) and the Gluon
kernel's output against the float32 reference at batch 4 / 4K (relative error). It times the Gluon
kernel (``mma_decode_attention``, what the op runs on these shapes).

``--kernels`` also times other versions of ``kernels/decode_attention_mma.py`` (files, e.g. from
``git show BRANCH:kernels/decode_attention_mma.py``) in the same process, on the same inputs, one after
the other at each shape: each is checked against the reference like the package's own, and each row
gives its time as a ratio to the package kernel's.

Usage::

    python benchmarks/bench_attention_presets.py [--presets pnmix-2 pnmix-1] [--shapes 32:32768 8:32768]
        [--kernels OTHER.py ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from common import HEAD_DIM, KV_HEADS, build_cache, key_packing_matches, median_ms, random_order, report_writer, sdpa_ms_and_bytes

from pnmix_patch.config import PRESETS
from pnmix_patch.kernels import decode_attention_mma
from pnmix_patch.kernels.decode_attention import decode_attention_reference


def load_kernel(path: str, index: int):
    """A version of ``kernels/decode_attention_mma.py`` at ``path``, imported as module ``index`` of the
    kernels package beside the package's own (its relative imports resolve there)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--kernels: no file {path!r}")
    name = f"{decode_attention_mma.__package__}._timed_version_{index}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "mma_decode_attention", None)):
        raise ValueError(f"--kernels: {path!r} has no mma_decode_attention")
    return module


def check(name: str, device: torch.device, kernels: dict) -> dict:
    """The preset's CUDA key packing against the reference, and each Gluon kernel against the float32 reference."""
    config = PRESETS[name]
    keys = torch.randn(2, KV_HEADS, 4 * config.key_group_size, HEAD_DIM, dtype=torch.bfloat16, device=device)
    pack_identical = key_packing_matches(config, keys, random_order(2, config.num_high_channels(HEAD_DIM), device))
    args = build_cache(config, 4, 4096, torch.bfloat16, device)
    reference = decode_attention_reference(*args).float()
    errors = {
        label: ((module.mma_decode_attention(*args).float() - reference).abs().max() / reference.abs().max()).item()
        for label, module in kernels.items()
    }
    return dict(preset=name, pack_identical=pack_identical, relative_error=errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["pnmix-2", "pnmix-1"])
    parser.add_argument("--shapes", nargs="+", default=["32:16384", "32:32768", "32:65536", "8:32768"], help="batch:context")
    parser.add_argument("--kernels", nargs="+", default=[], metavar="FILE", help="other versions of the Gluon kernel's file to time")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    shapes = []
    for shape in args.shapes:
        batch, _, context = shape.partition(":")
        if not (batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
            parser.error(f"--shapes takes batch:context with positive integers, got {shape!r}")
        shapes.append((int(batch), int(context)))
    try:
        kernels = {"package": decode_attention_mma} | {path: load_kernel(path, i) for i, path in enumerate(args.kernels)}
    except (OSError, ValueError) as error:
        parser.error(str(error))
    device = torch.device("cuda")
    torch.manual_seed(0)
    write = report_writer(args.out, "bench_attention_presets.json", "benchmarks/bench_attention_presets.py")
    checks = [check(name, device, kernels) for name in args.presets]
    for row in checks:
        errors = ", ".join(f"{label} {error:.2e}" for label, error in row["relative_error"].items())
        print(f"{row['preset']}: CUDA packing identical {row['pack_identical']}, relative error {errors}", flush=True)
    timings = []
    for batch, context in shapes:
        sdpa, _ = sdpa_ms_and_bytes(device, batch, context)
        for name in args.presets:
            inputs = build_cache(PRESETS[name], batch, context, torch.bfloat16, device)
            times = {label: median_ms(lambda: module.mma_decode_attention(*inputs)) for label, module in kernels.items()}
            del inputs
            for label, ms in times.items():
                ratio = ms / times["package"]
                timings.append(
                    dict(
                        preset=name,
                        batch=batch,
                        context=context,
                        kernel=label,
                        us=ms * 1e3,
                        sdpa_us=sdpa * 1e3,
                        sdpa_ratio=sdpa / ms,
                        package_ratio=ratio,
                    )
                )
                versus = "" if label == "package" else f", {ratio:.3f}x the package kernel's time"
                print(
                    f"batch {batch:3d} context {context:6d} {name:8s} {label}: {ms * 1e3:8.1f} us, SDPA {sdpa * 1e3:8.1f} us: "
                    f"{sdpa / ms:.2f}x{versus}",
                    flush=True,
                )
            write(False, checks=checks, timings=timings)
    write(True, checks=checks, timings=timings)


if __name__ == "__main__":
    main()
