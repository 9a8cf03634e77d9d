"""Single-stream decoding on the GPU: compiled PN-Mix vs compiled bf16, ms per token, side by side.

    python benchmarks/bench_decode.py --model qwen3-8b [--model llama-3.1-8b] [--out DIR] [--skip-checks]
        [--contexts 1024 32768] [--compiled-only] [--profile] [--graphed [--paths graphed] [--no-pdl]] [--gemv]
    python benchmarks/bench_decode.py --model qwen3-8b --interleaved [--paths reduce-overhead graphed] ...

1. Checks (small, fast): the static cache's in-place flush + append op (Triton) against
   its PyTorch reference, bit-exact, on CUDA; a tiny patched Llama decoding greedily with
   the static cache compiled (``fullgraph=True, mode="reduce-overhead"``: CUDA graphs)
   against the same model eager on CPU (reference path): same tokens.
2. Timing: a randomly initialized bf16 model of the real shape (Qwen3-8B, Llama-3.1-8B;
   weights do not change the time), batch 1 (``--batch`` with ``--interleaved``), context 1K, 8K and 32K. Each variant runs
   in this process on the same model:

   - ``bf16-compiled-stock``: transformers ``StaticCache``, stock SDPA attention (which
     expands the KV heads, ``repeat_kv``), ``torch.compile(fullgraph, reduce-overhead)``;
   - ``bf16-compiled-fair``: the same static cache read by SDPA with ``enable_gqa=True``
     (no expanded copy), compiled the same way;
   - ``pnmix-compiled``: ``patch_model(model, "pnmix-1")`` + ``PNMixStaticCache``, compiled
     the same way;
   - ``pnmix-eager`` (the dynamic ``PNMixCache``) and ``bf16-eager`` (``DynamicCache``);
   - with ``--graphed``: ``bf16-graphed-fair`` and ``pnmix-graphed``, the same two caches and
     attentions as the fair bf16 and PN-Mix compiled variants, compiled without CUDA graphs and
     replayed by :class:`pnmix_patch.GraphedDecodeStep` (one captured graph, no guards or input
     gathering per call); ``--graphed --paths graphed`` times (and profiles) these rows only.

   Caches are brought to the context length synthetically (a 64-token prefill, then
   random keys/values or random codes and the lengths set on the device): decode time
   depends on lengths, not values, and a real 32K prefill through the reference
   prefill attention would not fit. The static bf16 cache is sized to the context plus
   the timed steps, as a user would size it. ms per token is the median of per-step
   CUDA-event times over the timed steps (graph replay + host launch).
   Bandwidth floor: (weight bytes + cache bytes read per step) / copy bandwidth
   measured in the same run (read + write bytes of a 2 GiB device copy).

Each row also has the host time of one call (guards, CUDA-graph replay: time until the call
returns; the median over the synchronized steps, and over 20 calls not synchronized) and the step
time when calls are not synchronized one by one.

``--interleaved`` times only the fair bf16 and PN-Mix compiled rows (of ``--paths``), their
synchronized steps taking turns of ``--turn`` steps in one loop, the first ``--untimed`` of each
turn not timed (two model instances, 100 timed steps each, ``--batch`` sequences per step, default 1;
see :func:`time_interleaved`): the rows timed one after the other let the host time of a
``reduce-overhead`` call drift between them by more than the difference being measured.

``--pdl-ab`` (with ``--interleaved --paths graphed``) also times each step replayed without programmatic dependent
launch (``GraphedDecodeStep(..., pdl=False)``: neither the library's kernels nor Inductor's), compiled anew, the four
graphs taking turns. The graphed rows otherwise use :class:`~pnmix_patch.GraphedDecodeStep`'s default: PDL on GPUs of
compute capability 9.0 and up.

``--gemv`` routes every variant's one-token linear products (bf16's too, so the ratios stay fair) through
``pnmix::gemv`` (:func:`pnmix_patch.patch_gemv`), for the bandwidth floor: the floor is mostly weights.
The MLP's gate, up and SiLU run in one launch (``pnmix::gemv_swiglu``) and q, k and v in another
(``pnmix::gemv_stacked``): PN-Mix's attention reads them so, and the bf16 variants get the same through
:class:`FusedProjections` (transformers' attention forward with the three products in one
launch). The checks then also compare each model's logits with and without these products on the GPU.

``--profile`` adds, for each compiled variant and context, where a step's GPU time goes:
the CUDA kernels of a few replayed steps (``torch.profiler``), µs per step for each,
grouped into attention (SDPA / PN-Mix ops and the cache update), matrix multiplies and
the rest. The profiles run after every row is timed, on the rows set up again: once the
profiler has traced CUDA activity, replaying a CUDA graph captured before it costs more host time,
so timing after a profile would be biased. Where the kernels launch with programmatic dependent
launch (the graphed rows on compute capability 9.0 and up), a kernel starts before the one ahead of
it ends and its time includes that wait: the kernels' times overlap, and their sum ("GPU busy")
exceeds the step's time.

Writes ``bench_decode_{models}[_{tag}].json`` under ``--out`` (default ``benchmarks/results``) after every timed row
(every context with ``--interleaved``), with ``"complete": false`` until the last: a run cut short keeps what it timed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import statistics
import sys
import time
import types
from pathlib import Path
from unittest import mock

import torch
import torch._inductor.config
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen3Config, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import pnmix_patch.kernels.common as kernels_common
import pnmix_patch.linear
from pnmix_patch import new_cache, patch_gemv, patch_model, unpatch_model
from pnmix_patch.mixins import RuntimeMixin, mixed_class, set_classes
from pnmix_patch.patches import get_patch
from pnmix_patch.patches.base import ArchitecturePatch
from pnmix_patch.planner import model_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PROMPT,
    STEPS,
    WARMUP,
    cache_arg,
    check_decode_append,
    copy_bandwidth,
    fill_bf16,
    fill_pnmix,
    gqa_sdpa,
    graphed_forward,
    prefill,
    report_writer,
    steps_taken,
    time_steps,
)

MODELS = ("qwen3-8b", "llama-3.1-8b")  # shapes of pnmix_patch.planner.MODEL_SHAPES
CONTEXTS = (1024, 8192, 32768)
INTERLEAVED_STEPS = 100  # timed steps of each variant with --interleaved
TURN = 10  # consecutive steps of one variant per turn with --interleaved (see time_steps)
UNTIMED_PER_TURN = 2  # steps after a switch not timed with --interleaved (see time_steps)
PIPELINED_CALLS = 20  # unsynchronized calls of pipelined_host_time
PATHS = ("reduce-overhead", "graphed")


class FusedProjections(RuntimeMixin):
    """Mixin of the attention modules of the bf16 rows under ``--gemv``: transformers' Llama and Qwen3 attention
    forward (same steps: projections, q/k norms for Qwen3, RoPE, cache update, the configured attention
    function, o_proj) with q, k and v projected as PN-Mix's attention projects them (the architecture
    adapter's ``project``: one ``pnmix::gemv_stacked`` launch at one token after ``patch_gemv``). A class,
    as ``patch_model`` gives PN-Mix's attention: the same guards per layer (:func:`fuse_projections`)."""

    prefix = "Fused"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        query, key, value = self._bench_adapter.project(self, hidden_states)
        query, key = self._bench_rotary(*self._bench_adapter.norms(self, query, key), *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._bench_eager_attention)
        output, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", None),
            **kwargs,
        )
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), None


