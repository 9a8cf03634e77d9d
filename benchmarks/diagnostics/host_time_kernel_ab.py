"""Seventh session: host time of a compiled (reduce-overhead) PN-Mix decode call with this
repository's Gluon decode kernel and with the sixth session's (``git show
f8374f5:kernels/decode_attention_mma.py > benchmarks/diagnostics/previous_mma_kernel.py``), in one
process: tiny 36-layer Llama, bf16, static cache, 200 synchronized calls (median host time until
the call returns, median step), then a cProfile of 100 calls (top functions; how often Triton's
launcher ``JITFunction.run`` ran per call). Run from the repository root on a GPU:
python benchmarks/diagnostics/host_time_kernel_ab.py
"""
import cProfile, importlib.util, inspect, io, json, pstats, statistics, sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from pnmix_patch import new_cache, patch_model
import pnmix_patch.kernels.decode_attention as decode_attention

spec = importlib.util.spec_from_file_location("pnmix_patch.kernels.previous_mma_kernel", Path(__file__).with_name("previous_mma_kernel.py"))
previous = importlib.util.module_from_spec(spec)
previous.__package__ = "pnmix_patch.kernels"
spec.loader.exec_module(previous)
current = decode_attention._mma_kernel()
out = {}
for which, module in (("current", current), ("previous", previous), ("current again", current)):
    decode_attention._mma_kernel = lambda module=module: module
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    patch_model(model, "pnmix-1")
    cache = new_cache(model, 4096, static=True)
    torch._dynamo.reset()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 1024), device="cuda"), **{name: cache})
        step = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
        token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        for _ in range(10):
            step(input_ids=token, **{name: cache}); torch.cuda.synchronize()
        host, total = [], []
        for _ in range(200):
            torch.cuda.synchronize()
            t = time.perf_counter(); step(input_ids=token, **{name: cache}); h = time.perf_counter() - t
            torch.cuda.synchronize(); total.append((time.perf_counter() - t) * 1e3); host.append(h * 1e3)
        profiler = cProfile.Profile(); profiler.enable()
        for _ in range(100):
            step(input_ids=token, **{name: cache}); torch.cuda.synchronize()
        profiler.disable()
    stats = pstats.Stats(profiler)
    launches = sum(v[1] for k, v in stats.stats.items() if k[2] == "run" and "triton/runtime/jit.py" in k[0]) / 100
    text = io.StringIO(); pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    out[which] = {"host_ms_median": statistics.median(host), "step_ms_median": statistics.median(total),
                  "triton_launches_per_call": launches}
    print(which, out[which], flush=True)
    print(text.getvalue()[:4000], flush=True)
    del model, cache, step
    torch.cuda.empty_cache()
print(json.dumps(out))
