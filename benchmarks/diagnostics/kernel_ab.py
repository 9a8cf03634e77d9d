"""The Gluon decode-attention kernel against an earlier copy of it, side by side in one process (GPU).

    git show COMMIT:kernels/decode_attention_mma.py > /tmp/baseline_mma.py
    python benchmarks/diagnostics/kernel_ab.py --baseline /tmp/baseline_mma.py [--plain-baseline | --plane-values-baseline
        | --byte-quad-keys-baseline | --plane-keys-baseline] [--shapes PRESET:B,T ...] [--slots N ...] [--sdpa] [--out DIR]

The copy is loaded as a module of ``pnmix_patch.kernels`` (its relative imports resolve there),
so it runs with today's Triton kernel helpers and merge kernel. For each preset and shape of
``bench_attention.py`` (Qwen3-8B heads, bf16, caches packed by the kernels): the relative error
of both against the float32 reference (small shapes), then the median time of each (CUDA-graph
replays) at its own default split count, and of the current kernel at split counts filling 2, 3
and 4 programs per multiprocessor (``--slots``; the occupancy its registers allow may have changed).
``--shapes`` times other shapes than ``SHAPES``; ``--sdpa`` also times bf16 SDPA over an
uncompressed cache at each shape and the copy bandwidth, as ``bench_attention.py`` does, for the
ratios and the fraction of copy bandwidth of both kernels. With
``--variants``, also the current kernel's launch variants of ``VARIANTS`` (shared stages,
register cap, split slots per multiprocessor; ``--variant-configs`` names others) on the shapes of
``VARIANT_SHAPES`` (``--variant-presets`` picks presets). Writes ``kernel_ab.json`` under
``--out`` (default ``benchmarks/results``) after every row (``"complete": false`` until the end).

The caches are in today's packed order. A baseline from before ``52e7023`` (when the cache's words
were stored plain, not in operand order, ``pnmix_patch/quantize.py``) reads them wrong: give
``--plain-baseline`` and it gets the same caches with plain words (:func:`plain_codes`). The
meaning of a variant's stages changed there too: since then ``stages - 1`` groups' copies are in
flight (one stage is read), before ``stages`` (the words were transposed into another buffer).
A baseline from before the value codes were stored as 2-bit fields (the commit that added
``--plane-values-baseline``) reads value bit planes in operand order: give that option
(:func:`plane_values`). A baseline from before the keys' thread-owned words (the commit that added
``--byte-quad-keys-baseline``) reads every key codes tensor as runs of four channels'
words byte-transposed: give that option (:func:`byte_quad_keys`). A baseline from before the keys'
pairs of planes were stored as 2-bit fields (the commit that added ``--plane-keys-baseline``) reads
thread-owned key words as planes: give that option (:func:`plane_keys`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import (  # noqa: E402
    KV_HEADS, PRESETS, build_cache, bytes_read, copy_bandwidth, median_ms, report_writer, sdpa_ms_and_bytes,
)

from pnmix_patch.kernels import decode_attention_mma as current  # noqa: E402
from pnmix_patch.kernels.decode_attention import _multiprocessors, _wave_filling_splits, decode_attention_reference  # noqa: E402
from pnmix_patch import quantize  # noqa: E402
from pnmix_patch.quantize import keys_from_operand_order, values_from_operand_order  # noqa: E402

SHAPES = {"pnmix-1": [(1, 32768), (8, 16384), (32, 16384), (32, 32768), (64, 16384), (580, 8192)],
          "pnmix-2": [(1, 32768), (32, 32768), (64, 16384)], "kivi-2": [(1, 32768), (32, 32768)]}  # fmt: skip
ERROR_SHAPES = [(8, 4096)]
# (stages, max registers, slots per SM). 96 registers fit five programs per SM; with the twelfth session's
# kernel that build took 790 instructions per group, 4 of them spills, against 779 and none at 128 (python
# benchmarks/kernel_sass.py --presets pnmix-1 --gluon-registers 128 96, Triton 3.6) and was slower at every
# shape (benchmarks/results/kernel_ab_registers96.json). The thirteenth session's kernel at 96 registers: 663
# instructions per group and no spills in the packed loop, against 657 at 128 (same command); timed in the
# fourteenth session (kernel_ab_registers96_adjacent.json, when VARIANT_SHAPES had pnmix-1's shapes and
# pnmix-2 at batch 32 / 32K only; kernel_ab_registers96_kivi2.json, kernel_ab_registers96_pnmix2.json).
VARIANTS = [(3, None, 3), (2, None, 3), (2, 128, 4), (3, 128, 4), (2, 160, 3), (2, 96, 5)]
VARIANT_SHAPES = {"pnmix-1": [(1, 32768), (8, 16384), (32, 32768), (580, 8192)],
                  "pnmix-2": [(1, 32768), (8, 16384), (32, 16384), (32, 32768), (64, 16384)],
                  "kivi-2": [(1, 32768), (32, 32768)]}  # fmt: skip


def launch_variant(text: str) -> tuple[int, int | None, int]:
    """``STAGES,REGISTERS,SLOTS`` (REGISTERS may be ``none``: the compiler's choice) as a VARIANTS entry."""
    parts = text.split(",")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[2].isdigit() and (parts[1].isdigit() or parts[1] == "none")):
        raise argparse.ArgumentTypeError(f"a launch variant is STAGES,REGISTERS,SLOTS (REGISTERS a number or none); got {text!r}")
    return int(parts[0]), None if parts[1] == "none" else int(parts[1]), int(parts[2])