def fuse_projections(model) -> None:
    """Make ``model``'s attention modules :class:`FusedProjections` (a class swap; ``patch_model`` puts
    PN-Mix's class in front of it, ``unpatch_model`` gives it back). Doing it again changes nothing."""
    adapter = get_patch(model.config.model_type)
    attentions = [module for module in model.modules() if type(module) is adapter.attention_type()]
    for module in attentions:
        module._bench_adapter, module._bench_rotary = adapter, adapter.rotary()
        module._bench_eager_attention = adapter.module.eager_attention_forward  # resolved here: Dynamo cannot trace the import
    set_classes((module, mixed_class(FusedProjections, type(module))) for module in attentions)


# ---------------------------------------------------------------------------- checks
def check_fair_attention(device) -> float:
    """SDPA with ``enable_gqa`` against transformers' stock SDPA path (repeat_kv): max abs difference."""
    query = torch.randn(2, 32, 1, 128, device=device, dtype=torch.bfloat16)
    key, value = torch.randn(2, 2, 8, 300, 128, device=device, dtype=torch.bfloat16).unbind(1)
    mask = torch.arange(300, device=device)[None, None, None, :] < torch.tensor([300, 170], device=device)[:, None, None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 4, True, False
    fair, _ = gqa_sdpa(module, query, key, value, mask, scaling=128**-0.5)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=128**-0.5)
    difference = (fair.float() - stock.float()).abs().max().item()
    print(f"  enable_gqa SDPA vs stock SDPA: max abs difference {difference:.2e}", flush=True)
    return difference


