"""Decode attention on the GPU: correctness first, then PN-Mix kernels vs bf16 SDPA, side by side.

    python benchmarks/bench_attention.py [--out DIR] [--quick]
    python benchmarks/bench_attention.py --sweep-mma   # the Gluon kernel's shared stages x register cap x splits
    python benchmarks/bench_attention.py --sweep-occupancy   # its register cap x split slots, batch 1 to 580
    python benchmarks/bench_attention.py --sweep-pnmix2-factors   # pnmix-2's group size and channel counts apart

1. Correctness: the Triton pack kernels against the PyTorch reference (bit-exact, fp16
   and bf16); fused decode attention against the float32 reference (relative error,
   bf16 and fp16); opcheck, torch.compile(fullgraph) and CUDA-graph replay; a tiny
   patched Llama on CUDA (kernels) against the same model on CPU (reference).
2. Timing (Qwen3-8B head shape: 32 query heads, 8 KV heads, head dim 128; one layer;
   median GPU time of CUDA-graph replays): pnmix-1, pnmix-2, kivi-2 through the op (the
   Gluon kernel on an H100/H200) and the Triton kernel side by side; bf16 SDPA
   over an uncompressed cache of the same length (GQA without copies); the PyTorch
   reference path at small sizes. For each: bytes that must be read, achieved GB/s
   and the fraction of the copy bandwidth measured in the same run.
3. Flush and pack cost at batch 32, amortized over the residual's 128 decode steps.

Writes ``bench_attention.json`` under ``--out`` (default ``benchmarks/results``) after every shape
(``"complete": false`` until the flush cost is in).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from pnmix_patch import PNMixConfig, new_cache, patch_model
from pnmix_patch.kernels.decode_attention import decode_attention, decode_attention_reference, triton_decode_attention
from pnmix_patch.kernels.pack_keys import pack_keys
from pnmix_patch.kernels.pack_values import pack_values
from pnmix_patch.reference.quantize import key_code_shape, quantize_values

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    PNMIX2_FACTORS,
    PRESETS,
    RESIDUAL,
    SINKS,
    build_cache,
    check_decode_append,
    code_commit,
    copy_bandwidth,
    identical,
    key_packing_matches,
    median_ms,
    random_order,
    report_writer,
    sdpa_ms_and_bytes,
)


def bytes_read(args) -> int:
    return sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))


def check_correctness(device) -> dict:
    result = {"pack_bit_exact": {}, "decode_relative_error": {}}
    for dtype in (torch.float16, torch.bfloat16):
        for name, config in PRESETS.items():
            num_high = config.num_high_channels(HEAD_DIM)
            group = config.key_group_size
            keys = (torch.randn(3, 4, 4 * group, HEAD_DIM, device=device) * torch.rand(HEAD_DIM, device=device) * 5).to(dtype)
            keys[0, 0, 5, 3] = float("inf")
            keys[1, 2, :, 7] = 0.5
            order = random_order(3, num_high, device, heads=4)
            values = torch.randn(3, 4, 200, HEAD_DIM, device=device).to(dtype)
            exact = key_packing_matches(config, keys, order) and all(
                identical(g, w)
                for g, w in zip(pack_values(values, 2, HEAD_DIM, True, group), quantize_values(values, 2, HEAD_DIM, True, group))
            )
            result["pack_bit_exact"][f"{name}/{dtype}"] = exact
            args = build_cache(config, 6, 2000, dtype, device, ragged=True)
            out = decode_attention(*args).float()
            ref = decode_attention_reference(*args).float()
            error = ((out - ref).norm() / ref.norm()).item()
            result["decode_relative_error"][f"{name}/{dtype}"] = error
            print(f"  {name:8s} {str(dtype):15s} pack bit-exact: {exact}   decode relative error vs fp32 reference: {error:.2e}")
    args = build_cache(PRESETS["pnmix-1"], 2, 600, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.pnmix.decode_attention.default, args)
    compiled = torch.compile(lambda *a: decode_attention(*a) * 2, fullgraph=True)
    result["compile_matches"] = bool(torch.equal(compiled(*args), decode_attention(*args) * 2))
    result["model_cuda_vs_cpu"] = check_patched_model(device)
    print(
        f"  opcheck ok; torch.compile fullgraph matches: {result['compile_matches']}; "
        f"patched model CUDA vs CPU: {result['model_cuda_vs_cpu']}"
    )
    return result


def check_patched_model(device) -> dict:
    """A tiny random Llama, patched: CUDA (Triton kernels) and CPU (reference) agree."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 700))
    logits = {}
    for where in ("cpu", device):
        model.to(where)
        patch_model(model, PNMixConfig(sink_tokens=32, residual_tokens=128, key_group_size=64))
        cache = new_cache(model)
        with torch.no_grad():
            steps = [model(ids[:, :300].to(where), cache=cache).logits[:, -1:]]
            for position in range(300, 700):
                steps.append(model(ids[:, position : position + 1].to(where), cache=cache).logits)
        logits[str(where)] = torch.cat(steps, 1).float().cpu()
    cpu, cuda = logits["cpu"], logits[str(device)]
    return {
        "max_abs_logit_difference": (cpu - cuda).abs().max().item(),
        "max_abs_logit": cpu.abs().max().item(),
        "greedy_token_agreement": (cpu.argmax(-1) == cuda.argmax(-1)).float().mean().item(),
    }


