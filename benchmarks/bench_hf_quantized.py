"""transformers' own quantized KV cache against bf16 and PN-Mix on the GPU: ms per decode token and cache memory.

    python benchmarks/bench_hf_quantized.py [--out DIR] [--shapes 1x8192 1x32768 8x8192] [--variants ...]

One process, a randomly initialized bf16 model of Qwen3-8B's shape (weights do not change the time),
batch 1 at 8K and 32K tokens of context and batch 8 at 8K. Variants, each on the same model:

- ``bf16-eager``: unpatched model, transformers ``DynamicCache`` (what ``generate`` uses by default);
- ``bf16-compiled``: unpatched model, ``StaticCache`` sized to the row, ``torch.compile(fullgraph=True,
  mode="reduce-overhead")`` (``generate(cache_implementation="static")`` compiled);
- ``hf-quanto-2``, ``hf-hqq-2``: unpatched model, transformers' ``QuantizedCache`` (2 bits, group 64,
  residual 128; quanto along axis 0, HQQ along axis 1, as transformers documents them), eager: its
  only path;
- ``pnmix-eager``: ``patch_model(model, "pnmix-1")``, the dynamic ``PNMixCache``;
- ``pnmix-graphed``: the same with a ``PNMixStaticCache`` sized to the row, replayed by
  ``GraphedDecodeStep``.

Caches are brought to the context synthetically after a 64-token prefill (random keys and values;
the quantized cache quantizes them with its own ``_quantize``, PN-Mix gets random codes): decode time
does not depend on the values. ms per token: per-step CUDA-event times of synchronized steps, each
step one token of every sequence. ``QuantizedCache`` dequantizes its whole history every step and
re-quantizes it whenever its 128-token residual fills, so its rows time one full residual cycle
(128 steps from an empty residual: 127 plain steps and one re-quantization): ``ms_per_token`` is
the mean over the cycle, with the plain steps' median and the re-quantizing step apart. ``growth``
times, at more contexts, a few steps around one re-quantization (batch 1).

Memory: ``cache_bytes`` read from the tensors each cache holds (``quantized_cache_memory`` for the
quantized cache, ``memory_report`` for PN-Mix, the key and value buffers for bf16) and
``peak_over_weights_bytes``: the peak allocated during the timed steps minus what was allocated
before the row's cache was built (the weights, ``allocated_before_row_bytes``), so it includes what a
step allocates on top of the cache (the dequantized copy of the quantized cache).

Checks first (a tiny Qwen3 on the GPU): each quantized cache against a ``DynamicCache`` (top-1
agreement of 120 teacher-forced steps, the cache's length), its bits per element in bf16 read from
its tensors, and what ``torch.compile(fullgraph=True, mode="reduce-overhead")`` makes of 8 decode steps
through it (graphs compiled, CUDA-graph skips, or the error).

optimum-quanto and HQQ: imported if installed; otherwise installed from the wheels in ``.whl/`` of
the repository root (``pip install --no-deps --target /tmp/hfq .whl/*.whl``, then put on ``sys.path``):
``optimum_quanto-0.2.7``, ``hqq-0.2.8.post1``, ``termcolor`` (HQQ imports it) and ``ninja``. On CUDA, quanto
dequantizes through a C++/CUDA extension that it compiles on first use (needs ``nvcc`` and
``ninja``); where it cannot (no CUDA compiler), the script registers quanto's own PyTorch
implementation of the op (``optimum.quanto.library.unpack``) for CUDA, and the JSON says which ran.

Writes ``bench_hf_quantized[_TAG].json`` under ``--out`` (default ``benchmarks/results``; ``$OUT`` if set)
after every row.
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib
import os
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path("/tmp/hfq")


def ensure_backends() -> str:
    """Import optimum-quanto and HQQ, installing the carried wheels first if they are missing.
    Must run before transformers is imported (it looks the packages up once)."""
    try:
        import hqq.core.quantize  # noqa: F401
        import optimum.quanto  # noqa: F401

        return "installed"
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if not wheels:
        raise SystemExit(
            "optimum-quanto and hqq are not installed and .whl/ holds no wheels: on a machine with a registry run "
            "`pip download --no-deps -d .whl optimum-quanto==0.2.7 termcolor==3.3.0 ninja==1.13.2 && pip wheel --no-deps -w .whl hqq==0.2.8.post1` "
            "and carry .whl"
        )
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TARGET), *wheels], check=True)
    sys.path.insert(0, str(TARGET))
    os.environ["PATH"] = f"{TARGET / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"  # ninja, for quanto's CUDA extension
    importlib.invalidate_caches()
    import hqq.core.quantize  # noqa: F401
    import optimum.quanto  # noqa: F401

    return f"from wheels: {', '.join(Path(w).name for w in wheels)}"


BACKENDS = ensure_backends()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config, StaticCache  # noqa: E402

from pnmix_patch import new_cache, patch_model, unpatch_model  # noqa: E402
from pnmix_patch.eval.hf_quantized import HF_METHODS, quantized_cache_memory  # noqa: E402
from pnmix_patch.planner import model_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPT, cache_arg, fill_bf16, fill_pnmix, graphed_forward, prefill, report_writer, time_steps  # noqa: E402

SHAPES = ("1x8192", "1x32768", "8x8192")
VARIANTS = ("bf16-eager", "bf16-compiled", "hf-quanto-2", "hf-hqq-2", "pnmix-eager", "pnmix-graphed")
GROWTH_CONTEXTS = (2048, 4096, 8192, 16384, 32768)
WARMUP, STEPS = 5, 30


def quanto_unpack_path() -> str:
    """Which ``quanto::unpack`` serves CUDA tensors (its compiled extension where it builds, else the PyTorch
    implementation quanto registers for every device), checked against the CPU op. Returns what ran."""
    import optimum.quanto.library  # noqa: F401  (registers quanto::unpack)
    from torch.utils.cpp_extension import CUDA_HOME

    packed = torch.randint(0, 255, (64, 64), dtype=torch.uint8, device="cuda")
    same = torch.equal(torch.ops.quanto.unpack(packed, 2).cpu(), torch.ops.quanto.unpack(packed.cpu(), 2))
    return f"quanto::unpack on CUDA (CUDA compiler {'found' if CUDA_HOME else 'absent'}) equals the CPU op: {same}"


def tiny_model(device):
    config = Qwen3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()


@torch.no_grad()
def checks(device) -> dict:
    """Each quantized cache on a tiny Qwen3 against DynamicCache, its bits in bf16, and a fullgraph compile."""
    model = tiny_model(device)
    name = cache_arg(model)
    ids = torch.randint(0, 1024, (1, 64 + 120), device=device)
    results = {}
    for method in ("hf-quanto-2", "hf-hqq-2"):
        caches = {"dynamic": DynamicCache(config=model.config), method: HF_METHODS[method].new_cache(model)}
        top1 = {}
        for label, cache in caches.items():
            model(ids[:, :64], **{name: cache})
            top1[label] = torch.cat([model(ids[:, t : t + 1], **{name: cache}).logits[:, -1].argmax(-1) for t in range(64, ids.shape[1])])
        memory = quantized_cache_memory(caches[method])
        entry = {
            "top1_agreement_vs_dynamic": (top1[method] == top1["dynamic"]).float().mean().item(),
            "cache_length": caches[method].get_seq_length(),
            "expected_length": ids.shape[1],
            "key_bits_per_element": memory["key_bits_per_element"],
            "value_bits_per_element": memory["value_bits_per_element"],
            "bits_per_element_with_residual": memory["bits_per_element"],
        }
        try:  # compiled as a static-cache step is (CUDA graphs): the cache's tensors change shape every step
            from torch._dynamo.utils import counters

            cache = HF_METHODS[method].new_cache(model)
            model(ids[:, :64], **{name: cache})
            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
            for t in range(64, 72):
                step(input_ids=ids[:, t : t + 1], **{name: cache})
            entry["compiled_fullgraph_8_steps"] = {
                "graphs_compiled": counters["stats"].get("unique_graphs", 0),
                "cudagraph_skips": {key: value for key, value in counters["inductor"].items() if "cudagraph" in key},
            }
        except Exception as error:  # the answer is the error
            entry["compiled_fullgraph_8_steps"] = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        torch._dynamo.reset()
        results[method] = entry
        print(f"  check {method}: {entry}", flush=True)
        if entry["cache_length"] != entry["expected_length"]:
            raise SystemExit(f"{method}: the cache holds {entry['cache_length']} tokens, expected {entry['expected_length']}")
    return results


def fill_quantized(cache, context: int, residual: int = 0) -> int:
    """Bring a prefilled ``QuantizedCache`` to ``context`` tokens: ``context - residual`` random tokens
    quantized by each layer's own ``_quantize``, ``residual`` random tokens unquantized. Returns the stored bytes."""
    for layer in cache.layers:
        batch, heads, dim = _prefilled_shape(layer)
        dtype, device = layer.keys.dtype, layer.keys.device
        quantized = context - residual
        layer._quantized_keys = layer._quantize(torch.randn(batch, heads, quantized, dim, dtype=dtype, device=device), axis=layer.axis_key)
        layer._quantized_values = layer._quantize(
            torch.randn(batch, heads, quantized, dim, dtype=dtype, device=device), axis=layer.axis_value
        )
        layer.keys = torch.randn(batch, heads, residual, dim, dtype=dtype, device=device)
        layer.values = torch.randn_like(layer.keys)
        layer.cumulative_length = context
    return quantized_cache_memory(cache)["total_bytes"]


