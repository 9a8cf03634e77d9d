"""Decode attention on the CPU: the PyTorch reference path a patched model runs there, per layer and step.

    python benchmarks/bench_cpu_reference.py [--contexts 1024 4096 16384] [--threads N] [--tag TAG] [--out DIR]

On a CPU the decode-attention op runs its reference (``decode_attention_reference``): every step it
dequantizes the whole packed cache to float32 (``dequantize_keys``, ``dequantize_values``) and
attends over it. This times the op and those two parts, one sequence, one layer of the Qwen3-8B head
shape (32 query heads, 8 KV heads, head dim 128), float32, for each preset and context (median of
``--repeats`` calls after one untimed call). Writes ``bench_cpu_reference[_TAG].json`` under
``--out`` (default ``benchmarks/results``) with the package path it imported, so that runs of two
checkouts (``PYTHONPATH=<other checkout>``) can be told apart.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import PRESETS, build_cache
from tqdm.auto import tqdm

import pnmix_patch
from pnmix_patch.kernels.decode_attention import decode_attention
from pnmix_patch.reference.quantize import dequantize_keys, dequantize_values


def median_ms(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_preset(name: str, context: int, repeats: int) -> dict:
    config = PRESETS[name]
    args = build_cache(config, 1, context, torch.float32, "cpu")
    (_, order, _, _, _, codes_high, codes_low, key_scale, key_zero, value_codes, value_scale, value_zero, *_) = args
    num_high = codes_high.shape[-1]
    channel_mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
    group = config.key_group_size
    return {
        "method": name,
        "context": context,
        "op_ms": median_ms(lambda: decode_attention(*args), repeats),
        "dequantize_keys_ms": median_ms(lambda: dequantize_keys(codes_high, codes_low, key_scale, key_zero, channel_mask), repeats),
        "dequantize_values_ms": median_ms(lambda: dequantize_values(value_codes, value_scale, value_zero, group), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error(f"--threads and --repeats must be at least 1, got {args.threads} and {args.repeats}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, context in tqdm([(n, c) for n in args.presets for c in args.contexts], desc="presets x contexts"):
        rows.append(time_preset(name, context, args.repeats))
        print(
            f"  {name:8s} {context:6d} tokens: op {rows[-1]['op_ms']:8.1f} ms, keys {rows[-1]['dequantize_keys_ms']:8.1f} ms, "
            f"values {rows[-1]['dequantize_values_ms']:8.1f} ms"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "package": str(Path(pnmix_patch.__file__).parent),
        "torch": torch.__version__,
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "threads": args.threads,
        "command": "python " + " ".join(sys.argv),
        "rows": rows,
    }
    out = Path(args.out) / f"bench_cpu_reference{'_' + args.tag if args.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
