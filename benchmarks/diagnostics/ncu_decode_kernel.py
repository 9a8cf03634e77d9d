"""Launch the Gluon split kernel (pnmix-1, bf16, Qwen3-8B head shape) a few times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_decode_split_kernel_mma --launch-skip 2 --launch-count 1 \
        --set full -o report python benchmarks/diagnostics/ncu_decode_kernel.py BATCH TOKENS

Three launches: the first two compile and warm up, ncu profiles the third.
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_attention import PRESETS, build_cache  # noqa: E402

from pnmix_patch.kernels.decode_attention_mma import mma_decode_attention  # noqa: E402

batch, tokens = int(sys.argv[1]), int(sys.argv[2])
args = build_cache(PRESETS[sys.argv[3] if len(sys.argv) > 3 else "pnmix-1"], batch, tokens, torch.bfloat16, "cuda")
for _ in range(3):
    mma_decode_attention(*args)
torch.cuda.synchronize()
print(f"launched batch {batch}, {tokens} tokens")
