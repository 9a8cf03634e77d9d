"""Throwaway (fourth session), kept as it ran on the H200: host time of one compiled
(reduce-overhead) decode call of a tiny 36-layer Llama, bf16 StaticCache vs the PN-Mix static
cache, with a cProfile of 100 calls. Run from the repository root: python benchmarks/diagnostics/host_time_profile.py
"""
import cProfile, inspect, io, pstats, statistics, sys, time, json, os
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache
from pnmix_patch import new_cache, patch_model
out = {}
for which in ("bf16", "pnmix"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=36,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    if which == "pnmix":
        patch_model(model, "pnmix-1"); cache = new_cache(model, 1024, static=True)
    else:
        cache = StaticCache(config=model.config, max_cache_len=1024)
    torch._dynamo.reset()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 64), device="cuda"), **{name: cache})
        step = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
        token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        for _ in range(10):
            step(input_ids=token, **{name: cache}); torch.cuda.synchronize()
        host, total = [], []
        for _ in range(200):
            torch.cuda.synchronize()
            t = time.perf_counter(); step(input_ids=token, **{name: cache}); h = time.perf_counter() - t
            torch.cuda.synchronize(); total.append((time.perf_counter() - t) * 1e3); host.append(h * 1e3)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(100):
            step(input_ids=token, **{name: cache}); torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    out[which] = {"host_ms_median": statistics.median(host), "step_ms_median": statistics.median(total)}
    print(which, out[which], flush=True)
    print(s.getvalue()[:6000], flush=True)
    del model, cache, step; torch.cuda.empty_cache()
open(os.path.join(os.environ.get("OUT", "/tmp"), "hostgpu.json"), "w").write(json.dumps(out))
