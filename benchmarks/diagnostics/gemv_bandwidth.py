"""How fast the weights' matrix-vector products of one batch-1 decode step can be (GPU).

    python benchmarks/diagnostics/gemv_bandwidth.py [--model llama-3.1-8b qwen3-8b] [--out DIR] [--steps-only]

Why: issue 4 asks the compiled PN-Mix step to reach 75% of its bandwidth floor at 32K, and the
floor is mostly weights (15.0 GB at Llama-3.1-8B's shape). In the profiles of ``bench_decode.py``
the weights' matrix multiplies (cuBLAS, through ``F.linear``) took 4.42-4.49 ms of Llama's step, about
80% of the copy bandwidth, while the whole step may take at most 5.04-5.09 ms. This measures, on
random bf16 weights of the real shapes, every projection of every layer and the LM head one after
the other in one CUDA graph (each weight read once, as in a step, so nothing is served from L2):

- ``cublas``: ``F.linear`` per projection, as the models call it (q, k, v, o, gate, up, down);
- ``cublas-fused``: the same with q/k/v and gate/up concatenated (4 products per layer);
- ``triton`` / ``triton-fused``: :func:`_sweep_gemv_kernel` below, a plain row-blocked GEMV, with the
  best of a few block shapes per weight shape (chosen in this run, on the per-shape timing);
- ``library`` / ``library-fused``: the launcher behind ``torch.ops.pnmix.gemv`` (``triton_gemv`` of
  ``kernels/gemv.py``, called directly: the kernel that :func:`pnmix_patch.patch_gemv` routes one-token
  products to, one row per program, its block and warps fixed from this sweep; inside a CUDA graph
  the op adds no GPU time);
- ``library-ops`` (fused steps only): what :func:`pnmix_patch.patch_gemv` runs, each weight its own
  tensor: q, k and v in one ``triton_gemv_stacked`` launch, gate, up and the SiLU in one
  ``triton_gemv_swiglu``, o and down and the LM head through ``triton_gemv``.

It also times each distinct weight shape alone (cycling through enough copies to defeat L2) and
reports GB/s and the fraction of the copy bandwidth measured in the same run. Every Triton result
is checked against float32 products first. ``--steps-only`` skips the per-shape timing and the sweep
(the ``triton`` columns). Writes ``gemv_bandwidth[_steps].json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import copy_bandwidth  # noqa: E402

from pnmix_patch.kernels.gemv import triton_gemv as library_gemv  # noqa: E402
from pnmix_patch.kernels.gemv import triton_gemv_stacked  # noqa: E402
from pnmix_patch.kernels.gemv_swiglu import triton_gemv_swiglu  # noqa: E402
from pnmix_patch.planner import MODEL_SHAPES  # noqa: E402

CONFIGS = [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (4, 8)) if n * k <= 8192]
"""(rows per program, columns per iteration, warps) tried for each weight shape."""


@triton.jit
def _sweep_gemv_kernel(x_ptr, w_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y[n] = sum_k w[n, k] * x[k]`` for ``BLOCK_N`` rows of a row-major ``w [N, K]`` (N a multiple of
    BLOCK_N, K of BLOCK_K), float32 products summed once after the loop."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + start + cols).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + start + cols[None, :])
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


def sweep_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config) -> torch.Tensor:
    """``out [N] = w [N, K] @ x [K]`` with ``config`` = (BLOCK_N, BLOCK_K, warps)."""
    block_n, block_k, warps = config
    n, k = w.shape
    if n % block_n or k % block_k:
        raise ValueError(f"weight {tuple(w.shape)} is not a multiple of the block ({block_n}, {block_k})")
    _sweep_gemv_kernel[(n // block_n,)](x, w, out, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def projection_sizes(shape: dict) -> tuple[int, int, int, int]:
    """(hidden, intermediate, q rows, k and v rows) of a model shape."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim", hidden // shape["num_attention_heads"])
    return hidden, inter, shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim


