"""Host cost of a CUDA-graph launch before and after ``torch.profiler`` has traced CUDA activity in
the process: the graphed decode step of bf16 StaticCache (fair SDPA) and of the PN-Mix static cache,
both replayed by ``GraphedDecodeStep``, and graphs of one launch kind each.

Why: ``bench_decode.py --profile`` used to profile each row right after timing it, so all PN-Mix
rows were timed after profiles (bf16's first row never was). Through ``reduce-overhead`` they were
0.55-0.87 ms per step slower than in a run without profiles on another machine (the sixteenth
session, benchmarks/RESULTS.md). Here every graph is captured first, with no
profiler, then timed in two phases:

1. ``no profiler yet``;
2. ``after profiler``: after one ``torch.profiler`` session (CPU and CUDA activity) over ten
   synchronized replays of each step graph (``traces`` in the JSON: per replay the
   ``cudaGraphLaunch`` call's duration, the time from its start to the first kernel's start, the
   kernels' span and own time, the launches, and the five largest gaps between kernels).

Timed in each phase, the GPU idle before each replay (median): ``replay_host_us``, the
``graph.replay()`` call alone, and ``replay_wall_us``, from the call to the end of a
``torch.cuda.synchronize()``. Graphs (Llama-3.1-8B shape, random bf16 weights, batch 1, context
``--context``): the two decode steps, and ``micro`` graphs of ``--repeat`` launches (per launch) of
an aten pointwise add, an inductor-compiled pointwise kernel, PN-Mix's ``decode_attention`` (split
and combine kernels) and ``decode_append``, with layer 0's arguments recorded from an eager step,
each on a PN-Mix cache of its own, and 700 aten adds.

A third phase, once run on the H200 (torch 2.11+cu130) and since removed, set ``TEARDOWN_CUPTI=1``
before a second profiler session so that Kineto would tear CUPTI down after it: that session failed
with "unspecified launch failure" and the process then died of a segmentation fault. So that is no
way out here; profile in another process, or after all timing.

Run from the repository root on a GPU: ``python benchmarks/diagnostics/graph_replay.py --out DIR``
(writes ``graph_replay.json`` after each phase).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import cache_arg, fill_bf16, fill_pnmix, model_config, prefill  # noqa: E402

import pnmix_patch.static_cache as static_cache  # noqa: E402
from pnmix_patch import GraphedDecodeStep, new_cache, patch_model, unpatch_model  # noqa: E402


def time_replay(replay, rounds: int = 50) -> dict:
    """Median host time of ``replay()`` alone and until the GPU is done, the GPU idle before each."""
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        replay()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        host.append(returned - started)
        wall.append(time.perf_counter() - started)
    return {"replay_host_us": statistics.median(host) * 1e6, "replay_wall_us": statistics.median(wall) * 1e6}


def trace_replays(replay, rounds: int = 10) -> dict:
    """Per synchronized replay, from a profile: launch call, start latency, kernel span and busy time,
    launches, and the largest gaps between kernels (with the kernels on either side)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(rounds):
            torch.cuda.synchronize()
            replay()
            torch.cuda.synchronize()
    events = profiler.events()
    launches = sorted((e for e in events if e.name == "cudaGraphLaunch"), key=lambda e: e.time_range.start)
    device = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    rows = []
    for i, launch in enumerate(launches):
        until = launches[i + 1].time_range.start if i + 1 < len(launches) else float("inf")
        mine = [e for e in device if launch.time_range.start <= e.time_range.start < until]
        if not mine:
            continue
        gaps = sorted(
            ((b.time_range.start - a.time_range.end, a.name[:60], b.name[:60]) for a, b in zip(mine, mine[1:])), reverse=True
        )
        rows.append({
            "launch_call_us": launch.time_range.end - launch.time_range.start,
            "start_latency_us": mine[0].time_range.start - launch.time_range.start,
            "span_us": mine[-1].time_range.end - mine[0].time_range.start,
            "busy_us": sum(e.time_range.end - e.time_range.start for e in mine),
            "launches": len(mine),
            "largest_gaps": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:5]],
        })  # fmt: skip
    summary = {key: statistics.median(r[key] for r in rows) for key in ("launch_call_us", "start_latency_us", "span_us", "busy_us", "launches")}
    return {**summary, "replays": rows[-2:]}