def check_compiled_tiny_model(device) -> dict:
    """Greedy tokens of a tiny patched Llama: static cache compiled on CUDA vs eager on CPU."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    patch_model(model, "pnmix-1")
    prompt = torch.randint(0, 256, (2, 100))
    steps = 600  # crosses four flushes
    name = cache_arg(model)

    def greedy(forward, cache, device):
        with torch.no_grad():
            logits = [model(input_ids=prompt.to(device), **{name: cache}).logits[:, -1]]
            tokens = [logits[-1].argmax(-1, keepdim=True)]
            for _ in range(steps):
                logits.append(forward(input_ids=tokens[-1], **{name: cache}).logits[:, -1].clone())
                tokens.append(logits[-1].argmax(-1, keepdim=True))
        return torch.cat(tokens, 1).cpu(), torch.stack(logits, 1).float().cpu()

    cpu_tokens, cpu_logits = greedy(model.forward, new_cache(model), "cpu")
    model.to(device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
    gpu_tokens, gpu_logits = greedy(compiled, new_cache(model, 100 + steps + 1, static=True), device)
    differ = (gpu_tokens != cpu_tokens).any(0).nonzero()
    first_difference = int(differ[0]) if len(differ) else steps + 1
    # Up to the first differing token both runs saw the same inputs: their logits must agree.
    same_inputs = slice(0, first_difference + 1)
    result = {
        "steps": steps,
        "identical": first_difference > steps,
        "first_differing_step": first_difference,
        "max_abs_logit_difference_before_it": (gpu_logits[:, same_inputs] - cpu_logits[:, same_inputs]).abs().max().item(),
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }
    print(f"  tiny Llama, static cache compiled on CUDA vs eager CPU: {result}", flush=True)
    return result


def check_gemv_products(device) -> dict:
    """Tiny bf16 Llama and Qwen3 models on the GPU, a 100-token prefill then 30 decode steps fed the
    same random tokens: logits with ``patch_gemv`` (+ :func:`fuse_projections` for the model's own
    attention) against the same model without it (cuBLAS), for the model's attention and for PN-Mix.
    Counts the fused ops' calls, so a fallback to ``F.linear`` cannot pass unseen."""
    calls = {"gemv_stacked": 0, "gemv_swiglu": 0}

    def counting(name):
        op = getattr(pnmix_patch.linear, name)
        return lambda *args: calls.__setitem__(name, calls[name] + 1) or op(*args)

    shapes = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    )
    tokens = torch.randint(0, 256, (1, 130), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    with contextlib.ExitStack() as stack:
        for name in calls:
            stack.enter_context(mock.patch.object(pnmix_patch.linear, name, counting(name)))
        for config, variant in itertools.product((LlamaConfig(**shapes), Qwen3Config(**shapes)), ("own-attention", "pnmix")):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
            if variant == "pnmix":
                patch_model(model, "pnmix-1")

            def decode_logits():
                cache = new_cache(model) if variant == "pnmix" else DynamicCache(config=model.config)
                with torch.no_grad():
                    model(input_ids=tokens[:, :100], **{cache_arg(model): cache})
                    return torch.cat(
                        [model(input_ids=tokens[:, i : i + 1], **{cache_arg(model): cache}).logits[0].float() for i in range(100, 130)]
                    )

            want = decode_logits()
            patch_gemv(model)
            if variant == "own-attention":
                fuse_projections(model)
            before = dict(calls)
            got = decode_logits()
            used = {name: calls[name] - before[name] for name in calls}
            result = {
                "max_abs_logit_difference": (got - want).abs().max().item(),
                "logit_scale": want.abs().max().item(),
                "same_argmax_fraction": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
                "fused_calls": used,
            }
            print(f"  patch_gemv vs cuBLAS, tiny {config.model_type} bf16, {variant}: {result}", flush=True)
            if not all(used.values()):
                raise AssertionError(f"{config.model_type} {variant}: the fused ops were not called: {used}")
            if result["max_abs_logit_difference"] > 0.05 * result["logit_scale"] or result["same_argmax_fraction"] < 1:
                raise AssertionError(f"{config.model_type} {variant}: patch_gemv's logits differ from cuBLAS's: {result}")
            results[f"{config.model_type}-{variant}"] = result
            del model
    return results


# ---------------------------------------------------------------------------- timing


def kernel_category(kernel: str) -> str:
    """Coarse class of a CUDA kernel name in a decode step."""
    name = kernel.lower()
    if any(k in name for k in ("_decode_split", "merge_splits", "_append_token", "_pack_keys", "_pack_values")):
        return "pnmix attention + cache update"
    if any(k in name for k in ("flash", "fmha", "attention", "sdpa", "index_copy", "index_put", "scatter")):
        return "bf16 attention + cache update"
    if any(k in name for k in ("gemm", "gemv", "cublas", "cutlass", "sm90_xmma", "nvjet", "splitk")):
        return "matrix multiplies"
    return "other"


def pipelined_host_time(forward, model, cache, name, calls=PIPELINED_CALLS, batch=1) -> dict:
    """Host cost of a call: launch-only time per call, and the step time when calls are not
    synchronized one by one (the GPU then hides the host work if it is shorter)."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        torch.cuda.synchronize()
        host, started = 0.0, time.perf_counter()
        for _ in range(calls):
            call = time.perf_counter()
            forward(input_ids=token, **{name: cache})
            host += time.perf_counter() - call
        torch.cuda.synchronize()
    pipelined = (time.perf_counter() - started) / calls
    print(f"    host time per call {host / calls * 1e6:8.1f} us; unsynchronized steps {pipelined * 1e6:8.1f} us each", flush=True)
    return {"host_us_per_call": host / calls * 1e6, "unsynchronized_us_per_step": pipelined * 1e6}


def profile_steps(forward, model, cache, name, steps=5) -> dict:
    """GPU time of ``steps`` decode steps by kernel: µs per step, largest first, and by category."""
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        for _ in range(3):
            forward(input_ids=token, **{name: cache})
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(steps):
                forward(input_ids=token, **{name: cache})
            torch.cuda.synchronize()
    kernels = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total / steps
            entry[1] += 1
    rows = sorted(
        (
            {"kernel": k[:120], "us_per_step": t, "launches_per_step": n / steps, "category": kernel_category(k)}
            for k, (t, n) in kernels.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    categories = {}
    for row in rows:
        total = categories.setdefault(row["category"], {"us_per_step": 0.0, "launches_per_step": 0.0})
        total["us_per_step"] += row["us_per_step"]
        total["launches_per_step"] += row["launches_per_step"]
    busy = sum(r["us_per_step"] for r in rows)
    print(
        f"    GPU busy {busy:8.1f} us/step in {sum(r['launches_per_step'] for r in rows):.0f} launches; "
        + "; ".join(f"{c}: {v['us_per_step']:.1f} us ({v['launches_per_step']:.0f})" for c, v in categories.items()),
        flush=True,
    )
    return {"gpu_busy_us_per_step": busy, "categories": categories, "top_kernels": rows[:25]}


def timing_row(model_name, variant, context, timed, weight_bytes, cache_bytes, bandwidth, pipelined, batch=1, **extra) -> dict:
    """One row of the report from :func:`time_steps`' ``timed`` (medians) and :func:`pipelined_host_time`
    (``ms_per_token``: ms per step, one token of each of ``batch`` sequences)."""
    ms = statistics.median(timed["ms"])
    floor = (weight_bytes + cache_bytes) / bandwidth * 1e3
    print(
        f"  {model_name} {variant:20s} T={context:6d}: {ms:7.3f} ms/{'token' if batch == 1 else 'step'}  floor "
        f"{floor:6.3f} ms ({floor / ms:5.1%})",
        flush=True,
    )
    return {
        "model": model_name,
        "variant": variant,
        "context": context,
        "batch": batch,
        "ms_per_token": ms,
        "tokens_per_s": batch * 1e3 / ms,
        "weight_bytes": weight_bytes,
        "cache_bytes_read": cache_bytes,
        "bandwidth_floor_ms": floor,
        "fraction_of_floor": floor / ms,
        "synchronized_host_us_per_call": statistics.median(timed["host_us"]),
        **pipelined,
        **extra,
    }


def random_model(model_name: str, device, gemv: bool = False):
    """A randomly initialized bf16 model of the named shape (its linear layers' one-token products
    through ``pnmix::gemv`` when ``gemv``: :func:`pnmix_patch.patch_gemv`), and the bytes of the
    weights a decode step reads (all but the embedding table)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(model_name), dtype=torch.bfloat16).eval()
    if gemv:
        patch_gemv(model)
        fuse_projections(model)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return model, weight_bytes


