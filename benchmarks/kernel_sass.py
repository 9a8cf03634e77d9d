"""Static instruction counts of the decode-attention kernel for an H100/H200 (sm_90), no GPU needed.

    python benchmarks/kernel_sass.py [--presets pnmix-1 pnmix-2 kivi-2] [--out DIR]

Compiles ``_decode_split_kernel`` (``kernels/decode_attention.py``) for ``sm_90`` with the
Qwen3-8B head shape (4 query heads per KV head, head dim 128), bf16 and its default launch
options (4 warps, ``NUM_STAGES`` stages, at most ``MAX_REGISTERS`` registers per thread), exactly
as Triton would on the GPU, then reads the machine code
with the ``cuobjdump`` that ships with Triton:

- registers per thread (at most 255, or the cap; 255 means two 4-warp programs per multiprocessor, 128 four),
  and the spill loads and stores (``LDL``, ``STL``) of the whole kernel;
- the kernel's loops: the backward branches of the SASS, in program order: sinks, packed
  groups, residual (the dense loops of sinks and residual step 64 tokens; the packed loop
  32 tokens, one bit-plane word per channel), and each loop's opcodes (``loop_opcodes``);
- for the packed loop, the instructions of one iteration of one warp by class, and
  per cached token and KV head (``instructions x warps / 32``): the figure that bounds the
  kernel when it is instruction-bound (an H200 issues about 132 x 4 warp-instructions per
  cycle).

Then the same for the Gluon kernel (``kernels/decode_attention_mma.py``, the one CUDA runs for
these shapes), uncapped and at 128 registers (its launch default, 4 programs per multiprocessor,
except for pnmix-2's 64-token groups, which launch at 96: ``--gluon-registers none 128 96``, see
``register_cap``):
its packed loop covers one key group (G tokens in unrolled steps of `step_tokens`: one for pnmix-1); its counts are
given per 32 tokens to compare. Its pointer and stride arguments are marked divisible by 16, as
a launch on these shapes specializes them; the Triton kernel is compiled without that hint, as
in the earlier sessions' counts.

A static count: one pass through the loop body, every instruction counted once (branches
inside the body are not weighted). It measures the code, not the time; use it to compare
kernel variants between GPU runs. Writes ``kernel_sass.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench_attention import HEAD_DIM, KV_HEADS, PRESETS, Q_HEADS  # the shape and presets bench_attention times

from pnmix_patch import PNMixConfig
from pnmix_patch.quantize import key_word_distance
from pnmix_patch.kernels import decode_attention_mma as mma
from pnmix_patch.kernels.decode_attention import BLOCK_N_DENSE, MAX_REGISTERS, NUM_STAGES, _decode_split_kernel

RATIO, NUM_WARPS = Q_HEADS // KV_HEADS, 4
POINTER_TYPES = {
    "order_ptr": "*i64", "sink_len_ptr": "*i32", "kc_high_ptr": "*i32", "kc_low_ptr": "*i32", "vc_ptr": "*i32",
    "num_groups_ptr": "*i32", "res_len_ptr": "*i32", "m_out_ptr": "*fp32", "l_out_ptr": "*fp32", "acc_out_ptr": "*fp32",
}  # fmt: skip
CLASSES = {
    "tensor core": ("HMMA", "IMMA"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM"),
    "warp shuffle": ("SHFL",),
    "barrier": ("BAR",),
    "global memory": ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "local memory (spills)": ("LDL", "STL"),
    "conversion": ("I2F", "F2F", "F2FP", "I2FP", "F2I"),
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSETP", "FSEL", "HADD2", "HMUL2", "HFMA2"),
    "integer and logic": ("LOP3", "SHF", "IADD3", "IMAD", "ISETP", "SEL", "PRMT", "LEA", "IABS", "IMNMX", "VIADD", "BFE", "BFI", "FLO", "POPC", "LOP", "SGXT"),
    "control": ("BRA", "BSSY", "BSYNC", "BREAK", "WARPSYNC", "NOP"),
}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def with_constexpr_defaults(kernel, constants: dict) -> dict:
    """``constants`` and each other constexpr parameter of ``kernel`` at its default, as a launch that
    does not pass it compiles it (``PDL=False``): a parameter left out would compile as a run-time
    integer, its branches kept (until the thirty-second session these builds had ``PDL`` so: 1-5 more
    instructions in the Gluon kernel's packed loop than the launch's build)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    return defaults | constants


