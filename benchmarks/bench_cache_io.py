"""Saved prompt caches: file sizes, and answering from a saved cache against prefilling again.

    python benchmarks/bench_cache_io.py --model smollm2 --contexts 4096 8192 16384            # CPU, real weights
    python benchmarks/bench_cache_io.py --model qwen3-8b --contexts 4096 16384 32768 --out $OUT   # CUDA, random weights

1. Checks (small, fast, on the benchmark's device): a tiny random Llama in float32 prefills a left-padded batch of two prompts, saves the cache, loads it into a second model object
   built from the same seed, and decodes greedily: the same tokens as continuing from the cache in
   memory, for every preset; for every preset the static cache allows, the file loads into a
   ``PNMixStaticCache`` whose decode steps give the in-memory static cache's tokens (on CUDA, pnmix-1
   also through ``GraphedDecodeStep``: reported, not required, as Inductor's code around the attention
   may round differently from eager PyTorch); one saved prompt expanded to three requests with their own
   questions generates what each request gives from its own prefilled prefix.
2. Timing, per context (``pnmix-1``; one sequence of random token ids; the model of ``--model``:
   ``smollm2`` is the real SmolLM2-135M-Instruct in float32, a shape name of the planner such as
   ``qwen3-8b`` a randomly initialized bf16 model, the time does not depend on the weights):

   - ``prefill_s``: :func:`pnmix_patch.prefill` (one forward pass, last position's logits only), the
     fastest of ``--prefill-repeats`` runs (default 2 on CUDA, where a first run at a new length may
     compile kernels; 1 on CPU);
   - the keys and values the layers receive in that pass, kept in bf16, are saved as a transformers
     ``DynamicCache`` would hold them (``layers.<i>.keys`` / ``.values``), for ``bf16_file_bytes``;
   - ``file_bytes`` of :func:`pnmix_patch.save_cache` against ``memory_report()["total_bytes"]``;
   - ``load_s``: :func:`pnmix_patch.load_cache` of the file (just written, so in the OS page cache)
     onto the device, checksums verified; ``first_step_s``: one decode step on the loaded cache;
     median of ``--repeats`` (a warm-up cycle at 512 tokens runs first: kernels compile there);
   - ``speedup``: ``prefill_s / (load_s + first_step_s)``.

A failed (or raising) check is recorded (``checks``, ``checks_passed``) and the timing still runs.
Writes ``bench_cache_io_<model>.json`` under ``--out`` (default ``benchmarks/results``) after every
context, ``"complete": false`` until the end. The cache files go to a temporary folder and are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from pnmix_patch import GraphedDecodeStep, cache_argument, continuation_inputs, load_cache, new_cache, patch_model, prefill, save_cache
from pnmix_patch.config import PRESETS
from pnmix_patch.planner import model_config

PRESET = "pnmix-1"


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- checks
def tiny_llama(device, dtype, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def greedy(forward, model, cache, first, steps):
    name = cache_argument(model)
    tokens = [first]
    with torch.no_grad():
        for _ in range(steps):
            logits = forward(input_ids=tokens[-1], **{name: cache}).logits[:, -1]
            tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, 1).cpu()


def check(device, dtype, folder: Path) -> dict:
    """Step 1 of the module docstring; returns ``{check: bool}``."""
    results = {}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 96, (2, 300), generator=generator).to(device)
    mask = torch.ones_like(prompt)
    mask[1, :40] = 0
    first = torch.randint(3, 96, (2, 1), generator=generator).to(device)
    path = folder / "check.safetensors"
    for preset in PRESETS:
        model = patch_model(tiny_llama(device, dtype), preset)
        cache = prefill(model, prompt, mask, progress=False)
        save_cache(cache, path, model=model, prompt_token_ids=prompt)
        expected = greedy(model.forward, model, cache, first, 140)  # crosses a flush
        fresh = patch_model(tiny_llama(device, dtype), preset)
        results[f"{preset} dynamic"] = torch.equal(greedy(fresh.forward, fresh, load_cache(path, fresh), first, 140), expected)
        if PRESETS[preset].reselection == "prefill":
            static = prefill(model, prompt, mask, cache=new_cache(model, 460, static=True), progress=False)
            save_cache(static, path, model=model)
            expected = greedy(model.forward, model, static, first, 140)
            loaded = load_cache(path, fresh, static=True, max_cache_len=460)
            results[f"{preset} static"] = torch.equal(greedy(fresh.forward, fresh, loaded, first, 140), expected)
            if device.type == "cuda" and preset == PRESET:
                try:
                    loaded = load_cache(path, fresh, cache=loaded)  # into the same storage again
                    step = GraphedDecodeStep(fresh, loaded)
                    graphed = greedy(lambda **kw: _logits(step, kw), fresh, loaded, first, 140)
                    results[f"{preset} static graphed"] = torch.equal(graphed, expected)
                except Exception as error:
                    results[f"{preset} static graphed"] = f"{type(error).__name__}: {error}"
        print(
            f"  {preset}: " + ", ".join(f"{k.split(' ', 1)[1]} {v}" for k, v in results.items() if k.startswith(preset + " ")), flush=True
        )
    model = patch_model(tiny_llama(device, dtype), PRESET)
    shared_prompt = prompt[:1]
    cache = prefill(model, shared_prompt, progress=False)
    save_cache(cache, path, model=model, prompt_token_ids=shared_prompt)
    questions = [torch.randint(3, 96, (n,), generator=generator) for n in (5, 17, 1)]
    settings = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
    alone = []
    for question in questions:
        own = prefill(model, shared_prompt, progress=False)
        alone.append(
            model.generate(**continuation_inputs(shared_prompt, [question], device=device), **{cache_argument(model): own}, **settings)[
                0, -40:
            ]
        )
    shared = load_cache(path, model, batch_size=len(questions))
    together = model.generate(
        **continuation_inputs(shared_prompt, questions, device=device), **{cache_argument(model): shared}, **settings
    )[:, -40:]
    results["shared prefix, 3 requests"] = all(torch.equal(together[i], alone[i]) for i in range(len(questions)))
    print(f"  shared prefix: {results['shared prefix, 3 requests']}", flush=True)
    path.unlink()
    return results


class _Logits:
    def __init__(self, logits):
        self.logits = logits


def _logits(step, kwargs):
    return _Logits(step(kwargs["input_ids"]).clone())


# ---------------------------------------------------------------------------------------- timing
def build_model(name: str, device):
    if name == "smollm2":
        from pnmix_patch.eval.models import load_model

        model, _ = load_model("smollm2", dtype=torch.float32, device=str(device))
        return model
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config(name), dtype=torch.bfloat16).eval()


def prefill_recording_dense(model, ids):
    """:func:`pnmix_patch.prefill` of ``ids``, keeping (in bf16) the post-RoPE keys and values each layer's
    cache receives: what a ``DynamicCache`` of the unpatched model would hold."""
    cache = new_cache(model)
    dense = {}
    for index, layer in enumerate(cache.layers):
        attend = layer.attend

        def recording(query, key, value, valid, scaling, attend=attend, index=index):
            dense[f"layers.{index}.keys"] = key.to(torch.bfloat16)
            dense[f"layers.{index}.values"] = value.to(torch.bfloat16)
            return attend(query, key, value, valid, scaling)

        layer.attend = recording
    synchronize(ids.device)
    started = time.perf_counter()
    prefill(model, ids, cache=cache, progress=False)
    synchronize(ids.device)
    seconds = time.perf_counter() - started
    for layer in cache.layers:
        del layer.attend
    return cache, dense, seconds


def time_context(model, context: int, folder: Path, repeats: int, device, prefill_repeats: int = 1) -> dict:
    generator = torch.Generator().manual_seed(context)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(device)
    token = torch.randint(0, model.config.vocab_size, (1, 1), generator=generator).to(device)
    prefills = []
    for _ in range(prefill_repeats - 1):
        synchronize(device)
        started = time.perf_counter()
        prefill(model, ids, progress=False)
        synchronize(device)
        prefills.append(time.perf_counter() - started)
    cache, dense, seconds = prefill_recording_dense(model, ids)
    prefills.append(seconds)
    prefill_s = min(prefills)
    report = cache.memory_report()
    path, dense_path = folder / f"pnmix_{context}.safetensors", folder / f"bf16_{context}.safetensors"
    started = time.perf_counter()
    info = save_cache(cache, path, model=model)
    save_s = time.perf_counter() - started
    save_file({name: tensor.cpu().contiguous() for name, tensor in dense.items()}, str(dense_path))
    dense_bytes = dense_path.stat().st_size
    del dense, cache
    dense_path.unlink()
    name = cache_argument(model)
    loads, steps = [], []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        loaded = load_cache(path, model)
        synchronize(device)
        loaded_at = time.perf_counter()
        with torch.no_grad():
            model(input_ids=token, **{name: loaded}).logits.argmax(-1).cpu()
        synchronize(device)
        loads.append(loaded_at - started)
        steps.append(time.perf_counter() - loaded_at)
        del loaded
    path.unlink()
    load_s, step_s = statistics.median(loads), statistics.median(steps)
    return {
        "context": context,
        "prefill_s": prefill_s,
        "prefill_s_all": prefills,
        "save_s": save_s,
        "file_bytes": info.file_bytes,
        "memory_report_total_bytes": report["total_bytes"],
        "file_minus_memory_bytes": info.file_bytes - report["total_bytes"],
        "bf16_file_bytes": dense_bytes,
        "bf16_over_file": dense_bytes / info.file_bytes,
        "load_s": load_s,
        "first_step_s": step_s,
        "load_s_all": loads,
        "first_step_s_all": steps,
        "speedup": prefill_s / (load_s + step_s),
        "parts": info.parts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (real weights, float32) or a planner shape (qwen3-8b: random bf16)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=None, help="load + first step repeats (default 3 on CUDA, 1 on CPU)")
    parser.add_argument("--prefill-repeats", type=int, default=None, help="prefill runs per context (default 2 on CUDA, 1 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (3 if device.type == "cuda" else 1)
    prefill_repeats = args.prefill_repeats or (2 if device.type == "cuda" else 1)
    out = Path(args.out) / f"bench_cache_io_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)",
        "torch": torch.__version__,
        "host": platform.node(),
        "command": " ".join(["python benchmarks/bench_cache_io.py"] + sys.argv[1:]),
        "preset": PRESET,
        "model": args.model,
    }
    started = time.time()
    sections = {}

    def write(complete=False):
        out.write_text(json.dumps(dict(header, seconds=round(time.time() - started, 1), complete=complete, **sections), indent=2))

    with tempfile.TemporaryDirectory(prefix="bench_cache_io_") as folder:
        folder = Path(folder)
        if not args.skip_checks:
            print("checks:", flush=True)
            # A failed check, or one that raises, is recorded and printed; the timing still runs, so that one
            # device run gives both answers (read "checks_passed" before the timings).
            try:
                sections["checks"] = check(device, torch.float32, folder)
            except Exception:
                sections["checks"] = {"error": traceback.format_exc(limit=6)}
                print(sections["checks"]["error"], flush=True)
            # The graphed step runs Inductor's code for the layers around attention, the in-memory static cache
            # eager PyTorch: a near tie may fork their greedy tokens, so that comparison does not count here.
            sections["checks_passed"] = all(passed is True for name, passed in sections["checks"].items() if "graphed" not in name)
            print(f"checks passed: {sections['checks_passed']}", flush=True)
            write()
        print(f"building {args.model} on {device} ...", flush=True)
        model = patch_model(build_model(args.model, device), PRESET)
        time_context(model, 512, folder, 1, device)  # warm-up: kernels compile, allocators grow
        rows = sections.setdefault("rows", [])
        for context in args.contexts:
            row = time_context(model, context, folder, repeats, device, prefill_repeats)
            rows.append(row)
            print(
                f"  {context:>6} tokens: prefill {row['prefill_s']:.2f} s, load {row['load_s'] * 1e3:.1f} ms + first step "
                f"{row['first_step_s'] * 1e3:.1f} ms -> {row['speedup']:.1f}x; file {row['file_bytes']:,d} B "
                f"(memory_report {row['memory_report_total_bytes']:,d} B), bf16 DynamicCache file {row['bf16_file_bytes']:,d} B "
                f"({row['bf16_over_file']:.2f}x)",
                flush=True,
            )
            write()
    write(complete=True)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
