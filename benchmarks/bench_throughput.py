"""Serving scale on the GPU: memory capacity, decode throughput and time to first token, bf16 vs PN-Mix.

    python benchmarks/bench_throughput.py [--out DIR]          # on the GPU
    python benchmarks/bench_throughput.py --plot JSON          # anywhere: the PNG from a result

Randomly initialized bf16 Qwen3-8B-shaped model (`pnmix_patch.planner.MODEL_SHAPES`),
both methods with compiled decoding (`torch.compile(fullgraph=True, mode="reduce-overhead")`;
with `--graphed`, the throughput part replays the compiled step by `pnmix_patch.GraphedDecodeStep`):
bf16 = transformers `StaticCache` read by SDPA with `enable_gqa=True`; PN-Mix = `pnmix-1`
with `PNMixStaticCache`.

1. Under a 40 GiB budget (`torch.cuda.set_per_process_memory_fraction`; the paper's
   A100-40GB): the planner's largest batch at 8K generated tokens (prompt 141) and longest
   generation at batch 32, each run for real (prefill, caches brought to their final
   length, compiled decode steps) with the measured peak (`max_memory_allocated`) next to
   the plan.
2. The whole GPU: decode throughput at batches 32, 128 and each method's largest batch
   for 8K generated tokens: per-step time at cache lengths 1K, 4K and 8K (+141), integrated
   over the 8,192 steps (trapezoids; flat below 1K). Prefill excluded. ``--full-run BATCH``
   checks the integration: at that batch, one real generation of 8,192 steps from the
   prefill (steps 4 to 8,192 timed), its tokens/s beside the integrated figure.
3. Time to first token at a 16K prompt, batch 1: bf16 prefill, PN-Mix prefill with pair
   selection, and the same with selection replaced by a fixed mask.

The allocator runs with ``expandable_segments:True``. Caches are brought to a length synthetically (random keys/values or codes, lengths set on
the device), as in `bench_decode.py`: step time depends on lengths, not values.
Writes `bench_throughput.json` under `--out` (default `benchmarks/results`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

# Little fragmentation, as a serving process would run (and the planner assumes).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

PROMPT, GENERATED, BUDGET_GIB = 141, 8192, 40
LENGTHS = (1024, 4096, 8192)


def build_model(device):
    from transformers import AutoModelForCausalLM

    from pnmix_patch.planner import model_config

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config("qwen3-8b"), dtype=torch.bfloat16).eval()


def run_method(model, method, batch, positions, lengths, steps=5, warmup=3, graphed=False, full_run=False) -> dict:
    """Allocate the static cache for ``positions``, prefill ``batch x PROMPT`` tokens, then time
    compiled decode steps at each cache length (``graphed``: the compiled step replayed by
    ``GraphedDecodeStep`` instead of ``mode="reduce-overhead"``). ``full_run``: first decode
    ``GENERATED`` steps for real from the prefill (the cache grows, flushes included), timed after
    ``warmup`` of them. Returns per-length ms, the full run's figures and the peak memory."""
    from common import cache_arg, fill_bf16, fill_pnmix, graphed_forward, prefill, time_steps
    from transformers import StaticCache

    from pnmix_patch import new_cache, patch_model, unpatch_model

    name = cache_arg(model)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    import pnmix_patch.kernels.common as kernels_common

    result = {
        "method": method,
        "batch": batch,
        "positions": positions,
        "graphed": graphed,
        "graphed_pdl": graphed and model.device.type == "cuda" and kernels_common.has_pdl(model.device.index or 0),
    }  # GraphedDecodeStep's default
    try:
        if method == "bf16":
            model.set_attn_implementation("sdpa_gqa")
            cache = StaticCache(config=model.config, max_cache_len=positions)
            fill = fill_bf16
        else:
            patch_model(model, method)
            cache = new_cache(model, positions, static=True)
            fill = fill_pnmix
        prefill(model, cache, name, batch, PROMPT)
        result["peak_bytes_after_prefill"] = torch.cuda.max_memory_allocated()
        if graphed:
            forward = graphed_forward(model, cache)
        else:
            forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
        if full_run:
            times = time_steps([(forward, model, cache)], name, warmup, GENERATED - warmup, batch=batch)[0]["ms"]
            result["full_run"] = {
                "timed_steps": len(times),
                "total_ms": sum(times),
                "tokens_per_s": batch * len(times) / (sum(times) / 1e3),
            }
            print(
                f"  {method:8s} B={batch:4d}: full run {result['full_run']['tokens_per_s']:9.0f} tokens/s "
                f"over steps {warmup + 1}-{GENERATED}",
                flush=True,
            )
        result["ms_per_step"] = {}
        for length in lengths:
            fill(cache, min(PROMPT + length, positions - warmup - steps - 1))
            timed = time_steps([(forward, model, cache)], name, warmup, steps, batch=batch)[0]["ms"]
            result["ms_per_step"][length] = statistics.median(timed)
            print(
                f"  {method:8s} B={batch:4d} positions={positions:6d} length={length:6d}: {result['ms_per_step'][length]:8.2f} ms/step",
                flush=True,
            )
        del forward
    except torch.OutOfMemoryError as error:
        result["error"] = f"out of memory: {str(error).splitlines()[0]}"
        print(f"  {method:8s} B={batch:4d} positions={positions:6d}: OUT OF MEMORY", flush=True)
    finally:
        cache = None
        if method != "bf16":
            unpatch_model(model)
        model.set_attn_implementation("sdpa")
    result["peak_bytes"] = torch.cuda.max_memory_allocated()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


