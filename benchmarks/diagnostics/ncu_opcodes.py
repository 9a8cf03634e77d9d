"""Sum an Nsight Compute SASS source page by opcode: share of executed instructions, of warp stall
samples, and the stall reasons (eighth session; wrote ``ncu_decode_kernel_b32_t32768_opcodes.json``);
where the page has them, the shared-memory wavefronts (L1 data-stage cycles) per opcode with its
full modifiers (``LDSM.16.M88.4``, ``LDS.64``), their excess over the ideal (bank conflicts) and the
wavefronts per executed instruction (twenty-eighth session).

    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/diagnostics/ncu_opcodes.py sass.csv OUT.json
"""
import collections
import csv
import json
import sys


def number(text: str) -> float:
    text = text.replace(",", "")
    return float(text) if text.replace(".", "").isdigit() else 0.0


rows = list(csv.reader(open(sys.argv[1])))
header, data = rows[1], rows[2:]  # row 0 names the kernel
column = {name: i for i, name in enumerate(header)}
stall_names = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
executed, sampled, stalls = collections.Counter(), collections.Counter(), collections.Counter()
WAVEFRONTS = ("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive")
shared = collections.defaultdict(lambda: [0.0, 0.0, 0.0])  # opcode with modifiers: wavefronts, excess, instructions
for row in data:
    words = row[column["Source"]].split()
    if not words:
        continue
    opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]  # drop a predicate and modifiers
    executed[opcode] += number(row[column["Instructions Executed"]])
    sampled[opcode] += number(row[column["Warp Stall Sampling (All Samples)"]])
    for name in stall_names:
        stalls[name] += number(row[column[name]])
    if all(name in column for name in WAVEFRONTS) and number(row[column[WAVEFRONTS[0]]]):
        totals = shared[words[1] if words[0].startswith("@") else words[0]]
        totals[0] += number(row[column[WAVEFRONTS[0]]])
        totals[1] += number(row[column[WAVEFRONTS[1]]])
        totals[2] += number(row[column["Instructions Executed"]])
total, samples = sum(executed.values()), sum(sampled.values())
top = executed.most_common(20)
report = {
    "source": "ncu --set full --import-source yes on benchmarks/diagnostics/ncu_decode_kernel.py 32 32768 (pnmix-1, bf16), "
              "--page source --csv --print-source sass, summed by opcode",
    "instructions_executed": total,
    "opcodes_percent_of_instructions": {k: round(v / total * 100, 2) for k, v in top},
    "opcodes_percent_of_stall_samples": {k: round(sampled[k] / samples * 100, 2) for k, _ in top},
    "stall_reasons_percent": {k: round(v / samples * 100, 2) for k, v in stalls.most_common(12)},
}
if shared:
    wavefronts = sum(v[0] for v in shared.values())
    report["shared_wavefronts"] = wavefronts
    report["shared_wavefronts_by_opcode"] = {
        k: {"percent": round(v[0] / wavefronts * 100, 2), "excess_percent_of_own": round(v[1] / v[0] * 100, 2),
            "per_instruction": round(v[0] / v[2], 2) if v[2] else None}
        for k, v in sorted(shared.items(), key=lambda kv: -kv[1][0])
    }
json.dump(report, open(sys.argv[2], "w"), indent=1)
