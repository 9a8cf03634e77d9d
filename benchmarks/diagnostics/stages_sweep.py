"""The Gluon decode kernel's shared stages and occupancy after the cache moved to operand order (GPU).

    OUT=DIR python benchmarks/diagnostics/stages_sweep.py

A short form of ``kernel_ab.py --variants`` (which also times every preset's errors first) for a
device call with little time left: pnmix-1, bf16, batch 32 / 32K, 8 / 16K and 1 / 32K, the
current kernel at (stages, register cap, split slots per multiprocessor) = the default (3, 128, 4,
timed first and last), 4 and 2 stages, and 96 registers with splits filling 5 slots. Each variant's
output is compared with the default's where the split count is the same (the arithmetic does not
depend on the stages or registers). Writes ``stages_sweep.json`` under ``$OUT``.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import KV_HEADS, PRESETS, build_cache, median_ms  # noqa: E402
from pnmix_patch.kernels import decode_attention_mma as mma  # noqa: E402
from pnmix_patch.kernels.decode_attention import _multiprocessors, _wave_filling_splits  # noqa: E402

out = {"rows": []}
sms = _multiprocessors(0)
for preset, batch, tokens in (("pnmix-1", 32, 32768), ("pnmix-1", 8, 16384), ("pnmix-1", 1, 32768)):
    cache = build_cache(PRESETS[preset], batch, tokens, torch.bfloat16, torch.device("cuda"))
    want = mma.mma_decode_attention(*cache)
    for stages, registers, slots in ((3, 128, 4), (4, 128, 4), (3, 96, 5), (2, 128, 4), (3, 128, 4)):
        splits = _wave_filling_splits(slots * sms, batch * KV_HEADS, cache[5].shape[2])
        def run():
            return mma.mma_decode_attention(*cache, num_splits=splits, max_registers=registers, stages=stages)

        same = bool(torch.equal(run(), want)) if slots == 4 else None
        row = dict(preset=preset, batch=batch, context=tokens, stages=stages, registers=registers, slots=slots,
                   splits=splits, us=median_ms(run) * 1e3, identical_to_default=same)  # fmt: skip
        out["rows"].append(row)
        print(row, flush=True)
    del cache
Path(os.environ["OUT"], "stages_sweep.json").write_text(json.dumps(out, indent=1))