def micro_graph(launch, repeat: int):
    """A graph of ``repeat`` calls of ``launch`` (captured and replayed once), and ``repeat``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # warm-up outside capture (compiles, loads modules)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(repeat):
            launch()
    graph.replay()
    return graph, repeat


def recorded_op_calls(model, cache, name) -> dict:
    """The arguments of layer 0's ``decode_append`` and ``decode_attention`` in one eager decode step."""
    calls = {}
    originals = {"decode_append": static_cache.decode_append, "decode_attention": static_cache.decode_attention}

    def recorder(op_name):
        def call(*args):
            calls.setdefault(op_name, args)
            return originals[op_name](*args)

        return call

    for op_name in originals:
        setattr(static_cache, op_name, recorder(op_name))
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), **{name: cache})
    finally:
        for op_name, op in originals.items():
            setattr(static_cache, op_name, op)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=200, help="launches per micro graph")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = model_config("llama-3.1-8b")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    name = cache_arg(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "command": "python " + " ".join(sys.argv), "context": args.context, "phases": {}}  # fmt: skip

    steps = []

    def graphed(cache):
        torch._dynamo.reset()
        step = GraphedDecodeStep(model, cache)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        for _ in range(4):  # warm-ups, capture, one replay
            step(token)
        torch.cuda.synchronize()
        steps.append(step)  # the graph reads the step's input buffer: keep it alive
        return step._graph

    model.set_attn_implementation("sdpa_gqa")
    bf16 = StaticCache(config=model.config, max_cache_len=args.context + 512)
    prefill(model, bf16, name)
    fill_bf16(bf16, args.context)
    graphs = {"bf16-graphed-fair": graphed(bf16)}
    model.set_attn_implementation("sdpa")
    patch_model(model, "pnmix-1")

    def pnmix_cache(tokens):
        cache = new_cache(model, tokens, static=True)
        prefill(model, cache, name)
        fill_pnmix(cache, args.context)
        return cache

    static = pnmix_cache(args.context + 512)
    graphs["pnmix-graphed"] = graphed(static)
    # The micro graphs' op calls, each on a cache of its own: the append graph's replays grow its
    # cache (``repeat`` tokens each), which must not lengthen what the other graphs read.
    attention_calls = recorded_op_calls(model, pnmix_cache(args.context + 512), name)
    append_calls = recorded_op_calls(model, pnmix_cache(args.context + 512 + 50 * args.repeat), name)
    x = torch.randn(4096, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    pointwise = torch.compile(lambda t: t * 2 + 1)
    micro = {
        "aten add": lambda: torch.add(x, 1, out=y),
        "inductor pointwise": lambda: pointwise(x),
        "pnmix decode_attention (2 kernels)": lambda: static_cache.decode_attention(*attention_calls["decode_attention"]),
        "pnmix decode_append": lambda: static_cache.decode_append(*append_calls["decode_append"]),
    }  # fmt: skip
    micro_graphs = {label: micro_graph(launch, args.repeat) for label, launch in micro.items()}
    micro_graphs["aten add x700"] = micro_graph(micro["aten add"], 700)

    def phase(label):
        # Every graph's replay timed, the same way in each phase; the JSON rewritten after each.
        rows = {key: time_replay(graph.replay) for key, graph in graphs.items()}
        rows.update({f"micro {key}": {k: v / n for k, v in time_replay(graph.replay, rounds=20).items()}
                     for key, (graph, n) in micro_graphs.items()})  # fmt: skip
        report["phases"][label] = rows
        for key, row in rows.items():
            print(f"{label:16s} {key:40s} " + ", ".join(f"{k} {v:8.2f}" for k, v in row.items()), flush=True)
        (out / "graph_replay.json").write_text(json.dumps(report, indent=2))

    phase("no profiler yet")
    report["traces"] = {key: trace_replays(graph.replay) for key, graph in graphs.items()}
    phase("after profiler")
    unpatch_model(model)


if __name__ == "__main__":
    main()
