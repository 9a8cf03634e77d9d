"""The method's reference fidelity setting (``docs/fidelity.md``), through this library's cache.

SmolLM2-135M-Instruct (float32, CPU), Hamlet excerpt (first 1,400 tokens), 200-token
prefill with exact attention, then 1,200 tokens teacher-forced one at a time through
the PN-Mix cache; compared with one full-precision forward pass.

    python benchmarks/fidelity_spec.py pnmix-1 kivi-2 [...]
    python benchmarks/fidelity_spec.py pnmix-1 --model FILE.gguf --device cuda --dtype bfloat16 --tag h200_bf16

Writes ``fidelity_spec_<preset>[_<tag>].json`` under ``--out`` (default ``benchmarks/results``). On CUDA
with fp16/bf16 the decode steps run the library's GPU kernels (the Gluon decode kernel where it
applies), so the same setting checks them on real weights against the CPU reference's figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from pnmix_patch.eval.evaluation import METHODS
from pnmix_patch.eval.fidelity import reference_logits, teacher_force
from pnmix_patch.eval.models import hamlet_text, load_model

VARIANTS = METHODS
"""Presets, selection-criteria variants, ablations, sweep points and transformers' own ``QuantizedCache``
(``hf-quanto-2`` ... ``hf-fp8``, the ``hf-quantized`` extra) of ``pnmix_patch.eval.evaluation``."""
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--prefill", type=int, default=200)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (the embedded model) or a .gguf file of it")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="", help="suffix of the JSON file names")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    ids = tokenizer(hamlet_text(), return_tensors="pt").input_ids[:, : args.tokens].to(args.device)
    reference = reference_logits(model, ids)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = (
        torch.cuda.get_device_name(ids.device)
        if ids.is_cuda
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    for name in args.variants:
        started = time.perf_counter()
        result = teacher_force(model, ids, VARIANTS[name], args.prefill, reference)
        result |= {
            "variant": name,
            "config": VARIANTS[name].__dict__,
            "tokens": ids.shape[1],
            "prefill": args.prefill,
            "seconds": round(time.perf_counter() - started, 1),
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit,
            "hardware": f"{device}, torch {torch.__version__}",
            "dtype": args.dtype,
        }
        (out / f"fidelity_spec_{name}{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(result, indent=2, default=str))
        print(
            f"{name}: top-1 {result['top1_agreement']:.3f}  KL {result['mean_kl']:.4g}  ppl {result['perplexity']:.1f} "
            f"(fp ppl {result['reference_perplexity']:.1f})  key bits {result['memory']['key_bits_per_element']:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
