"""Host time of a compiled decode call with the graph's work taken out, warm and cold CPU caches.

A tiny Llama of real attention shape (32 layers, 32 query and 8 KV heads, head dim 128, hidden 512,
float32, CPU) is compiled twice in one process, once on transformers' ``StaticCache`` (read by SDPA
with ``enable_gqa``, as ``bench_decode.py``'s fair baseline) and once patched with PN-Mix on its
static cache. The backend is AOTAutograd around a "compiled" graph that runs once and then returns
its first outputs, so a call costs only what every compiled call costs on the host: Dynamo's guard
check, the rewritten frame, AOTAutograd's wrappers (what ``reduce-overhead`` adds on top, the
CUDA-graph tree, is not here). Median host time per call (after 20 calls) of 400 calls:

- ``consecutive``: one model's calls one after the other;
- ``turns``: the two models' calls alternating (``bench_decode.py --interleaved --turn 1``);
- ``evicted``: bf16's calls one after the other with 64 MB of memory written between them;
- ``by_turn_position``: the two models taking turns of 10 calls (``bench_decode.py --interleaved``'s
  default turn), the median host time of each call of a turn (first, second, ...) over 55 turns:
  how many calls the host needs after a switch.

Each measurement is taken twice. Run from the repository root: ``python
benchmarks/diagnostics/host_time_cold_caches.py`` (writes ``benchmarks/results/host_time_cold_caches_cpu.json``).
"""

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode  # noqa: E402  (registers the "sdpa_gqa" attention)

from pnmix_patch import new_cache, patch_model  # noqa: E402

CALLS = 400


def run_once_compiler(graph, example_inputs):
    """A 'compiled' graph that runs once, then returns its first outputs (no work per call)."""
    outputs = []

    def run(args):
        if not outputs:
            outputs.append(graph(*args))
        args.clear()
        return outputs[0]

    run._boxed_call = True
    return run


def compiled_step(cache_name: str):
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    name = bench_decode.cache_arg(model)
    if cache_name == "pnmix-1":
        patch_model(model, "pnmix-1")
        cache = new_cache(model, 1024, static=True)
    else:
        model.set_attn_implementation("sdpa_gqa")
        cache = StaticCache(config=model.config, max_cache_len=1024)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1000, (1, 64)), **{name: cache})
    bench_decode.own_forward(model)
    backend = aot_autograd(fw_compiler=run_once_compiler, keep_inference_input_mutations=True)
    step = torch.compile(model.forward, fullgraph=True, backend=backend)
    token = torch.zeros(1, 1, dtype=torch.long)
    return lambda: step(input_ids=token, **{name: cache})


def median_host_ms(calls_of_round, rounds=CALLS, skipped=20) -> dict:
    """Median host time (ms) of each label's calls, ``calls_of_round(r)`` giving round ``r``'s
    ``(label, call)`` pairs in order; each label's first ``skipped`` calls left out."""
    times = {}
    for round_ in range(rounds):
        for label, call in calls_of_round(round_):
            started = time.perf_counter()
            call()
            times.setdefault(label, []).append(time.perf_counter() - started)
    return {label: statistics.median(t[skipped:]) * 1e3 for label, t in times.items()}


def main() -> None:
    steps = {cache: compiled_step(cache) for cache in ("bf16", "pnmix-1")}
    pairs = list(steps.items())
    sweep = torch.zeros(64 * 2**20 // 4)

    def evicting(round_):
        sweep.add_(1)  # writes 64 MB: the CPU caches then hold little of the model's objects
        return [("bf16", steps["bf16"])]

    def by_turn_position(turns=60, turn=10):
        def calls_of_round(round_):
            return [((cache, position), call) for cache, call in (pairs if round_ % 2 == 0 else pairs[::-1])
                    for position in range(turn)]  # fmt: skip

        medians = median_host_ms(calls_of_round, rounds=turns, skipped=5)
        return {cache: [medians[cache, position] for position in range(turn)] for cache in steps}

    results = []
    with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for repeat in range(2):
            row = {"turns": median_host_ms(lambda r: pairs if r % 2 == 0 else pairs[::-1])}
            row["consecutive"] = {c: median_host_ms(lambda r, c=c: [(c, steps[c])])[c] for c in steps}
            row["evicted"] = median_host_ms(evicting)
            row["by_turn_position"] = by_turn_position()
            print(f"round {repeat + 1}: {row}", flush=True)
            results.append(row)
    cpu = [line for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
           if line.startswith(("Model name", "L2", "L3"))]  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__, "host": platform.node(),
              "cpu": cpu, "command": "python " + " ".join(sys.argv), "median_host_ms_per_call": results}  # fmt: skip
    out = Path(__file__).resolve().parents[1] / "results" / "host_time_cold_caches_cpu.json"
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