def _prefilled_shape(layer):
    """``(batch, heads, dim)`` of a layer whose prompt went straight into its quantized states."""
    state = layer._quantized_keys
    shape = state[1]["shape"] if isinstance(state, tuple) else state.shape
    return shape[0], shape[1], shape[3]


def summarize(ms: list[float], cycle: bool) -> dict:
    if not cycle:
        return {"ms_per_token": statistics.median(ms), "ms_steps": len(ms)}
    plain, requantize = ms[:-1], ms[-1]
    return {
        "ms_per_token": statistics.mean(ms),  # amortized over one residual cycle
        "ms_plain_step_median": statistics.median(plain),
        "ms_requantize_step": requantize,
        "ms_steps": len(ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BATCHxCONTEXT (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--growth", nargs="*", type=int, default=list(GROWTH_CONTEXTS), help="contexts of the growth rows")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name (runs split over several calls)")
    args = parser.parse_args()
    device = torch.device("cuda")
    write = report_writer(args.out, f"bench_hf_quantized{'_' + args.tag if args.tag else ''}.json", "benchmarks/bench_hf_quantized.py")
    report = {"backends": BACKENDS, "quanto_unpack": quanto_unpack_path(), "model": "qwen3-8b", "rows": [], "growth": []}
    import hqq
    import optimum.quanto
    import transformers

    report["versions"] = {"transformers": transformers.__version__, "optimum-quanto": optimum.quanto.__version__, "hqq": hqq.__version__}
    print(report["quanto_unpack"], flush=True)
    if not args.skip_checks:
        report["checks"] = checks(device)
        write(**report)

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config("qwen3-8b"), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    name = cache_arg(model)
    weights = torch.cuda.memory_allocated()
    report["weights_bytes"] = weights

    def row(variant, batch, context, forward, cache, stored, cycle=False, steps=STEPS, warmup=WARMUP):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        (timed,) = time_steps([(forward, model, cache)], name, warmup=warmup, steps=steps, batch=batch)
        peak = torch.cuda.max_memory_allocated() - before
        entry = {"variant": variant, "batch": batch, "context": context, **summarize(timed["ms"], cycle)}
        entry |= {"cache_bytes": stored, "peak_over_weights_bytes": peak, "allocated_before_row_bytes": before, "ms_all": timed["ms"]}
        print(f"  {variant:14s} batch {batch} T={context:6d}: {entry['ms_per_token']:8.3f} ms/token, cache {stored / 2**30:.3f} GiB, "
              f"peak over weights {peak / 2**30:.3f} GiB", flush=True)  # fmt: skip
        report["rows"].append(entry)
        write(**report)

    def fresh():
        gc.collect()
        torch.cuda.empty_cache()

    with torch.no_grad():
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            for variant in args.variants:
                fresh()
                before = torch.cuda.memory_allocated()  # the model (and anything a previous row left)
                try:
                    if variant == "bf16-eager":
                        cache = DynamicCache(config=model.config)
                        prefill(model, cache, name, batch)
                        row(variant, batch, context, model.forward, cache, fill_bf16(cache, context))
                    elif variant == "bf16-compiled":
                        cache = StaticCache(config=model.config, max_cache_len=context + WARMUP + STEPS + PROMPT)
                        prefill(model, cache, name, batch)
                        stored = fill_bf16(cache, context)
                        torch._dynamo.reset()
                        forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
                        row(variant, batch, context, forward, cache, stored)
                        del forward
                    elif variant.startswith("hf-"):
                        cache = HF_METHODS[variant].new_cache(model)
                        prefill(model, cache, name, batch)
                        fill_quantized(cache, context)
                        time_steps([(model.forward, model, cache)], name, warmup=0, steps=WARMUP, batch=batch)  # warm-up
                        stored = fill_quantized(cache, context)  # an empty residual: the timed steps are one cycle
                        residual = HF_METHODS[variant].residual_length
                        row(variant, batch, context, model.forward, cache, stored, cycle=True, steps=residual, warmup=0)
                    elif variant == "pnmix-eager":
                        patch_model(model, "pnmix-1")
                        cache = new_cache(model)
                        prefill(model, cache, name, batch)
                        fill_pnmix(cache, context)
                        row(variant, batch, context, model.forward, cache, cache.memory_report()["total_bytes"])
                    elif variant == "pnmix-graphed":
                        patch_model(model, "pnmix-1")
                        cache = new_cache(model, context + WARMUP + STEPS + PROMPT, static=True)
                        prefill(model, cache, name, batch)
                        fill_pnmix(cache, context)
                        forward = graphed_forward(model, cache)
                        row(variant, batch, context, forward, cache, cache.memory_report()["total_bytes"])
                        del forward
                except torch.cuda.OutOfMemoryError as error:
                    report["rows"].append({"variant": variant, "batch": batch, "context": context, "error": str(error).splitlines()[0]})
                    write(**report)
                    print(f"  {variant} batch {batch} T={context}: out of memory", flush=True)
                except Exception:
                    report["rows"].append({"variant": variant, "batch": batch, "context": context, "error": traceback.format_exc()[-2000:]})
                    write(**report)
                    traceback.print_exc()
                finally:
                    cache = None
                    if variant.startswith("pnmix"):
                        unpatch_model(model)
        # how the quantized cache's step grows with the context: 4 plain steps, then the re-quantization
        for method in [v for v in args.variants if v.startswith("hf-")]:
            residual = HF_METHODS[method].residual_length
            for context in args.growth:
                fresh()
                cache = HF_METHODS[method].new_cache(model)
                prefill(model, cache, name, 1)
                fill_quantized(cache, context, residual=residual - 5)
                (timed,) = time_steps([(model.forward, model, cache)], name, warmup=0, steps=5)
                entry = {"variant": method, "context": context, "ms_plain_steps": timed["ms"][:4], "ms_requantize_step": timed["ms"][4]}
                print(f"  growth {method} T={context}: plain {statistics.median(entry['ms_plain_steps']):.2f} ms, "
                      f"re-quantizing {entry['ms_requantize_step']:.2f} ms", flush=True)  # fmt: skip
                report["growth"].append(entry)
                write(**report)
                cache = None
    write(complete=True, **report)


if __name__ == "__main__":
    main()
