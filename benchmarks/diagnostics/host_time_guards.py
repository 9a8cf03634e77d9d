"""Where the host time of a compiled (``mode="reduce-overhead"``) decode call goes: bf16 StaticCache
against the PN-Mix static cache, each in a fresh process (host time drifts within one).

Per cache, a tiny Llama of real attention shape (``--layers`` layers, 32 query and 8 KV heads, head
dim 128, hidden 512, bf16) is prefilled, ``model.forward`` compiled with ``fullgraph=True,
mode="reduce-overhead"``, and then measured over ``--calls`` synchronized calls:

- ``host_ms``: median time until the call returns (the GPU is idle meanwhile), and ``host_ms_again``
  the same measured once more at the end (how much it drifts within the process);
- ``host_ms_no_guards``: the same under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
  (Dynamo then skips most guards; on the H200 this made bf16's call faster and, with the cache's
  storage per layer, PN-Mix's slower, so the difference is not simply the guards' cost);
- ``guard_ms``: the best of five rounds of the cache entry's guard check alone;
- ``guards``: how many guards that check runs, ``tensor_guards`` how many of them are tensor matches,
  ``aliasing_guards`` how many are object-identity tests on the arguments (``a is b``, one object
  reached by two paths), which Dynamo evaluates in Python, and ``aliasing_ms`` the time of those
  tests alone, evaluated as one Python expression;
- ``top``: the functions of a cProfile of 100 calls with the largest own time.

With ``--device cpu`` (no GPU needed), only the guards: their count and the check's time, float32,
``backend="eager"``. With ``--one-process ORDER`` (e.g. ``bf16,pnmix-1,bf16``), the caches are instead measured one after
the other in this process, in that order (Dynamo reset between them), as ``bench_decode.py`` runs them.

Run from the repository root on a GPU: ``python benchmarks/diagnostics/host_time_guards.py --out DIR
[--one-process ORDER] [--device cpu]`` (writes ``host_time_guards.json``, or
``host_time_guards_one_process_<ORDER>.json`` with the commas as underscores; ``_cpu`` before the
``.json`` with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import pstats
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

CACHES = ("bf16", "pnmix-1")


def compiled_frame(forward):
    """The function whose code Dynamo compiled for ``forward``: the outermost of its ``__wrapped__``
    chain with a cache entry (its closure cells are part of the guarded locals)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    function = getattr(forward, "__func__", forward)
    while function is not None:
        if _debug_get_cache_entry_list(function.__code__):
            return function
        function = getattr(function, "__wrapped__", None)
    raise RuntimeError("no compiled frame found under model.forward")


