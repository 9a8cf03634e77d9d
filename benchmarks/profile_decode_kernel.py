"""Nsight Compute profile of the Gluon decode kernel: where its warps wait.

Profiles one launch of the split kernel (``_decode_split_kernel_mma``, ``kernels/decode_attention_mma.py``)
of each preset at one shape (default batch 32, 32K tokens: ``bench_attention.py``'s long shape, bf16)
with ``ncu --set full --import-source yes --clock-control none`` (the GPU's own clocks, as the
benchmarks run), exports its metrics and per-instruction stall samples as CSV, and summarizes them:

- the kernel's duration and clocks, DRAM throughput, issue-slot use, eligible warps per scheduler;
- warp stall reasons, as a share of all stall samples (``long_sb``: waiting on a global-memory
  operation's scoreboard, including the registers a ``cp.async`` has yet to read; ``short_sb``: on
  shared memory, shuffles or MUFU; ``wait``: a fixed-latency dependency; ``selected``: issuing);
- the opcodes and the source lines (Python lines of the kernel) with the most samples.

The summary (``profile_decode_kernel.json``) goes to ``--out``; the CSVs (about 2 MB a preset) to
``--csv-dir``, outside the repository by default. ``--summarize DIR`` prints the summary of CSVs
exported before.
Needs ``ncu`` (CUDA toolkit) and a GPU with the Gluon kernel (compute capability 9.0 and up).

Usage::

    python benchmarks/profile_decode_kernel.py [--presets pnmix-1 pnmix-2] [--batch 32] [--context 32768] [--out DIR] [--csv-dir DIR]
    python benchmarks/profile_decode_kernel.py --summarize DIR [--presets ...]
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import PRESETS, build_cache, report_writer

KERNEL = "_decode_split_kernel_mma"
CALLS_BEFORE = 3
"""Launches ncu skips before the profiled one (compilation and first-touch effects)."""
SAMPLES = "Warp Stall Sampling (All Samples)"
DETAILS = {
    ("GPU Speed Of Light Throughput", "Duration"): "duration",
    ("GPU Speed Of Light Throughput", "SM Frequency"): "sm_frequency",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_throughput",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_throughput",
    ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"): "l1_throughput",
    ("Compute Workload Analysis", "Issue Slots Busy"): "issue_slots_busy",
    ("Scheduler Statistics", "No Eligible"): "no_eligible",
    ("Scheduler Statistics", "Active Warps Per Scheduler"): "active_warps_per_scheduler",
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"): "eligible_warps_per_scheduler",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "warp_cycles_per_issued_instruction",
    ("Launch Statistics", "Grid Size"): "grid_size",
    ("Launch Statistics", "Registers Per Thread"): "registers_per_thread",
    ("Occupancy", "Achieved Active Warps Per SM"): "achieved_warps_per_sm",
}


def run_target(preset: str, batch: int, context: int) -> None:
    """What ncu runs: the op on a packed cache, enough calls that launch ``CALLS_BEFORE + 1`` is warm."""
    from pnmix_patch.kernels.decode_attention import decode_attention

    args = build_cache(PRESETS[preset], batch, context, torch.bfloat16, torch.device("cuda"))
    for _ in range(CALLS_BEFORE + 2):
        decode_attention(*args)
    torch.cuda.synchronize()


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_details(path: Path) -> dict:
    """The metrics of ``DETAILS`` from ``ncu --page details --csv``: ``{name: [value, unit]}``."""
    found = {}
    for row in csv.DictReader(path.open()):
        name = DETAILS.get((row.get("Section Name"), row.get("Metric Name")))
        if name:
            found[name] = [number(row["Metric Value"]), row.get("Metric Unit", "")]
    return found


def source_rows(path: Path) -> list[tuple[str, dict]]:
    """The rows of ``ncu --page source --csv``, each with its source file's name (the export repeats a
    header per file; ``--print-source cuda,sass`` adds the SASS rows under each source line)."""
    rows, file, header = [], "", None
    for row in csv.reader(path.open()):
        if not row:
            continue
        if row[0] == "File Path":
            file = Path(row[1]).name
        elif row[0] in ("Line No", "Address"):
            header = row
        elif header is not None and row[0] != "Function Name":
            fields = {}
            for name, value in zip(header, row):
                fields.setdefault(name, value)  # "Source" twice with cuda,sass: the source line's first
            rows.append((file, fields))
    return rows


def stall_counts(row: dict) -> collections.Counter:
    """Stall samples by reason (all samples, issued or not; ``stall_`` dropped)."""
    return collections.Counter({k[6:]: number(v) for k, v in row.items() if k.startswith("stall_") and "Not Issued" not in k})


def top_reasons(stalls: collections.Counter, total: float, count: int = 3) -> dict:
    return {reason: round(100 * value / total, 1) for reason, value in stalls.most_common(count) if value}


def summarize_sass(path: Path, top: int = 12) -> dict:
    """Stall reasons overall and the opcodes with the most samples, from the SASS-only export."""
    reasons, samples, executed = collections.Counter(), collections.Counter(), collections.Counter()
    by_opcode = collections.defaultdict(collections.Counter)
    for _, row in source_rows(path):
        words = row.get("Source", "").split()
        if not words:
            continue
        opcode = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        samples[opcode] += number(row.get(SAMPLES, "0"))
        executed[opcode] += number(row.get("Instructions Executed", "0"))
        stalls = stall_counts(row)
        reasons.update(stalls)
        by_opcode[opcode].update(stalls)
    total, instructions = sum(samples.values()) or 1.0, sum(executed.values()) or 1.0
    return {
        "stall_samples": int(total),
        "warp_instructions": int(instructions),
        "stall_reasons_percent": top_reasons(reasons, total, len(reasons)),
        "opcodes": [
            {
                "opcode": opcode,
                "samples_percent": round(100 * value / total, 1),
                "instructions_percent": round(100 * executed[opcode] / instructions, 1),
                "top_stalls_percent": top_reasons(by_opcode[opcode], total),
            }
            for opcode, value in samples.most_common(top)
        ],
    }


def summarize_lines(path: Path, top: int = 15) -> list[dict]:
    """The source lines with the most samples, from the export with source lines (``cuda,sass``)."""
    lines = [(file, row) for file, row in source_rows(path) if row.get("Line No", "").isdigit()]
    total = sum(number(row.get(SAMPLES, "0")) for _, row in lines) or 1.0
    lines.sort(key=lambda item: -number(item[1].get(SAMPLES, "0")))
    return [
        {
            "line": f"{file}:{row['Line No']}",
            "source": row["Source"].strip()[:100],
            "samples_percent": round(100 * number(row[SAMPLES]) / total, 1),
            "warp_instructions": int(number(row.get("Instructions Executed", "0"))),
            "top_stalls_percent": top_reasons(stall_counts(row), total),
        }
        for file, row in lines[:top]
    ]


def summarize(directory: Path, preset: str) -> dict:
    """The summary of one preset's exports in ``directory`` (see :func:`export`); without the source-line
    export, no lines."""
    lines = directory / f"lines_{preset}.csv"
    return {
        "metrics": read_details(directory / f"details_{preset}.csv"),
        **summarize_sass(directory / f"sass_{preset}.csv"),
        "lines": summarize_lines(lines) if lines.exists() else [],
    }


def export(ncu: str, preset: str, batch: int, context: int, directory: Path) -> None:
    """Profile one launch of ``preset``'s split kernel and write its details, SASS and source-line CSVs."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / preset
        command = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{KERNEL}", "--launch-skip", str(CALLS_BEFORE)]
        command += ["--launch-count", "1", "--set", "full", "--import-source", "yes", "-o", str(report)]
        command += [sys.executable, __file__, "--target", preset, "--batch", str(batch), "--context", str(context)]
        subprocess.run(command, check=True)
        pages = {"details": ["--page", "details"], "sass": ["--page", "source", "--print-source", "sass"]}
        pages["lines"] = ["--page", "source", "--print-source", "cuda,sass"]
        for name, page in pages.items():
            with (directory / f"{name}_{preset}.csv").open("w") as file:
                subprocess.run([ncu, "-i", f"{report}.ncu-rep", "--csv", *page], stdout=file, check=True)