def time_model(
    model_name: str,
    device,
    bandwidth: float,
    contexts=CONTEXTS,
    compiled_only=False,
    profile=False,
    graphed=False,
    gemv=False,
    paths=PATHS,
    timed_so_far=lambda rows: None,
    graphed_pdl=None,
) -> list[dict]:
    """Every variant's rows for ``model_name``, one after the other (module docstring); the
    ``reduce-overhead`` compiled rows only where ``paths`` has that path. ``timed_so_far(rows)`` is called
    after each row is timed (and each is profiled), with the rows so far. ``graphed_pdl``: the graphed
    rows' ``GraphedDecodeStep(..., pdl=...)`` (False: captured without programmatic dependent launch)."""
    reduce_overhead = "reduce-overhead" in paths
    model, weight_bytes = random_model(model_name, device, gemv)
    name = cache_arg(model)
    rows, inductor = [], {}

    def compiled_forward():
        torch._dynamo.reset()
        return torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")

    def runs(profiling=False):
        """Each timed row's (variant, context, forward, cache, cache bytes read per step), set up in
        turn; a row's storage is freed when the next is asked for, once the caller has dropped its
        references. ``profiling``: the compiled rows only, the inductor counters left as timed."""
        # bf16, transformers StaticCache: stock and fair attention, one compile per static size.
        variants = (("bf16-compiled-fair", "sdpa_gqa"),) if reduce_overhead else ()
        variants += (("bf16-compiled-stock", "sdpa"),) if reduce_overhead and not compiled_only else ()
        variants += (("bf16-graphed-fair", "sdpa_gqa"),) if graphed else ()
        for variant, attention in variants:
            model.set_attn_implementation(attention)
            for context in contexts if variant.endswith("fair") else contexts[-1:]:
                cache = StaticCache(config=model.config, max_cache_len=context + WARMUP + STEPS + PROMPT)
                prefill(model, cache, name)
                cache_bytes = fill_bf16(cache, context)
                forward = graphed_forward(model, cache, pdl=graphed_pdl) if "graphed" in variant else compiled_forward()
                yield variant, context, forward, cache, cache_bytes
                del cache, forward
                torch.cuda.empty_cache()
        model.set_attn_implementation("sdpa")
        for context in () if compiled_only or profiling else contexts:
            cache = DynamicCache(config=model.config)
            prefill(model, cache, name)
            cache_bytes = fill_bf16(cache, context)  # before timing: the steps must see the context
            yield "bf16-eager", context, model.forward, cache, cache_bytes
            del cache
        # PN-Mix: one static size for all contexts (the kernels read only the valid lengths).
        # One graph (or compile) serves every context: reset() keeps the addresses.
        patch_model(model, "pnmix-1")
        static = new_cache(model, max(contexts) + WARMUP + STEPS + PROMPT, static=True)
        prefill(model, static, name)
        forward = compiled_forward() if reduce_overhead else None
        counters.clear()
        pnmix_variants = (("pnmix-compiled",) if reduce_overhead else ()) + (("pnmix-graphed",) if graphed else ())
        for variant in pnmix_variants:
            if variant == "pnmix-graphed":
                forward = graphed_forward(model, static, pdl=graphed_pdl)
            for context in contexts:
                static.reset()
                prefill(model, static, name)
                yield variant, context, forward, static, fill_pnmix(static, context)
            if variant == "pnmix-compiled" and not profiling:
                inductor.update(counters["inductor"])  # CUDA-graph skips of reduce-overhead, if any
        del forward
        del static
        for context in () if compiled_only or profiling else contexts:
            cache = new_cache(model)
            prefill(model, cache, name)
            yield "pnmix-eager", context, model.forward, cache, fill_pnmix(cache, context)
            del cache
        unpatch_model(model)  # the attention's class before patch_model back (fused projections under --gemv)

    # Timing first, for every row, with no profiler yet in the process: once torch.profiler has
    # traced CUDA activity, replaying a CUDA graph costs more host time.
    for variant, context, forward, cache, cache_bytes in runs():
        (timed,) = time_steps([(forward, model, cache)], name)
        rows.append(
            timing_row(
                model_name, variant, context, timed, weight_bytes, cache_bytes, bandwidth, pipelined_host_time(forward, model, cache, name)
            )
        )
        timed_so_far(rows)
        del forward, cache  # so that the next row's setup can free this row's storage
    print(f"  inductor counters during PN-Mix compiled timing: {dict(inductor)}", flush=True)
    if profile:  # the same rows set up again, each compiled step's kernels profiled
        timed = {(row["variant"], row["context"]): row for row in rows}
        for variant, context, forward, cache, _ in runs(profiling=True):
            print(f"  profile {variant} T={context}", flush=True)
            timed[variant, context]["profile"] = profile_steps(forward, model, cache, name)
            timed_so_far(rows)
            del forward, cache
    del model
    torch.cuda.empty_cache()
    return rows


