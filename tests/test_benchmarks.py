"""The benchmarks' hand-built cache storage has the cache's current layout.

The GPU benchmarks build some storage tensors by hand; these tests run those set-ups on CPU, where
the ops are the PyTorch references, so a layout change that a benchmark missed fails here (a shape
error in the reference) instead of on the GPU.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402
import common  # noqa: E402

from pnmix_patch.kernels.decode_append import decode_append  # noqa: E402


def test_the_decode_append_check_builds_the_cache_layout():
    # On CPU the op is the reference, so both sides agree; what is checked is that the reference
    # accepts the check's storage through appends, flushes and an overflow.
    assert common.check_decode_append(torch.device("cpu")) == {"torch.bfloat16": True, "torch.float16": True}


@pytest.mark.parametrize("residual", [common.RESIDUAL // 2, common.RESIDUAL])
def test_the_append_benchmark_storage_takes_a_token_and_a_flush(residual):
    args = bench_attention.append_args(torch.device("cpu"), batch=2, tokens=2 * common.PRESETS["pnmix-1"].key_group_size)
    residual_len, key_codes_low, num_groups = args[8], args[10], args[16]
    residual_len.fill_(residual)
    decode_append(*args)
    flushed = residual == common.RESIDUAL
    assert residual_len.tolist() == [1 if flushed else residual + 1] * 2
    assert num_groups.tolist() == [int(flushed)] * 2
    assert bool(key_codes_low[:, :, 0].any()) == flushed