def listed(percents: dict) -> str:
    """``{reason: percent}`` as one line: ``long_sb 19.8, wait 17.6``."""
    return ", ".join(f"{reason} {percent}" for reason, percent in percents.items())


def print_summary(preset: str, summary: dict) -> None:
    metrics = summary["metrics"]
    print(f"\n== {preset}: " + ", ".join(f"{name} {value:g} {unit}".strip() for name, (value, unit) in metrics.items()))
    print("stall reasons (% of samples): " + listed(summary["stall_reasons_percent"]))
    print(f"{'opcode':12s} {'samples %':>9s} {'instr %':>8s}  top stalls (% of all samples)")
    for row in summary["opcodes"]:
        print(f"{row['opcode']:12s} {row['samples_percent']:9.1f} {row['instructions_percent']:8.1f}  {listed(row['top_stalls_percent'])}")
    print(f"{'line':30s} {'samples %':>9s}  source | top stalls")
    for row in summary["lines"]:
        print(f"{row['line']:30s} {row['samples_percent']:9.1f}  {row['source'][:70]} | {listed(row['top_stalls_percent'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["pnmix-1", "pnmix-2"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--csv-dir", default=str(Path(tempfile.gettempdir()) / "pnmix_ncu"), help="where the CSV exports go")
    parser.add_argument("--summarize", metavar="DIR", help="summarize the CSVs in DIR (exported before) instead of profiling")
    parser.add_argument("--target", choices=sorted(PRESETS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.target:
        return run_target(args.target, args.batch, args.context)
    if args.summarize:  # printed only: the JSON names the run that profiled
        for preset in args.presets:
            print_summary(preset, summarize(Path(args.summarize), preset))
        return
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        parser.error("the profile runs the compiled kernel: unset TRITON_INTERPRET")
    ncu = shutil.which("ncu") or shutil.which("ncu", path="/usr/local/cuda/bin")
    if ncu is None or not torch.cuda.is_available():
        parser.error("needs Nsight Compute's ncu on PATH (or in /usr/local/cuda/bin) and a CUDA GPU")
    csv_dir = Path(args.csv_dir)
    csv_dir.mkdir(parents=True, exist_ok=True)
    write = report_writer(args.out, "profile_decode_kernel.json", "benchmarks/profile_decode_kernel.py")
    shape = {"batch": args.batch, "context": args.context, "dtype": "bfloat16", "kernel": KERNEL}
    summaries = {}
    for preset in args.presets:
        export(ncu, preset, args.batch, args.context, csv_dir)
        summaries[preset] = summarize(csv_dir, preset)
        print_summary(preset, summaries[preset])
        write(shape=shape, presets=summaries)
    write(complete=True, shape=shape, presets=summaries)


if __name__ == "__main__":
    main()
