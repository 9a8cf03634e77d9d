"""The Gluon decode-attention kernel: its PTX unpacking emulated on CPU, its layouts, its sm_90
build, and (on a CUDA machine only: the interpreter cannot run Gluon) its results against the
float32 reference."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from kernel_cases import decode_inputs, seeded

from pnmix_patch.kernels import decode_attention_mma as mma
from pnmix_patch.kernels.decode_attention import decode_attention_reference
from pnmix_patch.quantize import pack_bits

MASK = 0xFFFFFFFF


def run_ptx(asm: str, operands: list[int]) -> list[int]:
    """Execute :func:`unpack_asm`'s PTX on 32-bit integers; returns $0, $1."""
    registers = {f"${i}": value & MASK for i, value in enumerate(operands)}

    def value(token):
        return registers[token] if token in registers else int(token, 0) & MASK

    for line in asm.splitlines():
        match = re.match(r"(\S+) (\S+), (.*);", line)
        if not match or match.group(1) == ".reg":
            continue
        op, target, args = match.group(1), match.group(2), [value(a) for a in match.group(3).split(", ")]
        if op == "prmt.b32":  # byte i of the result = byte selector[i] of {b, a}
            source = (args[1] << 32) | args[0]
            result = sum(((source >> (8 * ((args[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "sub.rn.f16x2":
            halves = [torch.tensor([(v >> 16 * i) & 0xFFFF for i in (0, 1)], dtype=torch.int32).to(torch.int16).view(torch.float16) for v in args]
            difference = (halves[0].float() - halves[1].float()).half().view(torch.int16).to(torch.int32) & 0xFFFF
            result = int(difference[0]) | int(difference[1]) << 16
        elif op == "lop3.b32":
            assert args[3] == 0xEA  # (a & b) | c
            result = (args[0] & args[1]) | args[2]
        else:
            raise AssertionError(f"unexpected instruction {op}")
        registers[target] = result
    return [registers["$0"], registers["$1"]]


def float16_value(pattern: int, dtype: torch.dtype) -> float:
    return float(torch.tensor(pattern, dtype=torch.int32).to(torch.int16).view(dtype))


@pytest.mark.parametrize("plane", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack_asm_builds_plane_operands(plane, dtype):
    """Rows r and r + 8 (bytes b, b + 1 of their word, bit j = r % 8) of columns k and k + 1: two
    registers of 16-bit halves M + unit * 2^j * bit, with unit = M / MAGIC (bf16: 1, 1, 4, 4; fp16:
    2^p); fp16 subtracts M, leaving unit * 2^j * bit."""
    generator = torch.Generator().manual_seed(plane)
    exact = dtype == torch.float16
    magic = mma.plane_magic(dtype, plane)
    unit = float16_value(magic, dtype) / float16_value(mma.MAGIC[dtype], dtype)
    asm = mma.unpack_asm(exact)
    for _ in range(100):
        bits = torch.randint(0, 2, (2, 32), generator=generator)  # [column, 32 rows of a word]
        words = pack_bits(bits, 1).view(2)
        row = int(torch.randint(0, 8, (), generator=generator)) + 16 * int(torch.randint(0, 2, (), generator=generator))
        byte, j = row // 8, row % 8

        def selector(b):  # byte b of column k's word into bytes 0-1, of column k + 1's into bytes 2-3
            return b * 0x11 + (b + 4) * 0x1100

        mask = 0x10001 << j
        operands = [0, 0, *[int(w) for w in words] * 2, selector(byte), 0, selector(byte + 1), 0, mask, 0, mask, 0]
        operands += [magic * 0x10001] * 4
        low_row, high_row = run_ptx(asm, operands)
        for register, r in ((low_row, row), (high_row, row + 8)):
            halves = [float16_value(register & 0xFFFF, dtype), float16_value(register >> 16, dtype)]
            offset = 0.0 if exact else float16_value(magic, dtype)
            assert halves == [offset + unit * 2**j * int(bits[0, r]), offset + unit * 2**j * int(bits[1, r])]


def test_plane_magics_leave_bit_7_clear():
    """Row 7's bit ORs into bit 7 of M: M's bit 7 (bf16: the exponent's lowest bit) must be clear,
    so that M | 2^7 reads M + unit * 2^7 exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        for plane in range(4):
            magic = mma.plane_magic(dtype, plane)
            unit = float16_value(magic, dtype) / float16_value(mma.MAGIC[dtype], dtype)
            for j in range(8):
                assert float16_value(magic | 1 << j, dtype) == float16_value(magic, dtype) + unit * 2**j


@pytest.mark.parametrize("head_dim, num_high, width", [(128, 64, 64), (128, 52, 64), (128, 128, 128), (128, 0, 0),
                                                        (64, 26, 32), (128, 70, 128)])
def test_high_tile_width(head_dim, num_high, width):
    assert mma.high_tile_width(head_dim, num_high) == width


@pytest.mark.parametrize("head_dim", [64, 128])
def test_value_rows_share_a_word_per_thread(head_dim):
    """value_row_channel is a permutation whose rows r, r + 8 (and r + 64, r + 72) are bits of one word,
    8 apart, as the unpacking requires."""
    channels = [mma.value_row_channel(r, head_dim) for r in range(head_dim)]
    assert sorted(channels) == list(range(head_dim))
    for row in range(head_dim):
        if row & 8 == 0:
            assert channels[row + 8] == channels[row] + 8
        if head_dim == 128 and row < 64:
            assert channels[row] // 32 == channels[row + 64] // 32


@pytest.mark.parametrize("rows, cols", [(2, 64), (4, 64), (2, 128), (4, 128), (8, 128), (64, 4), (128, 4), (64, 8), (128, 8)])
def test_copy_layout_holds_each_element_once(rows, cols):
    """The cp.async layouts of the key words ``[G / 32, D]`` and value words ``[G, b_V * D / 32]``:
    one CTA tile of the layout fits inside the shape (no element held by two threads) and tiles it."""
    layout = mma.copy_layout(rows, cols)
    tile = [s * t * w for s, t, w in zip(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta)]
    assert tile[0] <= rows and tile[1] <= cols and rows % tile[0] == 0 and cols % tile[1] == 0
    assert layout.size_per_thread[1] <= 4 and (layout.threads_per_warp[0] * layout.threads_per_warp[1]) == 32


def compile_for_sm90(preset: str, head_dim: int, dtype_name: str) -> str:
    """PTX of the split kernel built for an H100/H200 (sm_90) on this machine; run without
    ``TRITON_INTERPRET`` (the interpreter replaces the language functions the compiler needs)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    group, bits_high, bits_low, r = {"pnmix-1": (128, 3, 1, 0.5), "pnmix-2": (64, 3, 1, 0.4)}[preset]
    dtype = getattr(torch, dtype_name)
    kernel = mma._decode_split_kernel_mma
    constants = mma.kernel_constants(dtype, head_dim, 4, group, 2 * round(r * head_dim / 2), bits_high, bits_low, 2)
    floats = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    types = {"order_ptr": "*i64", "kc_high_ptr": "*i32", "kc_low_ptr": "*i32", "vc_ptr": "*i32", "sink_len_ptr": "*i32",
             "num_groups_ptr": "*i32", "res_len_ptr": "*i32", "m_out_ptr": "*fp32", "l_out_ptr": "*fp32", "acc_out_ptr": "*fp32"}  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else types.get(name, floats) if name.endswith("_ptr")
        else "fp32" if name == "qk_scale" else "i32"
        for name in kernel.arg_names
    }  # fmt: skip
    compiled = triton.compile(
        GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": mma.NUM_WARPS},
    )  # fmt: skip
    return compiled.asm["ptx"]


@pytest.mark.parametrize("preset, head_dim, dtype", [("pnmix-1", 128, "bfloat16"), ("pnmix-2", 64, "float16")])
def test_kernel_builds_for_sm90(preset, head_dim, dtype):
    """Compiles for sm_90 on this CPU (a separate process without the interpreter): the layouts are
    valid, every operand conversion is free (``assert_trivial``), the MMA and the unpacking are there."""
    code = (
        "import sys; sys.path.insert(0, 'tests/kernels'); import test_kernel_decode_attention_mma as t; "
        f"ptx = t.compile_for_sm90({preset!r}, {head_dim}, {dtype!r}); "
        "print(ptx.count('mma.sync.aligned.m16n8k16'), ptx.count('prmt.b32 x'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    mma_count, prmt_count = map(int, result.stdout.split()[-2:])
    assert mma_count > 0 and prmt_count > 0


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need a CUDA GPU")

CUDA_CASES = [
    ("pnmix-1", 128, 4, torch.bfloat16), ("pnmix-1", 128, 4, torch.float16), ("pnmix-1", 64, 4, torch.bfloat16),
    ("pnmix-1", 128, 1, torch.bfloat16), ("pnmix-1", 128, 7, torch.float16), ("pnmix-2", 128, 4, torch.bfloat16),
    ("pnmix-2", 64, 7, torch.float16), ("kivi-2", 128, 4, torch.bfloat16), ("kivi-2", 64, 1, torch.float16),
    ("r0", 128, 4, torch.bfloat16),
]  # fmt: skip


@requires_cuda
@pytest.mark.parametrize("layout, head_dim, ratio, dtype", CUDA_CASES)
@pytest.mark.parametrize(
    "lengths",
    [
        dict(sink_len=[32, 7, 0], num_groups=[3, 0, 2], residual_len=[1, 128, 65]),
        dict(sink_len=[31, 0, 1], num_groups=[1, 3, 2], residual_len=[63, 64, 0]),
    ],
)
def test_matches_reference_on_cuda(layout, head_dim, ratio, dtype, lengths):
    args = decode_inputs(seeded(), layout, head_dim, ratio, dtype, **lengths)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    assert mma.supports(args[0], args[5], args[6], args[9], args[10], args[2].shape[1])
    want = decode_attention_reference(*args)
    for splits in (None, 1, 3):
        got = mma.mma_decode_attention(*args, num_splits=splits).float()
        assert not got.isnan().any()
        # bf16 rounds q * scale and p to 8 significant bits (the Triton kernel's worst element is as far off)
        tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-2
        torch.testing.assert_close(got, want.float(), atol=tolerance, rtol=tolerance)
        assert (got - want.float()).norm() / want.float().norm() < tolerance / 4


def test_launch_passes_every_kernel_argument(monkeypatch):
    """On CPU: the launcher hands the Gluon kernel each of its parameters once (recorded, not run)."""
    calls = []

    class Recorder:
        arg_names = mma._decode_split_kernel_mma.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(mma, "_decode_split_kernel_mma", Recorder())
    monkeypatch.setattr(mma, "default_splits", lambda query, kv_programs, max_groups, group_size: 2)
    args = decode_inputs(seeded(), "pnmix-1", 128, 4, torch.bfloat16, sink_len=[3, 0], num_groups=[1, 2], residual_len=[5, 0])
    mma.mma_decode_attention(*args)
    (grid, positional, keywords), = calls
    assert grid == (2 * 2, 2)
    names = Recorder.arg_names
    assert len(positional) + len(keywords) - 1 == len(names)  # num_warps is a launch option
    assert set(keywords) - {"num_warps"} == set(names[len(positional):])
    assert positional[names.index("group_cap")] == args[5].shape[2]
    assert keywords["D"] == 128 and keywords["G"] == 128 and keywords["BLOCK_Q"] == 8