def layer_shapes(shape: dict, fused: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's projections."""
    hidden, inter, q, kv = projection_sizes(shape)
    attention = [("qkv", q + 2 * kv, hidden)] if fused else [("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden)]
    mlp = [("gate_up", 2 * inter, hidden)] if fused else [("gate", inter, hidden), ("up", inter, hidden)]
    return attention + [("o", hidden, q)] + mlp + [("down", hidden, inter)]


def graph_ms(function, replays: int = 20) -> float:
    """Median ms of replays of ``function`` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(got: torch.Tensor, want: torch.Tensor, kernel, n: int, k: int) -> None:
    error = float((got.float() - want).norm() / want.norm())
    if error > 1e-2:
        raise AssertionError(f"Triton GEMV {kernel} on ({n}, {k}): relative error {error:.2e}")


def time_shape(n: int, k: int, device, configs) -> dict:
    """One weight shape alone: enough copies to read 1 GiB per pass (no L2 reuse), cuBLAS and each config."""
    copies = max(4, -(-2**30 // (2 * n * k)))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    want = (weights[0].float() @ x[0].float())
    row = {"N": n, "K": k, "bytes": 2 * n * k,
           "cublas_us": graph_ms(lambda: [F.linear(x, w) for w in weights]) * 1e3 / copies, "triton": {}}
    check(library_gemv(x[0], weights[0]), want, "library", n, k)
    row["library_us"] = graph_ms(lambda: [library_gemv(x[0], w) for w in weights]) * 1e3 / copies
    for config in configs:
        if n % config[0] or k % config[1]:
            continue
        check(sweep_gemv(x[0], weights[0], out, config), want, config, n, k)
        row["triton"][",".join(map(str, config))] = graph_ms(lambda: [sweep_gemv(x[0], w, out, config) for w in weights]) * 1e3 / copies
    best = min(row["triton"], key=row["triton"].get)
    row["triton_best"] = best
    row["triton_best_us"] = row["triton"][best]
    del weights
    torch.cuda.empty_cache()
    return row


def time_step(shape: dict, device, fused: bool, best: dict | None) -> dict:
    """Every projection of every layer and the LM head, in order: cuBLAS, the sweep's best config per
    shape (unless ``best`` is None), the library kernel; fused, also the library's ops on separate weights."""
    projections = layer_shapes(shape, fused) * shape["num_hidden_layers"] + [("lm_head", shape["vocab_size"], shape["hidden_size"])]
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _, n, k in projections]
    inputs = {k: torch.randn(1, k, device=device, dtype=torch.bfloat16) for _, _, k in projections}
    outputs = {n: torch.empty(n, device=device, dtype=torch.bfloat16) for _, n, _ in projections}
    total = sum(w.numel() * 2 for w in weights)
    row = {"fused": fused, "products": len(projections), "weight_bytes": total,
           "cublas_ms": graph_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])}  # fmt: skip
    if best is not None:
        row["triton_ms"] = graph_ms(lambda: [sweep_gemv(inputs[w.shape[1]][0], w, outputs[w.shape[0]], best[tuple(w.shape)]) for w in weights])
    row["library_ms"] = graph_ms(lambda: [library_gemv(inputs[w.shape[1]][0], w) for w in weights])
    if fused:
        row["library_ops_ms"] = library_ops_ms(shape, weights, inputs)
    del weights
    torch.cuda.empty_cache()
    return row


def library_ops_ms(shape: dict, weights: list[torch.Tensor], inputs: dict) -> float:
    """The fused step's weights split back into q, k, v and gate, up views (contiguous row ranges),
    timed as ``patch_gemv`` runs them; its results are checked against ``F.linear`` first."""
    hidden, inter, q, kv = projection_sizes(shape)
    layers = [weights[i:i + 4] for i in range(0, len(weights) - 1, 4)]
    hidden_x, inter_x = inputs[hidden][0], inputs[inter][0]

    def step():
        for qkv, o, gate_up, down in layers:
            triton_gemv_stacked(hidden_x, list(qkv.split([q, kv, kv])), [])
            library_gemv(inputs[o.shape[1]][0], o)
            triton_gemv_swiglu(hidden_x, gate_up[:inter], gate_up[inter:])
            library_gemv(inter_x, down)
        library_gemv(hidden_x, weights[-1])

    qkv, _, gate_up, _ = layers[0]
    check(triton_gemv_stacked(hidden_x, list(qkv.split([q, kv, kv])), []), qkv.float() @ hidden_x.float(), "stacked", *qkv.shape)
    want = F.silu(gate_up[:inter].float() @ hidden_x.float()) * (gate_up[inter:].float() @ hidden_x.float())
    check(triton_gemv_swiglu(hidden_x, gate_up[:inter], gate_up[inter:]), want, "swiglu", inter, gate_up.shape[1])
    return graph_ms(step)


def run_header(device) -> dict:
    """The report's first fields: device, versions, commit and the copy bandwidth measured now (printed)."""
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)", flush=True)
    return {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "copy_bandwidth_bytes_per_s": bandwidth,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama-3.1-8b", "qwen3-8b"], choices=list(MODEL_SHAPES))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--steps-only", action="store_true", help="only the whole-step rows, without the sweep")
    args = parser.parse_args()
    device = torch.device("cuda")
    report = run_header(device) | {"configs": CONFIGS, "models": {}}
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    for name in args.model:
        shape = MODEL_SHAPES[name]
        distinct = sorted({(n, k) for fused in (False, True) for _, n, k in layer_shapes(shape, fused)}
                          | {(shape["vocab_size"], shape["hidden_size"])})
        shapes = []
        for n, k in [] if args.steps_only else distinct:
            row = time_shape(n, k, device, CONFIGS)
            for key in ("cublas", "triton_best", "library"):
                row[f"{key}_fraction_of_copy"] = row["bytes"] / (row[f"{key}_us"] * 1e-6) / bandwidth
            print(f"  {name} [{n:6d}, {k:5d}]: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_fraction_of_copy']:5.1%}),"
                  f" Triton {row['triton_best_us']:7.1f} us ({row['triton_best_fraction_of_copy']:5.1%}, {row['triton_best']}),"
                  f" library {row['library_us']:7.1f} us ({row['library_fraction_of_copy']:5.1%})",
                  flush=True)
            shapes.append(row)
        best = None if args.steps_only else {(row["N"], row["K"]): tuple(int(v) for v in row["triton_best"].split(",")) for row in shapes}
        steps = []
        for fused in (False, True):
            step = time_step(shape, device, fused, best)
            step["floor_ms"] = step["weight_bytes"] / bandwidth * 1e3
            print(f"  {name} step ({'fused' if fused else 'unfused'}, {step['products']} products, {step['weight_bytes'] / 1e9:.2f} GB):"
                  f" cuBLAS {step['cublas_ms']:.3f} ms, Triton {step.get('triton_ms', math.nan):.3f} ms, library {step['library_ms']:.3f} ms,"
                  f" library ops {step.get('library_ops_ms', math.nan):.3f} ms, floor {step['floor_ms']:.3f} ms", flush=True)
            steps.append(step)
        report["models"][name] = {"shapes": shapes, "steps": steps}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gemv_bandwidth{'_steps' if args.steps_only else ''}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