def own_forward(model) -> None:
    """Give ``model`` an instance ``forward`` whose code object is its own. Dynamo keeps compiled
    entries per code object and checks them in turn: two models of one class compiled side by side
    would each check the other's guards on every call, which a step compiled alone does not."""
    function = type(model).forward
    copy = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)  # keeps the signature (the cache argument's name)
    model.forward = types.MethodType(copy, model)


def time_interleaved(
    model_name: str,
    device,
    bandwidth: float,
    contexts=CONTEXTS,
    paths=PATHS,
    steps=INTERLEAVED_STEPS,
    turn=TURN,
    untimed=UNTIMED_PER_TURN,
    gemv=False,
    pdl_ab=False,
    rotation_ab=False,
    batch=1,
    timed_so_far=lambda rows: None,
) -> list[dict]:
    """The fair bf16 baseline and PN-Mix compiled the same way, their synchronized steps taking turns
    of ``turn`` steps, the first ``untimed`` of each not timed (:func:`time_steps`), for each path of
    ``paths`` and each context.
    :func:`time_model` times one row after the other, so a drift of the process's host time between
    rows moves its ratios (by up to 0.66 ms of a ``reduce-overhead`` call); here it falls on both.

    The variants are two model instances (three with ``rotation_ab``), so that the compiled steps live at once. Each compiled
    step has a code object of its own (:func:`own_forward`): one Dynamo entry, as after the reset that
    :func:`time_model` does before each compile. Automatic dynamic shapes are off, so bf16's step for
    a new static size compiles static, as it would alone. The PN-Mix row also has the ratio of the
    medians and the median of the per-turn ratios (of each turn's median).

    ``pdl_ab`` (graphed path only): each model's step is also compiled and captured without programmatic
    dependent launch (``GraphedDecodeStep(..., pdl=False)``, variants ``...-nopdl``); the four graphs take
    turns on the two caches (each replay advances its model's cache by a token), and each PDL row gets its
    ratio to the same model's row without PDL.

    ``rotation_ab``: a third model, PN-Mix with its decode steps' q/k norms and RoPE left to the compiled
    code (:func:`separate_rotation`; variants ``pnmix-...-separate-rope``), takes turns too; the PN-Mix
    rows get their ratio to it.

    ``batch``: sequences decoded per step (each cache filled to the same context).

    ``timed_so_far(rows)`` is called after each context's rows, with the rows so far."""
    bf16_model, weight_bytes = random_model(model_name, device, gemv)
    bf16_model.set_attn_implementation("sdpa_gqa")
    pnmix_models = [patch_model(random_model(model_name, device, gemv)[0], "pnmix-1") for _ in range(1 + rotation_ab)]
    if rotation_ab:
        separate_rotation(pnmix_models[1])
    name = cache_arg(bf16_model)
    settings = (True, False) if pdl_ab else (True,)
    steps_per_row = len(settings) * (steps_taken(steps, turn=turn, untimed=untimed) + PIPELINED_CALLS)
    statics = [new_cache(model, max(contexts) + PROMPT + steps_per_row, static=True) for model in pnmix_models]
    for model, static in zip(pnmix_models, statics):
        prefill(model, static, name, batch)
    rows = []

    def compiled_step(model, cache, path, pdl=True):
        own_forward(model)
        if path == "reduce-overhead":
            return torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
        return graphed_forward(model, cache, reset=False, pdl=None if pdl else False)

    pdl_capable = device.type == "cuda" and kernels_common.has_pdl(device.index or 0)  # compute capability 9.0+
    for path in paths:
        torch._dynamo.reset()
        variants = ("bf16-compiled-fair", "pnmix-compiled") if path == "reduce-overhead" else ("bf16-graphed-fair", "pnmix-graphed")
        pnmix_labels = [variants[1], f"{variants[1]}-separate-rope"][: len(pnmix_models)]
        pnmix_forwards = {}  # one step serves every context: reset() keeps the cache's addresses
        for context in contexts:
            bf16_cache = StaticCache(config=bf16_model.config, max_cache_len=context + PROMPT + steps_per_row)
            prefill(bf16_model, bf16_cache, name, batch)
            bf16_bytes = fill_bf16(bf16_cache, context)
            for model, static in zip(pnmix_models, statics):
                static.reset()
                prefill(model, static, name, batch)
                pnmix_bytes = fill_pnmix(static, context)
            runs, labels, cache_bytes, launches, baselines = [], [], [], [], []
            for pdl in settings:
                suffix = "" if pdl else "-nopdl"
                bf16_forward = compiled_step(bf16_model, bf16_cache, path, pdl)  # a new compile per static size
                baselines += [len(runs)] * (1 + len(pnmix_models))
                runs.append((bf16_forward, bf16_model, bf16_cache))
                for index, (model, static) in enumerate(zip(pnmix_models, statics)):
                    if (pdl, index) not in pnmix_forwards:
                        pnmix_forwards[pdl, index] = compiled_step(model, static, path, pdl)
                    runs.append((pnmix_forwards[pdl, index], model, static))
                labels += [variants[0] + suffix] + [label + suffix for label in pnmix_labels]
                cache_bytes += [bf16_bytes] + [pnmix_bytes] * len(pnmix_models)
                # How this row's kernels launched: the library's with PDL or not, Inductor's likewise.
                graphed_pdl = pdl_capable and pdl
                launch = {
                    "library_pdl": graphed_pdl if path == "graphed" else pdl_capable and kernels_common.PDL,
                    "inductor_pdl": graphed_pdl
                    if path == "graphed"
                    else pdl_capable and bool(getattr(torch._inductor.config.triton, "enable_pdl", False)),
                }
                launches += [launch] * (1 + len(pnmix_models))
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                timed = time_steps(runs, name, steps=steps, turn=turn, untimed=untimed, batch=batch)
                pipelined = [pipelined_host_time(*run, name, batch=batch) for run in runs]
            group = [
                timing_row(
                    model_name,
                    variant,
                    context,
                    variant_timed,
                    weight_bytes,
                    variant_bytes,
                    bandwidth,
                    variant_pipelined,
                    batch,
                    interleaved=True,
                    turn=turn,
                    untimed_per_turn=untimed,
                    host_us_median_by_turn_position=[statistics.median(h) if h else math.nan for h in variant_timed["host_us_by_position"]],
                    **launch,
                )
                for variant, variant_timed, variant_bytes, variant_pipelined, launch in zip(labels, timed, cache_bytes, pipelined, launches)
            ]
            turn_ms = [[statistics.median(t["ms"][i] for i in indices) for indices in t["turns"]] for t in timed]

            def ratios(index, baseline, key):
                group[index][f"ratio_to_{key}_of_medians"] = group[index]["ms_per_token"] / group[baseline]["ms_per_token"]
                group[index][f"ratio_to_{key}_median_of_turns"] = statistics.median(
                    a / b for a, b in zip(turn_ms[index], turn_ms[baseline])
                )
                print(
                    f"  {model_name} {path} T={context}: {group[index]['variant']} / {group[baseline]['variant']} "
                    f"{group[index][f'ratio_to_{key}_of_medians']:.3f} (median of {len(turn_ms[index])} turns' ratios "
                    f"{group[index][f'ratio_to_{key}_median_of_turns']:.3f})",
                    flush=True,
                )

            for index, baseline in enumerate(baselines):
                if index != baseline:
                    ratios(index, baseline, "bf16")
            if rotation_ab:
                for index in range(1, len(group), len(group) // len(settings)):
                    ratios(index, index + 1, "separate_rope")
            for index in range(len(group) // 2 if pdl_ab else 0):
                ratios(index, index + len(group) // 2, "nopdl")
            for row in group:
                print(
                    f"    host time by step of a turn, {row['variant']} (us): "
                    + " ".join(f"{h:.0f}" for h in row["host_us_median_by_turn_position"]),
                    flush=True,
                )
            rows += group
            timed_so_far(rows)
            del bf16_forward, bf16_cache, runs
            torch.cuda.empty_cache()
    return rows


class _SeparateRotation(ArchitecturePatch):
    """An architecture adapter whose decode steps leave the q/k norms and RoPE to the compiled code."""

    def kernel_norms(self, attention):
        return None


def separate_rotation(model) -> None:
    """Make a PN-Mix patched ``model``'s decode steps run the q/k norms and RoPE as the prefill does (the
    modules' own code, compiled by Inductor) and append with ``pnmix::decode_append``: the step before
    ``pnmix::decode_rotate_append`` did both in the append kernel, for ``--rotation-ab``."""
    for module in model.modules():
        adapter = getattr(module, "_pnmix_adapter", None)
        if adapter is not None:
            module._pnmix_adapter = _SeparateRotation(**dataclasses.asdict(adapter))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS, required=True)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="default: 1024 8192 32768")
    parser.add_argument("--compiled-only", action="store_true", help="only bf16-compiled-fair and pnmix-compiled")
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of the compiled steps")
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="without --interleaved: the graphed rows captured without PDL (a --profile whose kernel times do not overlap)",
    )
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="also bf16-graphed-fair and pnmix-graphed: the same compiled steps replayed by GraphedDecodeStep",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help=f"only the fair bf16 and PN-Mix compiled rows of --paths, their steps taking turns ({INTERLEAVED_STEPS} timed steps each)",
    )
    parser.add_argument("--turn", type=int, default=TURN, help=f"with --interleaved: steps per turn (default {TURN})")
    parser.add_argument(
        "--untimed",
        type=int,
        default=None,
        help=f"with --interleaved: steps run but not timed at the start of each turn (default {UNTIMED_PER_TURN}, 0 with --turn 1)",
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(PATHS),
        help="the compiled paths timed (default: both); without --interleaved, graphed rows need --graphed",
    )
    parser.add_argument(
        "--gemv",
        action="store_true",
        help="every variant's linear layers through pnmix::gemv at one token (pnmix_patch.patch_gemv), bf16's too",
    )
    parser.add_argument(
        "--pdl-ab",
        action="store_true",
        help="with --interleaved --paths graphed: each step also compiled and captured without PDL (pdl=False)",
    )
    parser.add_argument(
        "--rotation-ab",
        action="store_true",
        help="with --interleaved: also PN-Mix with the decode steps' q/k norms and RoPE compiled by Inductor (not in the append kernel)",
    )
    parser.add_argument("--batch", type=int, default=1, help="with --interleaved: sequences per decode step (default 1)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name (after one '_'; leading ones are dropped)")
    args = parser.parse_args()
    if min(args.contexts) <= PROMPT:
        parser.error(f"--contexts {args.contexts}: allowed lengths above the {PROMPT}-token prefill")
    if args.interleaved and (args.profile or args.graphed or args.compiled_only):
        parser.error("--interleaved times its own rows (--paths): allowed without --profile, --graphed and --compiled-only")
    if not args.interleaved and args.paths == ["graphed"] and not args.graphed:
        parser.error("--paths graphed without --interleaved: allowed only with --graphed (it adds the graphed rows)")
    if args.pdl_ab and (not args.interleaved or args.paths != ["graphed"]):
        parser.error("--pdl-ab: allowed only with --interleaved --paths graphed")
    if args.no_pdl and (args.interleaved or not args.graphed):
        parser.error("--no-pdl: allowed only with --graphed and without --interleaved (there: --pdl-ab)")
    if args.rotation_ab and not args.interleaved:
        parser.error("--rotation-ab: allowed only with --interleaved")
    if args.batch < 1 or args.batch != 1 and not args.interleaved:
        parser.error(f"--batch {args.batch}: allowed 1 or more, and other than 1 only with --interleaved")
    if (args.turn != TURN or args.untimed is not None) and not args.interleaved:
        parser.error("--turn and --untimed: allowed only with --interleaved")
    if args.untimed is None:
        args.untimed = UNTIMED_PER_TURN if args.turn > UNTIMED_PER_TURN else 0
    if args.turn < 1 or not 0 <= args.untimed < args.turn:
        parser.error(f"--turn {args.turn} --untimed {args.untimed}: allowed a turn of 1 step or more, and 0 to turn - 1 untimed")
    device = torch.device("cuda")
    tag = args.tag.lstrip("_")
    write = report_writer(args.out, f"bench_decode_{'_'.join(args.model)}{f'_{tag}' if tag else ''}.json", "benchmarks/bench_decode.py")
    checks = {}
    if not args.skip_checks:
        print("checks", flush=True)
        checks = {
            "fair_attention_max_abs_difference": check_fair_attention(device),
            "decode_append": check_decode_append(device),
            "tiny_model": check_compiled_tiny_model(device),
        } | ({"gemv_products": check_gemv_products(device)} if args.gemv else {})
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    sections = {
        "copy_bandwidth_GB_per_s": bandwidth / 1e9,
        "gemv": args.gemv,
        "library_pdl_default": kernels_common.PDL,
        "inductor_pdl_default": getattr(torch._inductor.config.triton, "enable_pdl", None),
        "graphed_pdl_default": kernels_common.has_pdl(device.index or 0),  # GraphedDecodeStep's (graphed rows)
        "graphed_pdl": kernels_common.has_pdl(device.index or 0) and not args.no_pdl,  # the graphed rows without --interleaved
        "checks": checks,
    }
    rows = []  # the models timed so far; the report is rewritten after every row (or context, interleaved)

    def timed_so_far(model_rows):
        write(timings=rows + model_rows, **sections)

    for model_name in args.model:
        if args.interleaved:
            rows += time_interleaved(
                model_name,
                device,
                bandwidth,
                tuple(args.contexts),
                tuple(args.paths),
                turn=args.turn,
                untimed=args.untimed,
                gemv=args.gemv,
                pdl_ab=args.pdl_ab,
                rotation_ab=args.rotation_ab,
                batch=args.batch,
                timed_so_far=timed_so_far,
            )
        else:
            rows += time_model(
                model_name,
                device,
                bandwidth,
                tuple(args.contexts),
                args.compiled_only,
                args.profile,
                args.graphed,
                args.gemv,
                tuple(args.paths),
                timed_so_far,
                graphed_pdl=False if args.no_pdl else None,
            )
    write(complete=True, timings=rows, **sections)


if __name__ == "__main__":
    main()
