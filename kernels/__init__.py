"""Triton kernels of PN-Mix, registered as torch custom ops in the ``pnmix`` namespace.

Importing this package registers:

- ``torch.ops.pnmix.pack_keys``: :func:`pnmix_patch.reference.quantize.quantize_keys`, bit-identical;
- ``torch.ops.pnmix.pack_values``: :func:`pnmix_patch.reference.quantize.quantize_values`, bit-identical;
- ``torch.ops.pnmix.decode_attention``: fused split-K decode attention over sinks,
  packed groups and residual, reading the codes in registers (on CUDA the Gluon kernel of
  ``decode_attention_mma`` for the shapes of real models, the Triton kernel otherwise);
- ``torch.ops.pnmix.decode_append``: one decode token into the static cache in place,
  flushing a full residual buffer on the device (no host synchronization), and
  ``torch.ops.pnmix.decode_rotate_append``: the same with the token's q/k norms and RoPE done
  in the same kernel (it returns the rotated queries);
- ``torch.ops.pnmix.gemv``: one token through a linear layer at the memory's speed
  (:func:`pnmix_patch.patch_gemv` routes a model's one-token products to it), and
  ``torch.ops.pnmix.gemv_stacked``: up to three such products in one launch (q, k, v);
- ``torch.ops.pnmix.gemv_swiglu``: a gated MLP's gate and up products and its SiLU in one launch.

Each op runs its PyTorch reference on CPU (and any non-CUDA device) and Triton on
CUDA, and has a fake implementation for ``torch.compile``. Each module holds one
op (``from pnmix_patch.kernels.pack_keys import pack_keys``) and its ``triton_*``
launcher, which tests call directly on CPU tensors under ``TRITON_INTERPRET=1``.
The package does not re-export the ops: their names would shadow the modules.

Where the repository root is on ``sys.path`` (``python -m`` or ``python -c`` run from it,
or ``PYTHONPATH``), this folder is also found as a top-level ``kernels``, the name of the
Hugging Face package that transformers imports (a dependency from transformers 5.25 on,
imported with the models: ``from kernels import CUDAProperties, ...``). The ops are
registered only under the installed name ``pnmix_patch.kernels``; imported as ``kernels``,
this module puts the package that the name would find without the repository root in its
own place (:func:`_hand_over_to_shadowed_package`), or stays empty where there is none.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _hand_over_to_shadowed_package() -> None:
    """Make ``import kernels`` return the ``kernels`` package found on ``sys.path`` without the
    repository root (the import system returns ``sys.modules[name]`` as it stands after this
    module has run), if there is one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


if __name__ == "pnmix_patch.kernels":
    from . import decode_append, decode_attention, gemv, gemv_swiglu, pack_keys, pack_values  # noqa: F401  (registers the ops)
elif __name__ == "kernels":
    _hand_over_to_shadowed_package()