def compile_split_kernel(config: PNMixConfig) -> bytes:
    """The sm_90 cubin of the split kernel for ``config`` at the Qwen3-8B head shape, bf16."""
    num_high = 2 * config.num_selected_pairs(HEAD_DIM)
    constants = dict(
        RATIO=RATIO, BLOCK_Q=16, D=HEAD_DIM, BLOCK_D=HEAD_DIM, G=config.key_group_size, C_HIGH=num_high,
        BITS_HIGH=config.key_bits_high, BITS_LOW=config.key_bits_low, BITS_V=config.value_bits, GV=HEAD_DIM,
        HIGH_DISTANCE=key_word_distance(config.key_group_size, num_high),
        LOW_DISTANCE=key_word_distance(config.key_group_size, HEAD_DIM - num_high),
        BLOCK_N_DENSE=BLOCK_N_DENSE, DOT_PRECISION="tf32",
    )  # fmt: skip
    constants = with_constexpr_defaults(_decode_split_kernel, constants)
    signature = {}
    for name in _decode_split_kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    source = ASTSource(_decode_split_kernel, signature, constants)
    options = {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "maxnreg": MAX_REGISTERS}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def compile_mma_kernel(config: PNMixConfig, max_registers: int | None) -> bytes:
    """The sm_90 cubin of the Gluon split kernel (``decode_attention_mma``) for ``config`` at the
    Qwen3-8B head shape, bf16, with the pointer and stride arguments marked divisible by 16, as a
    launch on those shapes specializes them (so loads vectorize as on the GPU)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = mma._decode_split_kernel_mma
    constants = with_constexpr_defaults(kernel, mma.kernel_constants(
        HEAD_DIM, RATIO, config.key_group_size, 2 * config.num_selected_pairs(HEAD_DIM),
        config.key_bits_high, config.key_bits_low, config.value_bits,
    ))  # fmt: skip
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = POINTER_TYPES.get(name, "*bf16") if name.endswith("_ptr") else "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or name.startswith("s_"):
            attributes[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": mma.NUM_WARPS, **({} if max_registers is None else {"maxnreg": max_registers})}
    source = GluonASTSource(kernel, signature, constants, attributes)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def analyze(cubin: bytes, tokens_per_iteration: int = 32) -> dict:
    """Registers, loops and the packed loop's instruction classes of a cubin; one iteration of the
    packed loop covers ``tokens_per_iteration`` tokens (the figures are given per 32 tokens)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    instructions = []  # (address, opcode, text)
    for match in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass):
        instructions.append((int(match.group(1), 16), match.group(3).split(".")[0], match.group(3) + match.group(4)))
    loops = []
    for address, opcode, text in instructions:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            loops.append([op for a, op, _ in instructions if start <= a <= address])
    spills = sum(1 for _, opcode, _ in instructions if opcode in CLASSES["local memory (spills)"])
    result = {"registers": registers, "loop_sizes": [len(body) for body in loops], "spill_instructions": spills,
              "loop_opcodes": [dict(sorted(Counter(body).items())) for body in loops]}
    if len(loops) == 3:  # sinks, packed groups, residual
        body = Counter(loops[1])
        per_32 = 32 / tokens_per_iteration
        classes = {name: round(sum(body[op] for op in ops) * per_32, 1) for name, ops in CLASSES.items()}
        classes["other"] = round(len(loops[1]) * per_32 - sum(classes.values()), 1)
        result.update(
            packed_loop_tokens_per_iteration=tokens_per_iteration,
            packed_loop_instructions_per_warp=len(loops[1]) * per_32,
            packed_loop_instructions_per_token_and_kv_head=len(loops[1]) * per_32 * NUM_WARPS / 32,
            packed_loop_classes=classes,
            packed_loop_top_opcodes=dict(body.most_common(12)),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--gluon-registers", nargs="+", default=["none", "128"], metavar="CAP",
                        help="register caps of the Gluon kernel's builds ('none': uncapped); default: none 128")
    args = parser.parse_args()
    try:
        caps = [None if cap == "none" else int(cap) for cap in args.gluon_registers]
    except ValueError:
        parser.error(f"--gluon-registers {args.gluon_registers}: allowed 'none' or whole numbers of registers")
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: unset it, this tool compiles for the GPU")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "triton": triton.__version__, "target": "sm_90",
              "shape": {"query_heads_per_kv_head": RATIO, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
              "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "max_registers": MAX_REGISTERS,
              "command": "python benchmarks/kernel_sass.py " + " ".join(f"--presets {p}" for p in args.presets)
              + " --gluon-registers " + " ".join(args.gluon_registers),
              "kernels": {}, "gluon_kernels": {}}  # fmt: skip
    variants = [("triton", name, None) for name in args.presets]
    variants += [("gluon", name, registers) for name in args.presets for registers in caps]
    for kernel, name, registers in variants:
        if kernel == "triton":
            result = analyze(compile_split_kernel(PRESETS[name]))
            report["kernels"][name] = result
        else:
            result = analyze(compile_mma_kernel(PRESETS[name], registers), PRESETS[name].key_group_size)
            report["gluon_kernels"][f"{name}/max_registers={registers}"] = result
        line = (f"{kernel:6s} {name:8s} registers {result['registers']:3d}  loops {result['loop_sizes']}  "
                f"spill loads and stores in the whole kernel {result['spill_instructions']}")
        if "packed_loop_classes" in result:
            line += (f"  packed loop: {result['packed_loop_instructions_per_warp']:.0f} instructions per warp per 32 tokens = "
                     f"{result['packed_loop_instructions_per_token_and_kv_head']:.0f} per token and KV head; "
                     + ", ".join(f"{k} {v:g}" for k, v in result["packed_loop_classes"].items()))  # fmt: skip
        print(line, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernel_sass.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
