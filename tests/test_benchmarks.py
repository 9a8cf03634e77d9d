"""The benchmarks' hand-built cache storage has the cache's current layout; the kernel profile's summary
reads Nsight Compute's CSV exports; the presets benchmark loads other versions of the Gluon kernel's file;
the instruction count attributes machine code to the kernel's source lines.

The GPU benchmarks build some storage tensors by hand; these tests run those set-ups on CPU, where
the ops are the PyTorch references, so a layout change that a benchmark missed fails here (a shape
error in the reference) instead of on the GPU.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402
import bench_attention_presets  # noqa: E402
import bench_kernel_instructions  # noqa: E402
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


def test_the_presets_benchmark_rejects_a_kernel_file_it_cannot_time(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        bench_attention_presets.load_kernel(str(tmp_path / "missing.py"), 0)
    other = tmp_path / "other.py"
    other.write_text("def supports(*args):\n    return False\n")
    with pytest.raises(ValueError, match="has no mma_decode_attention"):
        bench_attention_presets.load_kernel(str(other), 1)


def test_the_presets_benchmark_loads_and_builds_another_kernel_file(tmp_path):
    """A copy of the kernel's file, loaded as the benchmark loads ``--kernels`` files (its relative
    imports resolved in the kernels package), builds for sm_90 (a separate process without the
    interpreter, which replaces the language functions the compiler needs)."""
    copy = tmp_path / "decode_attention_mma_copy.py"
    copy.write_text(Path(bench_attention_presets.decode_attention_mma.__file__).read_text())
    code = (
        "import sys, torch; sys.path.insert(0, 'benchmarks'); import bench_attention_presets as b; "
        f"m = b.load_kernel({str(copy)!r}, 0); "
        "c = m.compile_offline(128, 4, 128, 64, 3, 1, 2, torch.bfloat16); "
        "print(m.__name__, m.__file__ == sys.argv[1], c.asm['ptx'].count('mma.sync.aligned.m16n8k32') > 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code, str(copy)], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["pnmix_patch.kernels._timed_version_0", "True", "True"]


def test_the_instruction_count_reads_any_copy_of_the_kernel_source_as_its_own():
    """Line info naming the kernel's file under another path or name (a cached build of the same text)
    counts as the kernel's; Triton's library files do not."""
    sass = "\n".join([
        '\t//## File "/elsewhere/kernels/decode_attention_mma.py", line 12',
        "        /*0010*/                   FMUL R1, R2, R3 ;",
        '\t//## File "/repo/.stage/new_mma.py", line 34',
        "        /*0020*/                   LOP3.LUT R4, R4, R5, RZ, 0xc0, !PT ;",
        '\t//## File "/venv/lib/python3.11/site-packages/triton/language/standard.py", line 170',
        "        /*0030*/                   SHFL.BFLY PT, R6, R7, 0x1, 0x1f ;",
    ])  # fmt: skip
    found, _ = bench_kernel_instructions.instructions(sass)
    assert [line for *_, line in found] == [12, 34, -1]