def time_shapes(device, bandwidth, shapes, reference_limit, after_shape=None) -> list[dict]:
    """The timed rows of every preset (Gluon and Triton kernels, the reference where the shape is
    small) and SDPA at each ``(batch, tokens)``; ``after_shape(rows)`` is called after each shape."""
    rows = []
    for batch, tokens in shapes:
        for name, config in PRESETS.items():
            args = build_cache(config, batch, tokens, torch.bfloat16, device)
            ms = median_ms(lambda: decode_attention(*args))
            rows.append(row("kernel", name, batch, tokens, ms, bytes_read(args[:-1]), bandwidth))
            ms = median_ms(lambda: triton_decode_attention(*args))
            rows.append(row("triton", name, batch, tokens, ms, bytes_read(args[:-1]), bandwidth))
            if batch * tokens <= reference_limit and name == "pnmix-1":
                ms = median_ms(lambda: decode_attention_reference(*args))
                rows.append(row("reference", name, batch, tokens, ms, bytes_read(args[:-1]), bandwidth))
            del args
        rows.append(row("sdpa", "bf16", batch, tokens, *sdpa_ms_and_bytes(device, batch, tokens), bandwidth))
        if after_shape is not None:
            after_shape(rows)
    return rows


def row(kind, name, batch, tokens, ms, nbytes, bandwidth) -> dict:
    achieved = nbytes / (ms * 1e-3)
    result = {
        "kind": kind,
        "method": name,
        "batch": batch,
        "context": tokens,
        "ms": ms,
        "bytes_read": nbytes,
        "GB_per_s": achieved / 1e9,
        "fraction_of_copy_bandwidth": achieved / bandwidth,
    }
    print(
        f"  {kind:9s} {name:8s} B={batch:2d} T={tokens:6d}: {ms * 1e3:9.1f} us  {nbytes / 1e6:9.1f} MB  "
        f"{achieved / 1e9:7.0f} GB/s  {achieved / bandwidth:5.1%} of copy",
        flush=True,
    )
    return result


def flush_cost(device, rows) -> list[dict]:
    """Pack one full 128-token residual per sequence at batch 32, amortized over 128 steps."""
    results = []
    for name, config in PRESETS.items():
        num_high = config.num_high_channels(HEAD_DIM)
        residual = torch.randn(32, KV_HEADS, RESIDUAL, HEAD_DIM, device=device, dtype=torch.bfloat16)
        order = random_order(32, num_high, device)
        ms = median_ms(
            lambda: (
                pack_keys(residual, order, num_high, config.key_group_size, config.key_bits_high, config.key_bits_low, True),
                pack_values(residual, 2, HEAD_DIM, True, config.key_group_size),
            )
        )
        for tokens in (16384, 32768, 65536):
            step = next(
                (r["ms"] for r in rows if r["kind"] == "kernel" and r["method"] == name and r["batch"] == 32 and r["context"] == tokens),
                None,
            )
            if step is not None:
                share = ms / RESIDUAL / step
                results.append({"method": name, "context": tokens, "flush_ms": ms, "step_ms": step, "amortized_fraction": share})
                print(
                    f"  flush {name:8s} B=32: {ms * 1e3:7.1f} us per flush = {ms / RESIDUAL * 1e3:5.2f} us per step, "
                    f"{share:.2%} of the T={tokens} attention step"
                )
    return results


