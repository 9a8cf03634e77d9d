"""The fused one-token products alone: q/k/v in one launch, gate/up/SiLU in one launch, block shapes swept (GPU).

    python benchmarks/diagnostics/gemv_fused_sweep.py [--model llama-3.1-8b qwen3-8b] [--out DIR]

Why: in ``gemv_bandwidth.py --steps-only`` (twentieth session) the step's products through the
library's fused ops on separate weights (``library_ops_ms``) took 3.855 ms on Llama-3.1-8B's shapes
against 3.680 ms for the same kernel on concatenated q/k/v and gate/up weights. This times each
fused group of one layer alone, cycling through copies of its weights that add up to 1 GiB or more
(nothing served from L2), in us per group and as a fraction of the copy bandwidth on its bytes:

- q/k/v: one concatenated weight through ``triton_gemv``; three ``triton_gemv`` launches; the stacked
  kernel of ``pnmix::gemv_stacked`` (``_gemv_kernel``) at several (columns per iteration, warps);
- gate/up: one concatenated weight through ``triton_gemv`` then ``F.silu(gate) * up`` (what an
  unfused step runs, here two elementwise kernels) and without the activation (the read alone); two
  ``triton_gemv`` launches plus the activation; the stacked kernel over the two weights plus the
  activation; the SwiGLU kernel of ``pnmix::gemv_swiglu``
  (``_gemv_swiglu_kernel``) at several (columns per iteration, warps).

Every kernel result is checked against float32 products first. Writes ``gemv_fused_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bandwidth import check, graph_ms, projection_sizes, run_header  # noqa: E402

from pnmix_patch.kernels.gemv import _gemv_kernel, triton_gemv  # noqa: E402
from pnmix_patch.kernels.gemv_swiglu import _gemv_swiglu_kernel  # noqa: E402
from pnmix_patch.planner import MODEL_SHAPES  # noqa: E402

STACKED_CONFIGS = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8)]
"""(columns per iteration, warps) of the stacked kernel."""
SWIGLU_CONFIGS = [(256, 2), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8)]
"""(columns per iteration, warps) of the SwiGLU kernel."""
PASS_BYTES = 2**30
"""Bytes of weight copies one timed pass cycles through (more than L2 holds)."""


def stacked(x, weights, out, config):
    """``_gemv_kernel`` over 2 or 3 weights (as ``triton_gemv_stacked`` launches it) at ``config``."""
    block, warps = config
    end0, end1 = weights[0].shape[0], out.numel() if len(weights) == 2 else weights[0].shape[0] + weights[1].shape[0]
    _gemv_kernel[(out.numel(),)](x, *weights, *weights[:3 - len(weights)], out, out, out, out, x.numel(), end0, end1,
                                 HAS_BIAS=False, BLOCK_K=block, EVEN_K=True, num_warps=warps)  # fmt: skip
    return out


def swiglu(x, gate, up, out, config):
    block, warps = config
    _gemv_swiglu_kernel[(out.numel(),)](x, gate, up, out, out, out, x.numel(), HAS_BIAS=False, BLOCK_K=block, EVEN_K=True, num_warps=warps)
    return out


def per_group_us(function, copies: list) -> float:
    return graph_ms(lambda: [function(*group) for group in copies]) * 1e3 / len(copies)


def time_groups(shape: dict, device, bandwidth: float) -> dict:
    hidden, inter, q, kv = projection_sizes(shape)
    x = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    rows = {}

    def report(name, us, nbytes):
        rows[name] = {"us": us, "fraction_of_copy": nbytes / (us * 1e-6) / bandwidth}
        print(f"    {name:28s} {us:7.2f} us ({rows[name]['fraction_of_copy']:6.1%})", flush=True)

    # q, k, v
    nbytes = 2 * (q + 2 * kv) * hidden
    copies = max(4, -(-PASS_BYTES // nbytes))
    groups = [[torch.randn(n, hidden, device=device, dtype=torch.bfloat16) for n in (q, kv, kv)] for _ in range(copies)]
    concatenated = [torch.cat(group) for group in groups]
    out = torch.empty(q + 2 * kv, device=device, dtype=torch.bfloat16)
    want = concatenated[0].float() @ x.float()
    print(f"  q/k/v [{q} + {kv} + {kv}, {hidden}], {copies} copies", flush=True)
    report("qkv concatenated gemv", per_group_us(lambda w: triton_gemv(x, w), [[w] for w in concatenated]), nbytes)
    report("qkv 3 x gemv", per_group_us(lambda a, b, c: [triton_gemv(x, w) for w in (a, b, c)], groups), nbytes)
    for config in STACKED_CONFIGS:
        check(stacked(x, groups[0], out, config), want, f"stacked {config}", q + 2 * kv, hidden)
        report(f"qkv stacked {config}", per_group_us(lambda a, b, c, config=config: stacked(x, [a, b, c], out, config), groups), nbytes)
    del groups, concatenated
    torch.cuda.empty_cache()

    # gate, up
    nbytes = 2 * 2 * inter * hidden
    copies = max(4, -(-PASS_BYTES // nbytes))
    groups = [[torch.randn(inter, hidden, device=device, dtype=torch.bfloat16) for _ in range(2)] for _ in range(copies)]
    concatenated = [torch.cat(group) for group in groups]
    out = torch.empty(inter, device=device, dtype=torch.bfloat16)
    want = F.silu(groups[0][0].float() @ x.float()) * (groups[0][1].float() @ x.float())
    print(f"  gate/up [2 x {inter}, {hidden}], {copies} copies", flush=True)

    def activation(y):
        return F.silu(y[:inter]) * y[inter:]

    report("gate_up concatenated gemv", per_group_us(lambda w: triton_gemv(x, w), [[w] for w in concatenated]), nbytes)
    report("gate_up concat gemv + silu*up", per_group_us(lambda w: activation(triton_gemv(x, w)), [[w] for w in concatenated]), nbytes)
    report("gate_up 2 x gemv + silu*up", per_group_us(lambda g, u: F.silu(triton_gemv(x, g)) * triton_gemv(x, u), groups), nbytes)
    stacked_out = torch.empty(2 * inter, device=device, dtype=torch.bfloat16)
    report("gate_up stacked + silu*up", per_group_us(lambda g, u: activation(stacked(x, [g, u], stacked_out, (1024, 4))), groups), nbytes)
    for config in SWIGLU_CONFIGS:
        check(swiglu(x, *groups[0], out, config), want, f"swiglu {config}", inter, hidden)
        report(f"swiglu {config}", per_group_us(lambda g, u, config=config: swiglu(x, g, u, out, config), groups), nbytes)
    del groups, concatenated
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama-3.1-8b", "qwen3-8b"], choices=list(MODEL_SHAPES))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    report = run_header(device) | {"models": {}}
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    for name in args.model:
        print(name, flush=True)
        report["models"][name] = time_groups(MODEL_SHAPES[name], device, bandwidth)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv_fused_sweep.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