def load_baseline(path: str, name: str = "baseline_decode_attention_mma"):
    """A copy of ``kernels/decode_attention_mma.py`` loaded as module ``name`` of ``pnmix_patch.kernels``."""
    spec = importlib.util.spec_from_file_location(f"pnmix_patch.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def plain_codes(cache: tuple) -> tuple:
    """``build_cache``'s arguments with the key and value words in plain order (the packed layout
    before ``52e7023``), for a baseline kernel from before then."""
    cache = list(cache)
    cache[5], cache[6] = keys_from_operand_order(cache[5]), keys_from_operand_order(cache[6])
    cache[9] = values_from_operand_order(cache[9], 32 * cache[5].shape[4])
    return tuple(cache)


def plane_values(cache: tuple) -> tuple:
    """``build_cache``'s arguments with the value words as bit planes in operand order (no 2-bit
    fields: the packed layout before ``--plane-values-baseline`` was added; the keys in the byte-quad
    order of then, :func:`byte_quad_keys`), for a baseline kernel from before then."""
    cache = list(byte_quad_keys(cache))
    group_size = 32 * cache[5].shape[4]
    converted = torch.empty_like(cache[9])
    with mock.patch.object(quantize, "planes_to_fields", lambda words: words):
        for sequence, codes in enumerate(cache[9]):  # one sequence at a time: the conversion's int64 temporaries
            converted[sequence] = quantize.values_to_operand_order(values_from_operand_order(codes, group_size), group_size)
    cache[9] = converted
    return tuple(cache)


def byte_quad_keys(cache: tuple) -> tuple:
    """``build_cache``'s arguments with every key codes tensor's words as runs of four channels
    byte-transposed (the packed layout before the keys' thread-owned words), for a baseline kernel
    from before them (``--byte-quad-keys-baseline``)."""
    cache = list(cache)
    for index in (5, 6):
        converted = torch.empty_like(cache[index])
        for sequence, codes in enumerate(cache[index]):  # one sequence at a time: the conversion's temporaries
            converted[sequence] = quantize.transpose_byte_quads(keys_from_operand_order(codes), -1)
        cache[index] = converted
    return tuple(cache)


def plane_keys(cache: tuple) -> tuple:
    """``build_cache``'s arguments with thread-owned key codes tensors' pairs of planes as plane words
    (the packed layout before ``--plane-keys-baseline`` was added), for a baseline kernel from before
    the keys' 2-bit fields."""
    cache = list(cache)
    for index in (5, 6):
        if quantize.thread_owned_keys(32 * cache[index].shape[4], cache[index].shape[5]):
            converted = torch.empty_like(cache[index])
            for sequence, codes in enumerate(cache[index]):  # one sequence at a time: the conversion's temporaries
                converted[sequence] = quantize.key_fields_to_planes(codes)
            cache[index] = converted
    return tuple(cache)


def shape_option(text: str) -> tuple[str, int, int]:
    """``PRESET:B,T`` as ``(preset, batch, context)``."""
    preset, _, shape = text.partition(":")
    parts = shape.split(",")
    if preset not in PRESETS or len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is PRESET:BATCH,CONTEXT with PRESET one of {sorted(PRESETS)}; got {text!r}")
    return preset, int(parts[0]), int(parts[1])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a copy of kernels/decode_attention_mma.py")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    baseline_format = parser.add_mutually_exclusive_group()
    baseline_format.add_argument("--plain-baseline", action="store_true", help="the baseline reads plain words (a kernel from before 52e7023)")
    baseline_format.add_argument("--plane-values-baseline", action="store_true",
                                 help="the baseline reads value bit planes (a kernel from before the 2-bit value fields)")
    baseline_format.add_argument("--byte-quad-keys-baseline", action="store_true",
                                 help="the baseline reads key words as runs of four channels byte-transposed "
                                      "(a kernel from before the keys' thread-owned words)")
    baseline_format.add_argument("--plane-keys-baseline", action="store_true",
                                 help="the baseline reads thread-owned key words as planes (a kernel from before the keys' 2-bit fields)")
    parser.add_argument("--shapes", nargs="+", type=shape_option, metavar="PRESET:B,T", help="the shapes to time instead of SHAPES")
    parser.add_argument("--slots", nargs="*", type=int, default=[2, 3, 4],
                        help="program slots per multiprocessor to time the current kernel's split counts at (default 2 3 4; none: skip)")
    parser.add_argument("--sdpa", action="store_true", help="also time bf16 SDPA at each shape, and the copy bandwidth")
    parser.add_argument("--variants", action="store_true", help="also time the current kernel's launch variants")
    parser.add_argument("--skip-ab", action="store_true", help="only the variants (and the errors)")
    parser.add_argument("--variant-presets", nargs="+", choices=list(VARIANT_SHAPES),
                        help="with --variants: the presets whose VARIANT_SHAPES to time (default: all)")
    parser.add_argument("--variant-configs", nargs="+", type=launch_variant, metavar="STAGES,REGISTERS,SLOTS",
                        help="with --variants: launch variants to time instead of VARIANTS (REGISTERS: a number or none)")
    args = parser.parse_args()
    if not args.variants and (args.variant_presets or args.variant_configs):
        parser.error("--variant-presets and --variant-configs need --variants")
    baseline = load_baseline(args.baseline)
    for_baseline = (plain_codes if args.plain_baseline else plane_values if args.plane_values_baseline
                    else byte_quad_keys if args.byte_quad_keys_baseline else plane_keys if args.plane_keys_baseline
                    else (lambda cache: cache))  # fmt: skip
    device = torch.device("cuda")
    torch.manual_seed(0)
    write = report_writer(args.out, "kernel_ab.json", "benchmarks/diagnostics/kernel_ab.py")
    sms = _multiprocessors(device.index or 0)
    bandwidth = copy_bandwidth(device) if args.sdpa else None
    errors, rows, variants = [], [], []

    def save(complete: bool = False) -> None:
        write(complete, copy_bandwidth_GB_per_s=bandwidth / 1e9 if bandwidth else None,
              errors=errors, timings=rows, variants=variants)

    if bandwidth:
        print(f"  copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    shapes = {}
    for preset, batch, tokens in args.shapes or [(p, b, t) for p, pairs in SHAPES.items() for b, t in pairs]:
        shapes.setdefault(preset, []).append((batch, tokens))
    for dtype in (torch.bfloat16, torch.float16):
        for preset, config in PRESETS.items():
            for batch, tokens in ERROR_SHAPES:
                cache = build_cache(config, batch, tokens, dtype, device, ragged=True)
                want = decode_attention_reference(*cache)
                error = {"preset": preset, "dtype": str(dtype), "batch": batch, "context": tokens,
                         "baseline": relative_error(baseline.mma_decode_attention(*for_baseline(cache)), want),
                         "current": relative_error(current.mma_decode_attention(*cache), want)}  # fmt: skip
                errors.append(error)
                save()
                print(f"  error {preset} {dtype}: baseline {error['baseline']:.2e}  current {error['current']:.2e}", flush=True)
    sdpa = {}
    for preset, pairs in ({} if args.skip_ab else shapes).items():
        for batch, tokens in pairs:
            cache = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, device)
            baseline_cache = for_baseline(cache)
            groups, group_size = cache[5].shape[2], 32 * cache[5].shape[4]
            row = {"preset": preset, "batch": batch, "context": tokens,
                   "baseline_splits": baseline.default_splits(cache[0], batch * KV_HEADS, groups, group_size),
                   "current_splits": current.default_splits(cache[0], batch * KV_HEADS, groups, group_size),
                   "baseline_ms": median_ms(lambda: baseline.mma_decode_attention(*baseline_cache)),
                   "current_ms": median_ms(lambda: current.mma_decode_attention(*cache)), "current_by_slots": {}}  # fmt: skip
            for per_sm in args.slots:
                splits = _wave_filling_splits(per_sm * sms, batch * KV_HEADS, groups)
                row["current_by_slots"][per_sm] = {
                    "splits": splits, "ms": median_ms(lambda: current.mma_decode_attention(*cache, num_splits=splits))}
            row["speedup"] = row["baseline_ms"] / row["current_ms"]
            slots = "  ".join(f"{k}/SM ({v['splits']}): {v['ms'] * 1e3:.1f}" for k, v in row["current_by_slots"].items())
            print(f"  {preset} B={batch:3d} T={tokens:6d}: baseline {row['baseline_ms'] * 1e3:8.1f} us, current "
                  f"{row['current_ms'] * 1e3:8.1f} us ({row['speedup']:.2f}x)   current at {slots}", flush=True)
            if bandwidth:
                row["bytes_read"] = bytes_read(cache[:-1])
                if (batch, tokens) not in sdpa:
                    sdpa[batch, tokens] = sdpa_ms_and_bytes(device, batch, tokens)
                row["sdpa_ms"], row["sdpa_bytes_read"] = sdpa[batch, tokens]
                for kernel in ("baseline", "current"):
                    row[f"sdpa_over_{kernel}"] = row["sdpa_ms"] / row[f"{kernel}_ms"]
                    row[f"{kernel}_fraction_of_copy"] = row["bytes_read"] / (row[f"{kernel}_ms"] * 1e-3) / bandwidth
                print(f"    SDPA {row['sdpa_ms'] * 1e3:8.1f} us: {row['sdpa_over_baseline']:.2f}x baseline, "
                      f"{row['sdpa_over_current']:.2f}x current; of copy {row['baseline_fraction_of_copy']:.1%} baseline, "
                      f"{row['current_fraction_of_copy']:.1%} current", flush=True)
            rows.append(row)
            save()
            del cache, baseline_cache
    configs = args.variant_configs or VARIANTS
    for preset in (args.variant_presets or list(VARIANT_SHAPES)) if args.variants else ():
        for batch, tokens in VARIANT_SHAPES[preset]:
            cache = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, device)
            groups = cache[5].shape[2]
            baseline_cache = for_baseline(cache)
            ms = median_ms(lambda: baseline.mma_decode_attention(*baseline_cache))
            variants.append({"preset": preset, "batch": batch, "context": tokens, "kernel": "baseline", "ms": ms})
            save()
            print(f"  {preset} B={batch:3d} T={tokens:6d} baseline (its defaults): {ms * 1e3:8.1f} us", flush=True)
            for stages, registers, per_sm in configs:
                splits = _wave_filling_splits(per_sm * sms, batch * KV_HEADS, groups)
                ms = median_ms(lambda: current.mma_decode_attention(*cache, num_splits=splits, max_registers=registers, stages=stages))
                variants.append({"preset": preset, "batch": batch, "context": tokens, "stages": stages, "max_registers": registers,
                                 "slots_per_sm": per_sm, "splits": splits, "ms": ms})  # fmt: skip
                save()
                print(f"  {preset} B={batch:3d} T={tokens:6d} stages={stages} registers={registers} slots={per_sm}/SM "
                      f"splits={splits:3d}: {ms * 1e3:8.1f} us", flush=True)
            del cache
    save(complete=True)


if __name__ == "__main__":
    main()
