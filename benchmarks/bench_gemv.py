"""One-token linear products on the GPU: ``pnmix::gemv`` (and its fused forms) vs cuBLAS, side by side.

    python benchmarks/bench_gemv.py [--model qwen3-8b] [--model llama-3.1-8b] [--out DIR]

For every weight of one decoder layer of each model shape (bf16, random) and its LM head, one token's
product timed as ``patch_gemv`` runs it and as an unpatched model runs it (``F.linear``, cuBLAS):

- ``q/k/v``: ``pnmix::gemv_stacked`` (one launch) vs three ``F.linear`` calls;
- ``o``, ``down`` and ``lm_head``: ``pnmix::gemv`` vs ``F.linear``;
- ``gate/up + SiLU``: ``pnmix::gemv_swiglu`` (one launch) vs two ``F.linear`` calls and ``silu * up``.

Each path's result is also compared with the float32 product (relative error, in the report). Times are medians of
CUDA-graph replays (several launches in one graph time as they run inside a captured step); GB/s
counts the weights' bytes, and the fraction is of the copy bandwidth measured in the same run.
Writes ``bench_gemv.json`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from pnmix_patch.kernels.gemv import gemv, gemv_stacked
from pnmix_patch.kernels.gemv_swiglu import gemv_swiglu
from pnmix_patch.planner import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, median_ms, report_writer  # noqa: E402


def products(shape: dict, device) -> dict:
    """Per product name: (weights, the cuBLAS path, the pnmix path, the float32 result) for one token."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim", hidden // shape["num_attention_heads"])
    q_rows, kv_rows = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    torch.manual_seed(0)
    x = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    x_inner = torch.randn(inner, device=device, dtype=torch.bfloat16)

    def weight(rows, cols):
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) / cols**0.5

    q, k, v, o = weight(q_rows, hidden), weight(kv_rows, hidden), weight(kv_rows, hidden), weight(hidden, q_rows)
    gate, up, down, head = weight(inner, hidden), weight(inner, hidden), weight(hidden, inner), weight(shape["vocab_size"], hidden)
    x1 = x[None]  # one token, as a model's F.linear sees it
    return {
        "q/k/v": (
            [q, k, v],
            lambda: (F.linear(x1, q), F.linear(x1, k), F.linear(x1, v)),
            lambda: gemv_stacked(x, [q, k, v], []),
            torch.cat([w.float() @ x.float() for w in (q, k, v)]),
        ),
        "o": ([o], lambda: F.linear(x1, o), lambda: gemv(x, o, None), o.float() @ x.float()),
        "gate/up + SiLU": (
            [gate, up],
            lambda: F.silu(F.linear(x1, gate)) * F.linear(x1, up),
            lambda: gemv_swiglu(x, gate, up, None, None),
            F.silu(gate.float() @ x.float()) * (up.float() @ x.float()),
        ),
        "down": ([down], lambda: F.linear(x_inner[None], down), lambda: gemv(x_inner, down, None), down.float() @ x_inner.float()),
        "lm_head": ([head], lambda: F.linear(x1, head), lambda: gemv(x, head, None), head.float() @ x.float()),
    }


def relative_error(got, want) -> float:
    got = torch.cat([g.flatten() for g in got]) if isinstance(got, tuple) else got.flatten()
    return ((got.float() - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(MODEL_SHAPES), help="default: qwen3-8b and llama-3.1-8b")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    write = report_writer(args.out, "bench_gemv.json", "benchmarks/bench_gemv.py")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    for model in args.model or ["qwen3-8b", "llama-3.1-8b"]:
        for name, (weights, cublas, pnmix, want) in products(MODEL_SHAPES[model], device).items():
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            row = {"model": model, "product": name, "weight_bytes": nbytes}
            for path, function in (("cublas", cublas), ("pnmix", pnmix)):
                ms = median_ms(function)
                row[path] = {
                    "us": ms * 1e3,
                    "relative_error": relative_error(function(), want),
                    "GB_per_s": nbytes / ms / 1e6,
                    "fraction_of_copy_bandwidth": nbytes / ms * 1e3 / bandwidth,
                }
            row["speedup"] = row["cublas"]["us"] / row["pnmix"]["us"]
            rows.append(row)
            print(
                f"  {model} {name:15s} {nbytes / 1e6:7.1f} MB: cuBLAS {row['cublas']['us']:7.1f} us "
                f"({row['cublas']['fraction_of_copy_bandwidth']:5.1%}), pnmix {row['pnmix']['us']:7.1f} us "
                f"({row['pnmix']['fraction_of_copy_bandwidth']:5.1%}) = {row['speedup']:.2f}x",
                flush=True,
            )
            write(copy_bandwidth_GB_per_s=bandwidth / 1e9, rows=rows)
    write(complete=True, copy_bandwidth_GB_per_s=bandwidth / 1e9, rows=rows)


if __name__ == "__main__":
    main()