def guard_check(model, token, name: str, cache) -> dict:
    """Time the guard check of ``model.forward``'s compiled frame alone on the call's arguments (best of
    five rounds of 1,000), and count its guards, tensor matches and Python aliasing tests."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    function = compiled_frame(model.forward)
    manager = _debug_get_cache_entry_list(function.__code__)[0].guard_manager
    bound = inspect.signature(function, follow_wrapped=False).bind(model, input_ids=token, **{name: cache})
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)
    frame_locals.update({n: c.cell_contents for n, c in zip(function.__code__.co_freevars, function.__closure__ or ())})
    if not manager.check(frame_locals):
        raise RuntimeError(f"the guards fail on the rebuilt locals: {manager.check_verbose(frame_locals).verbose_code_parts}")
    # The aliasing tests on the arguments (``L[...] is L[...]``), as one Python expression: what
    # Dynamo evaluates for them on every call.
    text = str(manager)
    aliasing = re.findall(r"LAMBDA_GUARD: (L\[.*? is L\[[^#]*?)\s+#", text)
    aliasing_check = eval("lambda L: " + " and ".join(f"({part})" for part in aliasing)) if aliasing else None
    if aliasing_check is not None and not aliasing_check(frame_locals):
        raise RuntimeError("the aliasing tests fail on the rebuilt locals")

    def best_of_five(check) -> float:
        """Milliseconds per call of ``check(frame_locals)``: the best of five rounds of 1,000."""
        rounds = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(1000):
                check(frame_locals)
            rounds.append(time.perf_counter() - started)
        return min(rounds)  # seconds per 1000 = ms per call

    return {"guard_ms": best_of_five(manager.check),
            "guards": manager.check_verbose(frame_locals).num_guards_executed,
            "tensor_guards": text.count("TENSOR_MATCH"),
            "aliasing_guards": len(aliasing),
            "aliasing_ms": best_of_five(aliasing_check) if aliasing_check is not None else 0.0}  # fmt: skip


def measure(cache_name: str, layers: int, calls: int, device: str) -> dict:
    """One cache's figures (see the module docstring); on ``"cpu"`` only the guards (float32,
    ``backend="eager"``: CUDA graphs and host times are CUDA-only)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    from pnmix_patch import new_cache, patch_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    on_cuda = device == "cuda"
    model = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16 if on_cuda else torch.float32).eval()
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    if cache_name == "bf16":
        cache = StaticCache(config=model.config, max_cache_len=4096)
    else:
        patch_model(model, cache_name)
        cache = new_cache(model, 4096, static=True)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    row = {"cache": cache_name, "layers": layers, "device": device}
    torch._dynamo.reset()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 1024), device=device), **{name: cache})
        options = {"mode": "reduce-overhead"} if on_cuda else {"backend": "eager"}
        step = torch.compile(model.forward, fullgraph=True, **options)

        def call():
            step(input_ids=token, **{name: cache})

        if not on_cuda:
            call()
            return {**row, **guard_check(model, token, name, cache)}

        def host_times() -> float:
            times = []
            for _ in range(calls):
                torch.cuda.synchronize()
                started = time.perf_counter()
                call()
                times.append((time.perf_counter() - started) * 1e3)
            torch.cuda.synchronize()
            return statistics.median(times)

        for _ in range(10):
            call()
        torch.cuda.synchronize()
        row["host_ms"] = host_times()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            row["host_ms_no_guards"] = host_times()
        row["host_ms_again"] = host_times()
        row.update(guard_check(model, token, name, cache))

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            call()
            torch.cuda.synchronize()
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    row["top"] = [line for line in text.getvalue().splitlines() if line.strip()][-21:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--one-process", metavar="ORDER", type=lambda text: text.split(","),
                        help=f"caches to measure in this process, in this order, comma-separated ({', '.join(CACHES)})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: only the guards (their count and the check's time), float32, backend='eager'")
    parser.add_argument("--child", choices=CACHES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.layers, args.calls, args.device)))
        return
    rows = []
    unknown = set(args.one_process or ()) - set(CACHES)
    if unknown:
        parser.error(f"--one-process names {sorted(unknown)}; the caches are {', '.join(CACHES)}")
    for cache_name in args.one_process or CACHES:
        if args.one_process:
            row = measure(cache_name, args.layers, args.calls, args.device)
        else:
            command = [sys.executable, __file__, "--child", cache_name, "--layers", str(args.layers), "--calls", str(args.calls),
                       "--device", args.device]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cache_name} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        guards = f"guard check {row['guard_ms']:.3f} ms ({row['guards']} guards, {row['tensor_guards']} tensor matches, {row['aliasing_guards']} aliasing tests taking {row['aliasing_ms']:.3f} ms)"
        if args.device == "cpu":
            print(f"{cache_name}: {guards}", flush=True)
            continue
        print(f"{cache_name}: host {row['host_ms']:.3f} ms (again {row['host_ms_again']:.3f}), without guards "
              f"{row['host_ms_no_guards']:.3f}, {guards}", flush=True)  # fmt: skip
        print("\n".join(row["top"]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    name = f"host_time_guards_one_process_{'_'.join(args.one_process)}" if args.one_process else "host_time_guards"
    name += "_cpu.json" if args.device == "cpu" else ".json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "command": " ".join(["python benchmarks/diagnostics/host_time_guards.py"] + sys.argv[1:]),
              "one_process_order": args.one_process, "rows": rows}  # fmt: skip
    (Path(args.out) / name).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
