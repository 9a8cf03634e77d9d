"""Instructions of the Gluon decode kernel's main loop, counted in its sm_90 machine code, on any machine.

Compiles the split kernel (``kernels/decode_attention_mma.py``) for an H100/H200 without a GPU
(:func:`compile_offline`), disassembles it with the ``nvdisasm`` that ships with Triton and counts the
instructions of the loop over the packed groups (the loop that holds the 8-bit MMAs), per 128 tokens,
by opcode and by the kernel function whose source line they come from. A static count: no latency,
no memory traffic; it shows where a configuration spends instructions, and a kernel change's cost in
instructions before any GPU time. Timings are ``bench_attention.py``'s.

Configurations (the Qwen3-8B head shape of ``common``: head dim 128, 4 query heads per KV head; bf16):
``bench_attention.py --sweep-pnmix2-factors``'s (``common.PNMIX2_FACTORS``), the three presets the kernel
serves and pnmix-2's two differences from pnmix-1 apart: ``pnmix-1, G=64``, pnmix-1's channels (64 of 128
selected) with 64-token groups, and ``pnmix-2, G=128``, pnmix-2's channels (52 selected) with 128-token
groups.

Usage::

    python benchmarks/bench_kernel_instructions.py [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from common import HEAD_DIM, KV_HEADS, PNMIX2_FACTORS, Q_HEADS, report_writer

from pnmix_patch.kernels import decode_attention_mma as mma

SOURCE = Path(mma.__file__)
ADDRESS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LINE = re.compile(r'//## File "(.*?)", line (\d+)')
LABEL = re.compile(r"^\.(L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*\(\.(L_x_\d+)\)")


def disassemble(cubin: bytes) -> str:
    """``nvdisasm`` of a cubin, with each instruction's source line."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(nvdisasm), "-c", "--print-line-info", file.name], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> tuple[list[tuple[int, str, int]], dict[str, int]]:
    """``(address, instruction, source line of the kernel's file or -1)`` of each instruction, and each
    label's address."""
    found, labels, line, pending = [], {}, -1, []
    for text in sass.splitlines():
        if match := LINE.search(text):
            # Any file outside Triton's package is the kernel's source: Triton's cache may hold a build
            # made from another copy of the same text (a clone's, or one that bench_attention_presets.py
            # --kernels loaded under another name).
            line = -1 if "triton" in Path(match.group(1)).parent.parts else int(match.group(2))
        elif match := LABEL.match(text.strip()):
            pending.append(match.group(1))
        elif match := ADDRESS.match(text):
            address = int(match.group(1), 16)
            labels.update((label, address) for label in pending)
            pending = []
            found.append((address, match.group(2), line))
    return found, labels


def main_loop(found, labels) -> list[tuple[int, str, int]]:
    """The instructions of the loop that holds the most 8-bit MMAs (``IMMA``): from a label to the
    backward branch to it."""
    best, best_mmas = None, -1
    for address, text, _ in found:
        match = BRANCH.search(text)
        if match and labels.get(match.group(1), address + 1) <= address:
            start = labels[match.group(1)]
            body = [entry for entry in found if start <= entry[0] <= address]
            mmas = sum("IMMA" in entry[1] for entry in body)
            if mmas > best_mmas or (mmas == best_mmas and len(body) > len(best)):
                best, best_mmas = body, mmas
    if not best_mmas > 0:
        raise RuntimeError("no loop with 8-bit MMAs found in the kernel's machine code")
    return best


@functools.cache
def functions_by_line() -> list[tuple[int, str]]:
    """``(first line, name)`` of each top-level function of the kernel's source file."""
    lines = SOURCE.read_text().splitlines()
    return [(i + 1, m.group(1)) for i, text in enumerate(lines) if (m := re.match(r"def (\w+)", text))]


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers, but loads, stores and MMAs by width."""
    name = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
    return name if name.startswith(("LD", "ST", "IMMA", "HMMA")) else name.split(".")[0]


def count(config) -> dict:
    """The main loop's instructions per 128 tokens for one configuration (a ``PNMixConfig``; the loop
    takes a stage: one key group, or two of 64 tokens)."""
    group_size, num_high = config.key_group_size, config.num_high_channels(HEAD_DIM)
    shape = (HEAD_DIM, Q_HEADS // KV_HEADS, group_size, num_high, config.key_bits_high, config.key_bits_low, config.value_bits)
    compiled = mma.compile_offline(*shape, torch.bfloat16)
    body = main_loop(*instructions(disassemble(compiled.asm["cubin"])))
    tokens = max(mma.step_tokens(group_size, config.value_bits), group_size)
    functions = functions_by_line()

    def function_of(line: int) -> str:
        if line < 0:
            return "(Triton's library)"
        return max((start, fn) for start, fn in functions if start <= line)[1]

    per_128 = 128 / tokens
    return {
        "group_size": group_size,
        "selected_channels": num_high,
        "loop_tokens": tokens,
        "instructions_per_128_tokens": round(len(body) * per_128, 1),
        "by_opcode": {k: round(v * per_128, 1) for k, v in collections.Counter(opcode(t) for _, t, _ in body).most_common()},
        "by_function": {k: round(v * per_128, 1) for k, v in collections.Counter(function_of(line) for *_, line in body).most_common()},
    }


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        sys.exit("bench_kernel_instructions.py compiles the kernel: run it without TRITON_INTERPRET=1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    write = report_writer(args.out, "bench_kernel_instructions.json", "benchmarks/bench_kernel_instructions.py")
    build = {"triton": triton.__version__, "target": "sm_90", "max_registers": mma.MAX_REGISTERS}
    results = {}
    for name, config in PNMIX2_FACTORS.items():
        results[name] = count(config)
        write(**build, configurations=results)
        print(f"{name:16s} {results[name]['instructions_per_128_tokens']:7.1f} instructions per 128 tokens", flush=True)
    write(complete=True, **build, configurations=results)
    names = list(results)
    functions = sorted(
        {f for r in results.values() for f in r["by_function"]}, key=lambda f: -max(r["by_function"].get(f, 0) for r in results.values())
    )
    print("\nby kernel function:\n" + "function".ljust(28) + "".join(n.rjust(16) for n in names))
    for function in functions:
        print(function.ljust(28) + "".join(f"{results[n]['by_function'].get(function, 0):16.1f}" for n in names))


if __name__ == "__main__":
    main()
