"""The fidelity setting of ``shared/PNMIX_SPEC.md`` section 7, through this library's cache.

SmolLM2-135M-Instruct (float32, CPU), Hamlet excerpt (first 1,400 tokens), 200-token
prefill with exact attention, then 1,200 tokens teacher-forced one at a time through
the PN-Mix cache; compared with one full-precision forward pass.

    python benchmarks/fidelity_spec.py pnmix-1 kivi-2 [...]

Writes ``benchmarks/results/fidelity_spec_<preset>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from pnmix_patch.evaluation import METHODS
from pnmix_patch.fidelity import reference_logits, teacher_force
from pnmix_patch.models import hamlet_text, load_model

VARIANTS = METHODS
"""Presets, selection-criteria variants, ablations and sweep points (``pnmix_patch.evaluation``)."""
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--prefill", type=int, default=200)
    args = parser.parse_args()
    model, tokenizer = load_model()
    ids = tokenizer(hamlet_text(), return_tensors="pt").input_ids[:, : args.tokens]
    reference = reference_logits(model, ids)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    RESULTS.mkdir(exist_ok=True)
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
            "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        }
        (RESULTS / f"fidelity_spec_{name}.json").write_text(json.dumps(result, indent=2, default=str))
        print(
            f"{name}: top-1 {result['top1_agreement']:.3f}  KL {result['mean_kl']:.4g}  ppl {result['perplexity']:.1f} "
            f"(fp ppl {result['reference_perplexity']:.1f})  key bits {result['memory']['key_bits_per_element']:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