def append_args(device, batch: int, tokens: int) -> list:
    """Arguments of ``pnmix::decode_append`` (pnmix-1, bf16, Qwen3-8B head shape) for ``batch``
    sequences with room for ``tokens``: the static cache's storage, sinks full, residual empty."""
    config = PRESETS["pnmix-1"]
    heads, dim, groups = KV_HEADS, HEAD_DIM, tokens // config.key_group_size

    def zeros(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, device=device, dtype=dtype)

    return [
        torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16),
        torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16),
        random_order(batch, config.num_high_channels(dim), device, heads),
        zeros(batch, heads, SINKS, dim),
        zeros(batch, heads, SINKS, dim),
        zeros(batch, dtype=torch.int32) + SINKS,
        torch.randn(batch, heads, RESIDUAL, dim, device=device, dtype=torch.bfloat16),
        zeros(batch, heads, RESIDUAL, dim),
        zeros(batch, dtype=torch.int32),
        *(
            zeros(batch, heads, *key_code_shape(groups, planes, config.key_group_size, channels), dtype=torch.int32)
            for planes, channels in config.key_code_widths(dim)
        ),
        zeros(batch, heads, groups, dim),
        zeros(batch, heads, groups, dim),
        zeros(batch, heads, groups * config.key_group_size, config.value_bits, dim // 32, dtype=torch.int32),
        zeros(batch, heads, groups * config.key_group_size, dim // config.value_group(dim)),
        zeros(batch, heads, groups * config.key_group_size, dim // config.value_group(dim)),
        zeros(batch, dtype=torch.int32),
        zeros(batch, dtype=torch.bool),
        zeros(batch, dtype=torch.int32),
        True,
    ]


def append_cost(device, batch: int, tokens: int) -> dict:
    """GPU time of the static cache's decode append (``pnmix::decode_append``, :func:`append_args`)
    for ``batch`` sequences with room for ``tokens``: idle (sinks full, residual half full, no
    flush: 127 of 128 steps) and flushing (residual full: the buffer is quantized into the next
    group, then the token appended). Each replay also resets the lengths (one or two small fills,
    timed alone and reported)."""
    from pnmix_patch.kernels.decode_append import decode_append

    args = append_args(device, batch, tokens)
    residual_len, num_groups = args[8], args[16]
    result = {"batch": batch, "context": tokens}
    for case, residual in (("idle", RESIDUAL // 2), ("flush", RESIDUAL)):

        def reset():
            residual_len.fill_(residual)
            num_groups.fill_(0)  # flushes always find room

        def append():
            decode_append(*args)
            reset()

        result[f"{case}_ms"] = median_ms(append)
        result["reset_ms"] = median_ms(reset)
        print(
            f"  decode_append B={batch:2d}, {case:5s}: {result[f'{case}_ms'] * 1e3:6.1f} us with the reset "
            f"({result['reset_ms'] * 1e3:4.1f} us alone)",
            flush=True,
        )
    return result


def sweep_launch(device) -> list[dict]:
    """Split-kernel launch options (warps, pipeline stages, split count) for pnmix-1, bf16,
    against the defaults (4 warps, ``NUM_STAGES``, ``_default_splits``), and the decode append's
    cost at the same batch (:func:`append_cost`)."""
    from pnmix_patch.kernels.decode_attention import NUM_STAGES, _default_splits

    rows = []
    config = PRESETS["pnmix-1"]
    for batch, tokens in ((1, 32768), (8, 16384), (32, 16384)):
        args = build_cache(config, batch, tokens, torch.bfloat16, device)
        chunks = args[5].shape[2] * args[5].shape[4]
        default = _default_splits(args[0], batch * KV_HEADS, chunks)
        expected = decode_attention(*args)
        for warps in (4, 8):
            for stages in (1, 2, 3):
                for splits in sorted({default, 2 * default, max(1, default // 2)}):

                    def run():
                        return triton_decode_attention(*args, num_splits=splits, num_warps=warps, num_stages=stages)

                    error = ((run().float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                    ms = median_ms(run)
                    rows.append(
                        {
                            "batch": batch,
                            "context": tokens,
                            "num_warps": warps,
                            "num_stages": stages,
                            "num_splits": splits,
                            "default": (warps, stages, splits) == (4, NUM_STAGES, default),
                            "ms": ms,
                            "max_error_vs_default": error,
                        }
                    )
                    print(
                        f"  launch B={batch:2d} T={tokens:6d} warps={warps} stages={stages} splits={splits:3d}: "
                        f"{ms * 1e3:8.1f} us  (error vs default {error:.1e})",
                        flush=True,
                    )
        del args
        rows.append(append_cost(device, batch, tokens))
    return rows


def sweep_registers(device) -> list[dict]:
    """Split-kernel register cap (``maxnreg``: more programs per multiprocessor, some spills),
    pipeline stages and split count at 4 warps, for pnmix-1, pnmix-2 and kivi-2 (bf16), with
    bf16 SDPA of the same shape timed in the same loop."""
    from pnmix_patch.kernels.decode_attention import MAX_REGISTERS, NUM_STAGES, _default_splits

    rows = []
    for batch, tokens in ((1, 4096), (1, 32768), (8, 16384), (32, 16384)):
        sdpa_ms, _ = sdpa_ms_and_bytes(device, batch, tokens)
        rows.append({"batch": batch, "context": tokens, "kernel": "bf16 SDPA", "ms": sdpa_ms})
        print(f"  B={batch:2d} T={tokens:6d} SDPA {sdpa_ms * 1e3:8.1f} us", flush=True)
        for name, config in PRESETS.items():
            args = build_cache(config, batch, tokens, torch.bfloat16, device)
            chunks = args[5].shape[2] * args[5].shape[4]
            default = _default_splits(args[0], batch * KV_HEADS, chunks)
            expected = decode_attention(*args)
            for registers in (None, 168, 128):
                for stages in (1, 3):
                    for splits in sorted({default, min(2 * default, chunks), min(4 * default, chunks)}):

                        def run():
                            return triton_decode_attention(*args, num_splits=splits, num_stages=stages, max_registers=registers)

                        error = ((run().float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                        ms = median_ms(run)
                        rows.append(
                            {
                                "batch": batch,
                                "context": tokens,
                                "kernel": name,
                                "max_registers": registers,
                                "num_stages": stages,
                                "num_splits": splits,
                                "default": (registers, stages, splits) == (MAX_REGISTERS, NUM_STAGES, default),
                                "ms": ms,
                                "speed_vs_sdpa": sdpa_ms / ms,
                                "max_error_vs_default": error,
                            }
                        )
                        print(
                            f"  B={batch:2d} T={tokens:6d} {name:8s} maxnreg={registers} stages={stages} "
                            f"splits={splits:3d}: {ms * 1e3:8.1f} us = {sdpa_ms / ms:.2f}x SDPA "
                            f"(error vs default {error:.1e})",
                            flush=True,
                        )
            del args
    return rows


def sweep_splits(device) -> list[dict]:
    """Split count of the split kernel at its default launch options (pnmix-1, bf16): how the
    number of programs, and so the number of waves over the device's program slots, sets the time."""
    from pnmix_patch.kernels.decode_attention import _default_splits

    rows = []
    candidates = {
        1: (16, 33, 48, 66, 99, 132),
        8: (5, 8, 9, 12, 16, 20, 24, 33, 40, 66),
        32: (1, 2, 3, 4, 5, 6, 8, 12, 16),
        64: (1, 2, 3, 4, 6, 8),
    }
    for batch, tokens in ((1, 32768), (8, 16384), (32, 16384), (64, 16384)):
        args = build_cache(PRESETS["pnmix-1"], batch, tokens, torch.bfloat16, device)
        default = _default_splits(args[0], batch * KV_HEADS, args[5].shape[2] * args[5].shape[4])
        for splits in sorted({*candidates[batch], default}):
            ms = median_ms(lambda: triton_decode_attention(*args, num_splits=splits))
            rows.append(
                {
                    "batch": batch,
                    "context": tokens,
                    "num_splits": splits,
                    "programs": batch * KV_HEADS * splits,
                    "default": splits == default,
                    "ms": ms,
                }
            )
            print(
                f"  splits B={batch:2d} T={tokens:6d} splits={splits:3d} programs={batch * KV_HEADS * splits:5d}: "
                f"{ms * 1e3:8.1f} us" + ("  (default)" if splits == default else ""),
                flush=True,
            )
        del args
    return rows


def sweep_mma(device) -> list[dict]:
    """Register cap x split count x shared stages (``stages - 1`` stages of key groups in flight) of
    the Gluon split kernel, pnmix-1 and pnmix-2 (bf16), the default flagged."""
    from pnmix_patch.kernels.decode_attention_mma import MAX_REGISTERS, STAGES, default_splits, mma_decode_attention

    rows = []
    candidates = {1: (16, 22, 33, 44, 66), 8: (4, 6, 8, 12, 16), 32: (1, 2, 3, 4), 64: (1, 2, 4)}
    for preset, (batch, tokens) in itertools.product(("pnmix-2", "pnmix-1"), ((1, 32768), (8, 16384), (32, 16384), (64, 16384))):
        args = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, device)
        default = default_splits(args[0], batch * KV_HEADS, args[5].shape[2], 32 * args[5].shape[4])
        for stages in (2, 3, 4):
            for registers in (None, 128):
                for splits in sorted({*candidates[batch], default}):
                    ms = median_ms(lambda: mma_decode_attention(*args, num_splits=splits, max_registers=registers, stages=stages))
                    flag = splits == default and registers == MAX_REGISTERS and stages == STAGES
                    rows.append(
                        {
                            "preset": preset,
                            "batch": batch,
                            "context": tokens,
                            "stages": stages,
                            "max_registers": registers,
                            "num_splits": splits,
                            "default": flag,
                            "ms": ms,
                        }
                    )
                    print(
                        f"  mma {preset} B={batch:2d} T={tokens:6d} stages={stages} registers={registers} splits={splits:3d}: "
                        f"{ms * 1e3:8.1f} us" + ("  (default)" if flag else ""),
                        flush=True,
                    )
        del args
    return rows


def sweep_pnmix2_factors(device) -> list[dict]:
    """The op's time (bf16) for :data:`PNMIX2_FACTORS` beside bf16 SDPA at 32K tokens, batch 32, 8 and 1."""
    rows = []
    for batch, tokens in ((32, 32768), (8, 32768), (1, 32768)):
        sdpa_ms, _ = sdpa_ms_and_bytes(device, batch, tokens)
        for name, config in PNMIX2_FACTORS.items():
            args = build_cache(config, batch, tokens, torch.bfloat16, device)
            ms = median_ms(lambda: decode_attention(*args))
            rows.append({"batch": batch, "context": tokens, "config": name, "ms": ms, "speed_vs_sdpa": sdpa_ms / ms})
            print(f"  B={batch:2d} T={tokens:6d} {name:16s} {ms * 1e3:8.1f} us = {sdpa_ms / ms:.2f}x SDPA", flush=True)
            del args
    return rows


def sweep_occupancy(device) -> list[dict]:
    """Register cap (programs resident per multiprocessor) x the slot count the split rule fills, for
    pnmix-1 and pnmix-2 (bf16) at small and serving-size batches; a split count reached by two slot
    counts is timed once; the launch default (``default_splits``, ``MAX_REGISTERS``) flagged."""
    from pnmix_patch.kernels.common import multiprocessors, wave_filling_splits
    from pnmix_patch.kernels.decode_attention_mma import MAX_REGISTERS, default_splits, mma_decode_attention

    rows = []
    sms = multiprocessors(device.index or 0)
    for preset in ("pnmix-1", "pnmix-2"):
        for batch, tokens in ((1, 32768), (8, 16384), (32, 16384), (32, 32768), (64, 16384), (580, 8192)):
            args = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, device)
            default = default_splits(args[0], batch * KV_HEADS, args[5].shape[2], 32 * args[5].shape[4])
            for registers in (None, 168, 160, 128, 96):
                timed = set()  # split counts already timed at this cap: two slot counts can give the same one
                for per_sm in (2, 3, 4):
                    splits = wave_filling_splits(per_sm * sms, batch * KV_HEADS, args[5].shape[2])
                    if splits in timed:
                        continue
                    timed.add(splits)
                    ms = median_ms(lambda: mma_decode_attention(*args, num_splits=splits, max_registers=registers))
                    flag = splits == default and registers == MAX_REGISTERS
                    rows.append(
                        {
                            "preset": preset,
                            "batch": batch,
                            "context": tokens,
                            "max_registers": registers,
                            "programs_per_sm_assumed": per_sm,
                            "num_splits": splits,
                            "default": flag,
                            "ms": ms,
                        }
                    )
                    print(
                        f"  {preset} B={batch:3d} T={tokens:6d} registers={registers} slots={per_sm}/SM splits={splits:3d}: "
                        f"{ms * 1e3:8.1f} us" + ("  (default)" if flag else ""),
                        flush=True,
                    )
            del args
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep-launch", action="store_true", help="only the split kernel's launch-option sweep")
    parser.add_argument("--append-only", action="store_true", help="only the decode append's cost (and its bit-exactness)")
    parser.add_argument("--sweep-registers", action="store_true", help="only the split kernel's register-cap sweep")
    parser.add_argument("--sweep-splits", action="store_true", help="only the split kernel's split-count sweep")
    parser.add_argument(
        "--sweep-mma",
        action="store_true",
        help="only the Gluon kernel's stages-in-flight, register-cap and split sweep, pnmix-1 and pnmix-2",
    )
    parser.add_argument("--sweep-pnmix2-factors", action="store_true", help="only pnmix-2's group size and channel counts apart")
    parser.add_argument(
        "--sweep-occupancy",
        action="store_true",
        help="only the Gluon kernel's register cap x split slots, pnmix-1 and pnmix-2, batch 1 to 580",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.append_only:
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "commit": code_commit(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "command": "python benchmarks/bench_attention.py --append-only",
            "bit_exact": check_decode_append(device),
            "rows": [append_cost(device, batch, tokens) for batch, tokens in ((1, 32768), (8, 16384), (32, 16384))],
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_attention_append.json").write_text(json.dumps(report, indent=2))
        return
    sweeps = (
        ("sweep_registers", sweep_registers, "register"),
        ("sweep_splits", sweep_splits, "split"),
        ("sweep_mma", sweep_mma, "mma"),
        ("sweep_occupancy", sweep_occupancy, "occupancy"),
        ("sweep_pnmix2_factors", sweep_pnmix2_factors, "pnmix2_factors"),
    )
    for flag, sweep, name in sweeps:
        if getattr(args, flag):
            rows = sweep(device)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            report = {
                "date": time.strftime("%Y-%m-%d"),
                "commit": code_commit(),
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "command": f"python benchmarks/bench_attention.py --{flag.replace('_', '-')}",
                "rows": rows,
            }
            (Path(args.out) / f"bench_attention_{name}_sweep.json").write_text(json.dumps(report, indent=2))
            return
    if args.sweep_launch:
        rows = sweep_launch(device)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "command": "python benchmarks/bench_attention.py --sweep-launch",
            "rows": rows,
        }
        (Path(args.out) / "bench_attention_launch_sweep.json").write_text(json.dumps(report, indent=2))
        return
    write = report_writer(args.out, "bench_attention.json", "benchmarks/bench_attention.py")
    print("correctness", flush=True)
    correctness = check_correctness(device)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    batches, contexts = ((1, 32), (4096, 32768)) if args.quick else ((1, 8, 32, 64), (4096, 16384, 32768, 65536))

    def save(timings: list[dict], flush: list[dict] = (), complete: bool = False) -> None:
        write(complete, copy_bandwidth_GB_per_s=bandwidth / 1e9, correctness=correctness, timings=timings, flush=list(flush))

    rows = time_shapes(device, bandwidth, [(b, t) for b in batches for t in contexts], reference_limit=8 * 16384, after_shape=save)
    save(rows, flush_cost(device, rows), complete=True)


if __name__ == "__main__":
    main()
