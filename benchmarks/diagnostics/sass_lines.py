"""Where the Gluon decode kernel's packed loop spends its instructions, by source line (no GPU).

    python benchmarks/diagnostics/sass_lines.py [--preset pnmix-1] [--kernel FILE] [--top 30]

Compiles the split kernel for sm_90 exactly as ``benchmarks/kernel_sass.py`` does (Qwen3-8B heads,
bf16, the launch default of 128 registers), disassembles it with line information (``nvdisasm -g``,
shipped with Triton), takes the packed-groups loop (the second backward branch: sinks, packed
groups, residual) and counts its instructions per line of the kernel file, each instruction at the
innermost kernel line the disassembler names (Triton's own library lines, such as reductions,
count at the kernel line that called them; lines are those of the compiled source, which Triton's
cache may have seen under another path). ``--kernel`` compiles another copy of
``kernels/decode_attention_mma.py`` (loaded as a module of ``pnmix_patch.kernels``), e.g. a
branch's, to compare totals. A static count of one pass, like ``kernel_sass.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_sass  # noqa: E402
from bench_attention import PRESETS  # noqa: E402

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def packed_loop_lines(cubin: bytes) -> tuple[int, collections.Counter, dict]:
    """Instructions of the packed loop: total, count per kernel line, opcodes per kernel line."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([kernel_sass.BIN / "nvdisasm", "-g", "-c", path], capture_output=True, text=True, check=True).stdout
    library = str(Path(kernel_sass.triton.__file__).parent)  # Triton's own lines count at their caller
    instructions, labels, pending, line = [], {}, [], None  # (address, opcode, operands, kernel line)
    for row in text.splitlines():
        if match := re.match(r'\s*//## File "([^"]+)", line (\d+)', row):
            line = line if match.group(1).startswith(library) else int(match.group(2))
        elif match := re.match(r"\s*(\.L_x_\d+):", row):
            pending.append(match.group(1))
        elif match := INSTRUCTION.match(row):
            address = int(match.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            instructions.append((address, match.group(3).split(".")[0], match.group(4), line))
    loops = []
    for address, opcode, operands, _ in instructions:
        target = re.search(r"`\((\.L_x_\d+)\)", operands)
        if opcode == "BRA" and target and labels.get(target.group(1), address) < address:
            loops.append((labels[target.group(1)], address))
    if len(loops) != 3:
        raise SystemExit(f"expected 3 loops (sinks, packed groups, residual), found {len(loops)}")
    start, end = loops[1]
    body = [(opcode, line) for address, opcode, _, line in instructions if start <= address <= end]
    opcodes = collections.defaultdict(collections.Counter)
    for opcode, line in body:
        opcodes[line][opcode] += 1
    return len(body), collections.Counter(line for _, line in body), opcodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pnmix-1", choices=list(PRESETS))
    parser.add_argument("--kernel", default=None, help="another copy of kernels/decode_attention_mma.py")
    parser.add_argument("--top", type=int, default=30, help="lines to print, most instructions first")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: unset it, this tool compiles for the GPU")
    kernel_file = args.kernel or kernel_sass.mma.__file__
    if args.kernel:
        spec = importlib.util.spec_from_file_location("pnmix_patch.kernels.compared_decode_attention_mma", args.kernel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        kernel_sass.mma = module
    total, per_line, opcodes = packed_loop_lines(kernel_sass.compile_mma_kernel(PRESETS[args.preset], 128))
    source = Path(kernel_file).read_text().splitlines()
    print(f"{args.preset}: packed loop {total} instructions per warp per key group ({kernel_file})")
    for line, count in per_line.most_common(args.top):
        text = source[line - 1].strip()[:80] if line else "?"
        print(f"{count:5d} {100 * count / total:5.1f}%  line {line}: {text}   {dict(opcodes[line].most_common(3))}")


if __name__ == "__main__":
    main()
