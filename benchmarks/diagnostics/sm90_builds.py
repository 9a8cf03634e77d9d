"""Build the cache kernels for an H100/H200 (sm_90) on a machine without a GPU, and fingerprint their PTX.

    python benchmarks/diagnostics/sm90_builds.py [--out DIR] [--ptx-dir DIR]

For each shape of ``SHAPES`` (head dim, key group, selected channels, key bits, value bits): the
Triton decode-attention split kernel, the Triton key packer and the decode append (4 query heads
per KV head), and, where ``decode_attention_mma.supports_shapes`` takes the shape, the Gluon split
kernel at 1, 4, 7 and 16 query heads per KV head (its launch register cap). Pointers are not
specialized for alignment. Writes ``sm90_builds.json`` under ``--out`` (default ``benchmarks/results``):
the SHA-256 prefix of each build's PTX less debug information (``--ptx-dir``: the PTX files too), and
the builds that failed (a layout or constexpr error). Run it at two commits and compare the JSONs to
see whether a change altered the code. Run without ``TRITON_INTERPRET``. Constexpr parameters that a
shape does not set are built at their defaults (``kernel_sass.with_constexpr_defaults``); before the
thirty-second session the Triton kernels' ``PDL`` was built as a run-time integer, so fingerprints of
that script's JSONs (``sm90_builds_{9ab1166,caea14e,646f4ed,4a0677c}.json``) differ from today's for the
split and append kernels: rebuild both commits with one version of the script to compare them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_sass import with_constexpr_defaults  # noqa: E402

from pnmix_patch.kernels import decode_attention_mma as mma
from pnmix_patch.kernels.pack_values import value_layout
from pnmix_patch.quantize import key_tile_distance, thread_owned_keys

I32, I64, F32 = "*i32", "*i64", "*fp32"
SPLIT = {"order_ptr": I64, "kc_high_ptr": I32, "kc_low_ptr": I32, "vc_ptr": I32, "sink_len_ptr": I32,
         "num_groups_ptr": I32, "res_len_ptr": I32, "m_out_ptr": F32, "l_out_ptr": F32, "acc_out_ptr": F32}
APPEND = {"order_ptr": I64, "sink_len_ptr": I32, "res_len_ptr": I32, "high_ptr": I32, "low_ptr": I32, "vc_ptr": I32,
          "num_groups_ptr": I32, "overflow_ptr": "*i1", "arrivals_ptr": I32}
PACK = {"order_ptr": I64, "high_ptr": I32, "low_ptr": I32}
SHAPES = [  # head dim, G, selected channels, b_H, b_L, b_V
    (128, 128, 64, 3, 1, 2),  # pnmix-1
    (128, 64, 52, 3, 1, 2),  # pnmix-2 (byte-quad keys)
    (128, 128, 128, 2, 2, 2),  # kivi-2
    (128, 128, 32, 4, 2, 2),  # Kitty's widths
    (128, 128, 32, 3, 1, 2),  # a first key tile of fields and a plane
    (128, 128, 128, 4, 4, 2),
    (128, 256, 64, 3, 1, 2),
    (128, 128, 64, 3, 1, 4),
    (128, 128, 96, 3, 1, 2),
    (128, 128, 0, 3, 1, 2),
    (64, 64, 26, 3, 1, 2),
    (64, 64, 32, 3, 1, 2),
    (64, 128, 32, 3, 1, 2),
    (64, 64, 64, 3, 3, 2),
]


def word_distance(group_size: int, channels: int) -> int:
    """``quantize.key_word_distance``, written from the functions it is made of so that this script also
    builds commits from before it (whose kernels take no distance: the constant is then dropped)."""
    return key_tile_distance(group_size) if thread_owned_keys(group_size, channels) else 0


def build(kernel, types: dict, constants: dict, gluon: bool, options: dict) -> str:
    """PTX of ``kernel`` for sm_90 with ``constants`` (those it takes), less debug information."""
    constants = with_constexpr_defaults(kernel, {k: v for k, v in constants.items() if k in kernel.arg_names})
    signature = {n: "constexpr" if n in constants else types.get(n, "*bf16") if n.endswith("_ptr")
                 else "fp32" if n in ("qk_scale", "eps") else "i32" for n in kernel.arg_names}  # fmt: skip
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}).asm["ptx"]
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__(tmp|func))", line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--ptx-dir", help="also write each build's PTX (less debug information) here")
    args = parser.parse_args()
    if args.ptx_dir:
        Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
    kernels = {name: getattr(importlib.import_module(f"pnmix_patch.kernels.{module}"), kernel) for name, module, kernel in (
        ("split", "decode_attention", "_decode_split_kernel"), ("pack", "pack_keys", "_pack_keys_kernel"),
        ("append", "decode_append", "_append_token_kernel"))}  # fmt: skip
    fingerprints, failures = {}, []
    for head_dim, group, high, bits_high, bits_low, bits_value in SHAPES:
        key = f"d{head_dim}_g{group}_c{high}_{bits_high}{bits_low}{bits_value}"
        common = dict(D=head_dim, BLOCK_D=head_dim, G=group, NUM_HIGH=high, C_HIGH=high, BITS_HIGH=bits_high, BITS_LOW=bits_low,
                      HIGH_DISTANCE=word_distance(group, high), LOW_DISTANCE=word_distance(group, head_dim - high))  # fmt: skip
        builds = {
            f"split_{key}": (kernels["split"], SPLIT, dict(common, RATIO=4, BLOCK_Q=16, BITS_V=bits_value, GV=head_dim,
                                                             BLOCK_N_DENSE=64, DOT_PRECISION="tf32"), False, {}),
            f"pack_{key}": (kernels["pack"], PACK, dict(common, MIDPOINT=True), False, {}),
            f"append_{key}": (kernels["append"], APPEND, dict(common, MIDPOINT=True, BLOCK_T=32, ROTATE=True, NORM=True, RATIO=4,
                                                                BLOCK_R=4, **value_layout(head_dim, 1, bits_value)), False, {}),
        }  # fmt: skip
        for ratio in (1, 4, 7, 16):
            if mma.supports_shapes(head_dim, group, bits_high, bits_low, bits_value, 1, 8 * ratio, 8, high):
                builds[f"gluon_r{ratio}_{key}"] = (mma._decode_split_kernel_mma, SPLIT,
                                                    mma.kernel_constants(head_dim, ratio, group, high, bits_high, bits_low, bits_value),
                                                    True, {"maxnreg": mma.register_cap(group, ratio)})  # fmt: skip
        for name, (kernel, types, constants, gluon, options) in builds.items():
            try:
                ptx = build(kernel, types, constants, gluon, options)
            except Exception as error:  # a build that does not compile: report it, go on
                failures.append(name)
                print(f"  {name}: FAILED {str(error).splitlines()[-1][:300] if str(error) else repr(error)}", flush=True)
                continue
            if args.ptx_dir:
                (Path(args.ptx_dir) / f"{name}.ptx").write_text(ptx)
            fingerprints[name] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
            print(f"  {name}: {fingerprints[name]}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "triton": triton.__version__, "ptx_sha256": fingerprints,
              "failed": failures}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sm90_builds.json").write_text(json.dumps(report, indent=1))
    print(f"{len(fingerprints)} built, {len(failures)} failed")


if __name__ == "__main__":
    main()
