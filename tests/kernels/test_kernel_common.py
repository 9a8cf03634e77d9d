"""``kernels/common.py``'s programmatic dependent launch: when kernels launch with it, and that every
kernel launched with it waits before its first access to memory written by another kernel (checked in
its sm_90 build; the one-token products read their weights' first block before)."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pnmix_patch.kernels import common


def test_launch_pdl_only_on_cuda_tensors_of_a_hopper_or_newer_gpu(monkeypatch):
    assert not common.launch_pdl(torch.ones(2))
    cuda_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(common, "has_pdl", lambda index: index == 0)
    monkeypatch.setattr(common, "PDL", True)
    assert common.launch_pdl(cuda_tensor)
    assert not common.launch_pdl(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    monkeypatch.setattr(common, "PDL", False)
    assert not common.launch_pdl(cuda_tensor)


def test_the_pdl_block_overrides_the_default_per_thread_and_is_undone_on_exit(monkeypatch):
    """``programmatic_dependent_launch`` sets what ``launch_pdl`` reads within its block only: nested blocks
    restore the outer setting, an exception restores it, and another thread keeps its own even when the
    two threads' blocks end out of order."""
    import threading

    monkeypatch.setattr(common, "PDL", False)
    with common.programmatic_dependent_launch(True):
        assert common.pdl_requested()
        with common.programmatic_dependent_launch(False):
            assert not common.pdl_requested()
        assert common.pdl_requested()
    assert not common.pdl_requested()
    with pytest.raises(KeyError), common.programmatic_dependent_launch(True):
        raise KeyError
    assert not common.pdl_requested()
    monkeypatch.setattr(common, "PDL", True)
    with common.programmatic_dependent_launch(False):
        assert not common.pdl_requested()
    assert common.pdl_requested()

    entered, leave, seen = threading.Event(), threading.Event(), []

    def other_thread():  # enters a block first, leaves it after this thread's block has ended
        with common.programmatic_dependent_launch(False):
            entered.set()
            leave.wait()
            seen.append(common.pdl_requested())
        seen.append(common.pdl_requested())

    thread = threading.Thread(target=other_thread)
    with common.programmatic_dependent_launch(False):
        thread.start()
        entered.wait()
    assert common.pdl_requested()  # this thread's block ended while the other's is still open
    with common.programmatic_dependent_launch(False):
        leave.set()
        thread.join()
    assert seen == [False, True] and common.pdl_requested()


