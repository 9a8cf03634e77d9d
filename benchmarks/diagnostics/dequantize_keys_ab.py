"""``dequantize_keys`` (the CPU reference's key reading) against an earlier copy of ``quantize.py``, side by side (CPU).

    git show COMMIT:pnmix_patch/quantize.py > /tmp/baseline_quantize.py
    python benchmarks/diagnostics/dequantize_keys_ab.py --baseline /tmp/baseline_quantize.py [--contexts 1024 16384] [--out DIR]

One sequence, one layer of Qwen3-8B's KV heads (8, head dim 128), float32, 128-token groups,
pnmix-1 and kivi-2 widths: the same keys quantized by each module into its own format, checked to
read back the same, then each module's ``dequantize_keys`` timed taking turns (median of
``--repeats``). Writes ``dequantize_keys_ab.json`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pnmix_patch import quantize as current

WIDTHS = {"pnmix-1": (64, 3, 1), "kivi-2": (128, 2, 2)}  # selected channels, b_H, b_L


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a copy of pnmix_patch/quantize.py")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("baseline_quantize", args.baseline)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for preset, (num_high, bits_high, bits_low) in WIDTHS.items():
        for tokens in args.contexts:
            keys = torch.randn(1, 8, tokens, 128, generator=generator)
            mask = torch.rand(1, 8, 128, generator=generator).argsort(-1) < num_high
            packed = {name: module.quantize_keys(keys, mask, num_high, 128, bits_high, bits_low, True)
                      for name, module in (("baseline", baseline), ("current", current))}  # fmt: skip
            if not torch.equal(baseline.dequantize_keys(*packed["baseline"], mask), current.dequantize_keys(*packed["current"], mask)):
                raise SystemExit(f"{preset} at {tokens} tokens: the two modules read different keys")
            times = {"baseline": [], "current": []}
            for _ in range(args.repeats):
                for name, module in (("baseline", baseline), ("current", current)):
                    start = time.perf_counter()
                    module.dequantize_keys(*packed[name], mask)
                    times[name].append(time.perf_counter() - start)
            row = {"preset": preset, "context": tokens, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}}
            row["current_over_baseline"] = row["current_ms"] / row["baseline_ms"]
            rows.append(row)
            print(f"  {preset} T={tokens:6d}: baseline {row['baseline_ms']:7.1f} ms, current {row['current_ms']:7.1f} ms "
                  f"({row['current_over_baseline']:.2f}x)", flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "torch": torch.__version__,
              "command": " ".join(["python benchmarks/diagnostics/dequantize_keys_ab.py"] + sys.argv[1:]), "rows": rows}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "dequantize_keys_ab.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