def integrated_throughput(batch: int, ms_per_step: dict) -> float:
    """Tokens/s over GENERATED steps from step times at a few lengths (linear between, flat outside)."""
    lengths = sorted(int(length) for length in ms_per_step)
    times = [ms_per_step[length] if length in ms_per_step else ms_per_step[str(length)] for length in lengths]
    total_ms = 0.0
    for step in range(GENERATED):
        length = step + 1
        if length <= lengths[0]:
            total_ms += times[0]
        elif length >= lengths[-1]:
            total_ms += times[-1]
        else:
            i = next(k for k in range(len(lengths) - 1) if lengths[k] <= length <= lengths[k + 1])
            share = (length - lengths[i]) / (lengths[i + 1] - lengths[i])
            total_ms += times[i] + share * (times[i + 1] - times[i])
    return batch * GENERATED / (total_ms / 1e3)


def capacity(model, planner, device, methods) -> list[dict]:
    """Part 1: under the 40 GiB cap, planned capacities run for real, measured against the plan."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = BUDGET_GIB * 2**30
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    rows = []
    for method in methods:
        preset = None if method == "bf16" else method
        batch = planner.largest_batch(preset, PROMPT, GENERATED, budget)
        longest = planner.longest_generation(preset, 32, PROMPT, budget)
        for label, run_batch, generated in (("largest batch at 8K", batch, GENERATED), ("longest generation at batch 32", 32, longest)):
            positions = PROMPT + generated
            planned = planner.peak_bytes(preset, run_batch, PROMPT, generated)
            result = run_method(model, method, run_batch, positions, (generated,), steps=2, warmup=2)
            result.update(question=label, generated=generated, planned_peak_bytes=planned, plan_error=result["peak_bytes"] / planned - 1)
            print(
                f"  {method}: {label}: batch {run_batch}, {generated} tokens; peak {result['peak_bytes'] / 2**30:.2f} GiB "
                f"measured vs {planned / 2**30:.2f} GiB planned ({result['plan_error']:+.1%})",
                flush=True,
            )
            rows.append(result)
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    return rows


def throughput(model, planner, device, methods, batches_of, graphed=False, full_run_batch=None) -> list[dict]:
    """Part 2: decode throughput over 8K generated tokens at several batches, whole GPU; at
    ``full_run_batch`` also one real 8K-step generation against the integrated figure."""
    budget = torch.cuda.get_device_properties(device).total_memory - 8 * 2**30  # CUDA context, graph pools, slack
    rows = []
    for method in methods:
        largest = planner.largest_batch(None if method == "bf16" else method, PROMPT, GENERATED, budget)
        for batch in batches_of(largest):
            result = run_method(model, method, batch, PROMPT + GENERATED + 16, LENGTHS, graphed=graphed, full_run=batch == full_run_batch)
            if "ms_per_step" in result:
                result["tokens_per_s"] = integrated_throughput(batch, result["ms_per_step"])
                print(f"  {method:8s} B={batch:4d}: {result['tokens_per_s']:9.0f} tokens/s over {GENERATED} steps", flush=True)
                if "full_run" in result:
                    result["full_run"]["integrated_over_full_run"] = result["tokens_per_s"] / result["full_run"]["tokens_per_s"]
            result["largest_batch"] = largest
            rows.append(result)
    return rows


def time_to_first_token(model, device, prompt_tokens=16384, repeats=3) -> dict:
    """Part 3: prefill time at a 16K prompt, batch 1 (median of ``repeats`` after one warm-up)."""
    from common import cache_arg

    from pnmix_patch import new_cache, patch_model, unpatch_model
    from pnmix_patch.cache import PNMixLayer

    name = cache_arg(model)
    prompt = torch.randint(0, 1000, (1, prompt_tokens), device=device)

    def timed(make_cache):
        times = []
        for _ in range(repeats + 1):
            cache = make_cache()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.no_grad():
                model(input_ids=prompt, logits_to_keep=1, **{name: cache})
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            del cache
        return statistics.median(times[1:])

    from transformers import DynamicCache

    result = {"prompt_tokens": prompt_tokens, "bf16_ms": timed(lambda: DynamicCache(config=model.config))}
    patch_model(model, "pnmix-1")
    result["pnmix_ms"] = timed(lambda: new_cache(model))
    selecting = PNMixLayer._select_pairs

    def fixed_pairs(layer, query, key, valid, incoming, all_real=False):  # the first pairs, no scoring
        layer.selected = layer.selected | incoming.gt(0)

    PNMixLayer._select_pairs = fixed_pairs
    try:
        result["pnmix_without_selection_ms"] = timed(lambda: new_cache(model))
    finally:
        PNMixLayer._select_pairs = selecting
        unpatch_model(model)
    result["selection_overhead"] = result["pnmix_ms"] / result["pnmix_without_selection_ms"] - 1
    print(
        f"  TTFT at {prompt_tokens}: bf16 {result['bf16_ms']:.1f} ms, PN-Mix {result['pnmix_ms']:.1f} ms, "
        f"without selection {result['pnmix_without_selection_ms']:.1f} ms: selection adds {result['selection_overhead']:+.2%}",
        flush=True,
    )
    return result


def plot(report: dict, path: Path) -> None:
    """Throughput vs batch, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in ("bf16", "pnmix-1"):
        points = sorted((r["batch"], r["tokens_per_s"]) for r in report["throughput"] if r["method"] == method and "tokens_per_s" in r)
        if points:
            axes.plot(*zip(*points), marker="o", label=method)
    axes.set_xlabel("batch (sequences)")
    axes.set_ylabel("decode throughput (tokens/s)")
    axes.set_title(f"Qwen3-8B shape, {GENERATED} generated tokens\n{report.get('gpu', 'GPU')}", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--plot", default=None, help="only draw the PNG of an existing JSON result")
    parser.add_argument("--parts", default="capacity,throughput,ttft")
    parser.add_argument("--methods", default="bf16,pnmix-1")
    parser.add_argument("--batches", default="32,128,largest", help="throughput batches ('largest': the planned largest)")
    parser.add_argument(
        "--graphed", action="store_true", help="throughput part: replay the compiled steps with GraphedDecodeStep (no per-call guards)"
    )
    parser.add_argument(
        "--full-run",
        type=int,
        default=None,
        metavar="BATCH",
        help="throughput part: at this batch (one of --batches) also decode all 8K steps for real",
    )
    parser.add_argument("--ttft-repeats", type=int, default=3, help="timed prefills per cache (median; after a warm-up)")
    args = parser.parse_args()
    if args.plot:
        path = Path(args.plot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    import common  # registers the "sdpa_gqa" attention

    from pnmix_patch.planner import CapacityPlanner

    device = torch.device("cuda", torch.cuda.current_device())
    started = time.time()
    model = build_model(device)
    planner = CapacityPlanner("qwen3-8b", bf16_attention="gqa")  # the bf16 runs read the cache with enable_gqa
    parts, methods = args.parts.split(","), args.methods.split(",")
    report = {}
    if "capacity" in parts:
        print("capacity under 40 GiB", flush=True)
        report["capacity"] = capacity(model, planner, device, methods)
    if "throughput" in parts:
        print("throughput, whole GPU", flush=True)
        wanted = args.batches.split(",")

        def batches_of(largest):
            return sorted({largest if b == "largest" else min(int(b), largest) for b in wanted})

        report["throughput"] = throughput(model, planner, device, methods, batches_of, args.graphed, args.full_run)
    if "ttft" in parts:
        print("time to first token", flush=True)
        report["ttft"] = time_to_first_token(model, device, repeats=args.ttft_repeats)
    report.update(
        {
            "date": time.strftime("%Y-%m-%d"),
            "commit": common.code_commit(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "host": platform.node(),
            "seconds": round(time.time() - started, 1),
            "command": "python benchmarks/bench_throughput.py"
            + "".join(
                f" --{name.replace('_', '-')}" + ("" if getattr(args, name) is True else f" {getattr(args, name)}")
                for name in ("parts", "methods", "batches", "graphed", "full_run", "ttft_repeats")
                if getattr(args, name) != parser.get_default(name)
            ),
        }
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"bench_throughput_{'_'.join(parts)}_{'_'.join(methods)}{'_graphed' if args.graphed else ''}.json").write_text(
        json.dumps(report, indent=2)
    )


if __name__ == "__main__":
    main()