I32, I64, F32 = "*i32", "*i64", "*fp32"
APPEND_POINTERS = {
    "order_ptr": I64,
    "sink_len_ptr": I32,
    "res_len_ptr": I32,
    "high_ptr": I32,
    "low_ptr": I32,
    "vc_ptr": I32,
    "num_groups_ptr": I32,
    "overflow_ptr": "*i1",
    "arrivals_ptr": I32,
}
KERNELS = {
    "gemv": ("pnmix_patch.kernels.gemv", "_gemv_kernel", {}, "dict(HAS_BIAS=True, BLOCK_K=1024, EVEN_K=True)"),
    "gemv_swiglu": ("pnmix_patch.kernels.gemv_swiglu", "_gemv_swiglu_kernel", {}, "dict(HAS_BIAS=True, BLOCK_K=512, EVEN_K=True)"),
    "gemv-masked": ("pnmix_patch.kernels.gemv", "_gemv_kernel", {}, "dict(HAS_BIAS=False, BLOCK_K=1024, EVEN_K=False)"),
    "gemv_swiglu-masked": ("pnmix_patch.kernels.gemv_swiglu", "_gemv_swiglu_kernel", {}, "dict(HAS_BIAS=False, BLOCK_K=512, EVEN_K=False)"),
    "combine": (
        "pnmix_patch.kernels.common",
        "merge_splits_kernel",
        {"m_ptr": F32, "l_ptr": F32, "acc_ptr": F32, "overflow_ptr": "*i1"},
        "dict(D=128, BLOCK_D=128, BLOCK_S=64, HAS_OVERFLOW=True)",
    ),
    "append": (
        "pnmix_patch.kernels.decode_append",
        "_append_token_kernel",
        APPEND_POINTERS,
        "dict(BLOCK_D=128, NUM_HIGH=64, G=128, PLANES_HIGH=2, BITS_LOW=1, MIDPOINT=True, BLOCK_T=32, HIGH_DISTANCE=64, LOW_DISTANCE=64, "
        "ROTATE=False, NORM=False, RATIO=1, BLOCK_R=1, "
        "**__import__('pnmix_patch.kernels.pack_values', fromlist=['value_layout']).value_layout(128, 1, 2))",
    ),
    "append-rotate": (
        "pnmix_patch.kernels.decode_append",
        "_append_token_kernel",
        APPEND_POINTERS,
        "dict(BLOCK_D=128, NUM_HIGH=64, G=128, PLANES_HIGH=2, BITS_LOW=1, MIDPOINT=True, BLOCK_T=32, HIGH_DISTANCE=64, LOW_DISTANCE=64, "
        "ROTATE=True, NORM=True, RATIO=4, BLOCK_R=4, "
        "**__import__('pnmix_patch.kernels.pack_values', fromlist=['value_layout']).value_layout(128, 1, 2))",
    ),
    "split-triton": (
        "pnmix_patch.kernels.decode_attention",
        "_decode_split_kernel",
        {
            "order_ptr": I64,
            "kc_high_ptr": I32,
            "kc_low_ptr": I32,
            "vc_ptr": I32,
            "sink_len_ptr": I32,
            "num_groups_ptr": I32,
            "res_len_ptr": I32,
            "m_out_ptr": F32,
            "l_out_ptr": F32,
            "acc_out_ptr": F32,
        },
        "dict(RATIO=4, BLOCK_Q=16, D=128, BLOCK_D=128, G=128, C_HIGH=64, PLANES_HIGH=2, BITS_LOW=1, BITS_V=2, "
        "GV=128, HIGH_DISTANCE=64, LOW_DISTANCE=64, BLOCK_N_DENSE=64, DOT_PRECISION='tf32')",
    ),
    "split-gluon": (
        "pnmix_patch.kernels.decode_attention_mma",
        "_decode_split_kernel_mma",
        {
            "order_ptr": I64,
            "kc_high_ptr": I32,
            "kc_low_ptr": I32,
            "vc_ptr": I32,
            "sink_len_ptr": I32,
            "num_groups_ptr": I32,
            "res_len_ptr": I32,
            "m_out_ptr": F32,
            "l_out_ptr": F32,
            "acc_out_ptr": F32,
        },
        "__import__('pnmix_patch.kernels.decode_attention_mma', fromlist=['kernel_constants']).kernel_constants(128, 4, 128, 64, 3, 1, 2)",
    ),
}
# The first instruction of the PTX that reads or writes global memory (or shared memory from it).
MEMORY = ("ld.global", "st.global", "atom.global", "red.global", "cp.async")
BUILD = """
import importlib, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
module, name, types, constants, pdl = sys.argv[1], sys.argv[2], eval(sys.argv[3]), eval(sys.argv[4]), sys.argv[5] == "1"
kernel = getattr(importlib.import_module(module), name)
constants["PDL"] = pdl
signature = {n: "constexpr" if n in constants else types.get(n, "*bf16") if n.endswith("_ptr")
             else "fp32" if n in ("qk_scale", "eps") else "i32" for n in kernel.arg_names}
source = (GluonASTSource if name.endswith("_mma") else ASTSource)(kernel, signature, constants)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def sm90_ptx(kernel: str, pdl: bool) -> str:
    """PTX of one of :data:`KERNELS` built for sm_90 in a process without the Triton interpreter. The
    pointers have no alignment specialization, so loads a real launch makes 16-byte vectors are scalar
    here: the tests check the order of the instructions, which that does not change."""
    module, name, pointer_types, constants = KERNELS[kernel]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", BUILD, module, name, repr(pointer_types), constants, "1" if pdl else "0"]
    result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


PREFETCHING = {kernel: "x_ptr" for kernel in ("gemv", "gemv_swiglu", "gemv-masked", "gemv_swiglu-masked")}
"""Kernels that read their weights' first block before waiting, and the input they must not read before."""


def registers_derived_from(ptx: str, kernel: str, argument: str) -> set[str]:
    """The PTX registers whose value depends on the pointer ``argument`` of ``kernel`` (its parameter
    index among the non-constexpr arguments), following every instruction's operands in order."""
    _, name, _, constants = KERNELS[kernel]
    module = __import__(KERNELS[kernel][0], fromlist=[name])
    constexprs = set(eval(constants)) | {"PDL"}
    parameters = [n for n in getattr(module, name).arg_names if n not in constexprs]
    source = f"_param_{parameters.index(argument)}]"
    derived = set()
    for line in ptx.splitlines():
        operands = re.findall(r"%\w+|\w+_param_\d+\]", line.split("//")[0].lstrip("@%p0123456789! \t"))
        if len(operands) > 1 and any(o in derived or o.endswith(source) for o in operands[1:]):
            derived.add(operands[0])
    return derived


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernels_wait_for_the_previous_kernel_before_touching_memory(kernel):
    """Built with ``PDL``: ``griddepcontrol.wait`` comes before the first global load, store or atomic
    (else a kernel launched early could read its inputs before the previous kernel has written them),
    except for the one-token products' loads of their first weight block, which must not depend on
    ``x``; ``griddepcontrol.launch_dependents`` comes after the wait. Without it, neither instruction."""
    ptx = sm90_ptx(kernel, pdl=True)
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("griddepcontrol.launch_dependents")
    early = [line for line in ptx[:wait].splitlines() if any(op in line for op in MEMORY)]
    if kernel in PREFETCHING:
        from_x = registers_derived_from(ptx, kernel, PREFETCHING[kernel])
        assert early and all("ld.global" in line and not set(re.findall(r"%\w+", line.split("[")[1])) & from_x for line in early)
        assert any(set(re.findall(r"%\w+", line.split("[")[1])) & from_x for line in ptx[wait:].splitlines() if "ld.global" in line)
    else:
        assert early == []
    assert "griddepcontrol" not in sm90_ptx(kernel, pdl=False)
