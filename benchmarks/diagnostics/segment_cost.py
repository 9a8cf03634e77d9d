"""What each segment of the cache adds to a Gluon decode-attention call: the call with segments emptied (GPU).

    python benchmarks/diagnostics/segment_cost.py [--baseline FILE ...] [--shapes B,T ...] [--out DIR]

For pnmix-1 (Qwen3-8B heads, bf16, ``bench_attention.py``'s caches: 32 sinks, packed groups, a full
128-token residual) at batch 32 / 16K, 32 / 32K, 8 / 16K and 1 / 32K (``--shapes``): the median time (CUDA-graph replays) of
the current kernel, and of each ``--baseline`` (a copy of ``kernels/decode_attention_mma.py`` reading
today's cache format, loaded as ``kernel_ab.py`` does; named by its file name) beside it, with every segment, then with the residual's, the sinks', both
and the packed groups' lengths set to zero, and with all three at zero (launches, merge kernel and
prologue only). The per-sequence lengths are device tensors, so one cache and one split count
serve every case. Writes ``segment_cost.json`` under ``--out`` (default ``benchmarks/results``) after every
timing (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import PRESETS, build_cache, median_ms, report_writer  # noqa: E402
from kernel_ab import load_baseline  # noqa: E402

from pnmix_patch.kernels import decode_attention_mma as current  # noqa: E402

SHAPES = [(32, 16384), (32, 32768), (8, 16384), (1, 32768)]
SINK_LEN, GROUPS, RESIDUAL_LEN = 4, 12, 15  # argument positions of the per-sequence lengths
CASES = {
    "all": (), "no residual": (RESIDUAL_LEN,), "no sinks": (SINK_LEN,), "no sinks or residual": (SINK_LEN, RESIDUAL_LEN),
    "no groups": (GROUPS,), "nothing": (SINK_LEN, GROUPS, RESIDUAL_LEN),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", action="append", default=[], help="a copy of kernels/decode_attention_mma.py (repeatable)")
    parser.add_argument("--shapes", nargs="+", type=lambda text: tuple(map(int, text.split(","))), default=SHAPES,
                        metavar="B,T", help="batch and context pairs (default: %(default)s)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args()
    kernels = {"current": current} | {Path(path).stem: load_baseline(path, Path(path).stem) for path in args.baseline}
    device = torch.device("cuda")
    torch.manual_seed(0)
    write = report_writer(args.out, "segment_cost.json", "benchmarks/diagnostics/segment_cost.py")
    rows = []
    for batch, tokens in args.shapes:
        cache = build_cache(PRESETS["pnmix-1"], batch, tokens, torch.bfloat16, device)
        full = {index: cache[index].clone() for index in (SINK_LEN, GROUPS, RESIDUAL_LEN)}
        for name, module in kernels.items():
            arguments = list(cache)
            for case, emptied in CASES.items():
                for index, lengths in full.items():
                    arguments[index].copy_(torch.zeros_like(lengths) if index in emptied else lengths)
                ms = median_ms(lambda: module.mma_decode_attention(*arguments))
                rows.append({"kernel": name, "batch": batch, "context": tokens, "case": case, "ms": ms})
                write(timings=rows)
                print(f"  {name:20s} B={batch:2d} T={tokens:6d} {case:22s} {ms * 1e3:8.1f} us", flush=True)
        del cache
    write(complete=True, timings=rows)


if __name__ == "__main__":
    main()
