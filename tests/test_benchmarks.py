"""The benchmarks' hand-built cache storage has the cache's current layout; the kernel profile's summary
reads Nsight Compute's CSV exports.

The GPU benchmarks build some storage tensors by hand; these tests run those set-ups on CPU, where
the ops are the PyTorch references, so a layout change that a benchmark missed fails here (a shape
error in the reference) instead of on the GPU.
"""

import csv
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402
import common  # noqa: E402
import profile_decode_kernel  # noqa: E402

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


def write_rows(path, rows):
    with path.open("w", newline="") as file:
        csv.writer(file, quoting=csv.QUOTE_ALL).writerows(rows)


def test_the_kernel_profile_summary_reads_ncu_csv_exports(tmp_path):
    stalls = ["stall_long_sb", "stall_short_sb", "stall_long_sb (Not Issued)"]
    columns = ["Address", "Source", profile_decode_kernel.SAMPLES, "Instructions Executed", *stalls]
    write_rows(tmp_path / "details_p.csv", [
        ["ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value"],
        ["0", "GPU Speed Of Light Throughput", "Duration", "us", "241.34"],
        ["0", "Compute Workload Analysis", "Issue Slots Busy", "%", "55.06"],
        ["0", "Launch Statistics", "Grid Size", "", "1,024"],
    ])  # fmt: skip
    write_rows(tmp_path / "sass_p.csv", [
        ["File Path", "/k.py"], ["Function Name", "k"], columns,
        ["0x10", "FMUL R1, R2, R3", "30", "100", "27", "3", "9"],
        ["0x20", "@P0 LOP3.LUT R4, R4, R5, RZ, 0xc0, !PT", "10", "300", "0", "10", "0"],
        ["0x30", "FMUL R6, R2, R3", "0", "100", "0", "0", "0"],
    ])  # fmt: skip
    write_rows(tmp_path / "lines_p.csv", [
        ["File Path", "/lib/standard.py"], ["Function Name", "k"], ["Line No", "Source", *columns],
        ["170", "return core.maximum(a, b)", "-", "-", "10", "300", "0", "10", "0"],
        ["File Path", "/k.py"], ["Function Name", "k"], ["Line No", "Source", *columns],
        ["7", "p = p * s", "-", "-", "30", "200", "27", "3", "9"],
        ["", "", "0x10", "FMUL R1, R2, R3", "30", "100", "27", "3", "9"],
    ])  # fmt: skip
    summary = profile_decode_kernel.summarize(tmp_path, "p")
    assert summary["metrics"] == {"duration": [241.34, "us"], "issue_slots_busy": [55.06, "%"], "grid_size": [1024.0, ""]}
    assert summary["stall_samples"] == 40 and summary["warp_instructions"] == 500
    assert summary["stall_reasons_percent"] == {"long_sb": 67.5, "short_sb": 32.5}
    assert [(o["opcode"], o["samples_percent"], o["instructions_percent"]) for o in summary["opcodes"]] == [
        ("FMUL", 75.0, 40.0),
        ("LOP3", 25.0, 60.0),
    ]
    assert summary["opcodes"][0]["top_stalls_percent"] == {"long_sb": 67.5, "short_sb": 7.5}
    assert [(line["line"], line["source"], line["samples_percent"]) for line in summary["lines"]] == [
        ("k.py:7", "p = p * s", 75.0),
        ("standard.py:170", "return core.maximum(a, b)", 25.0),
    ]
