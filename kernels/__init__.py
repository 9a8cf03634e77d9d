"""Triton kernels of PN-Mix, registered as torch custom ops in the ``pnmix`` namespace.

Importing this package registers:

- ``torch.ops.pnmix.pack_keys``: :func:`pnmix_patch.quantize.quantize_keys`, bit-identical;
- ``torch.ops.pnmix.pack_values``: :func:`pnmix_patch.quantize.quantize_values`, bit-identical;
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

From the repository root this folder is also importable as a top-level ``kernels``
(transformers probes that name for the Hugging Face ``kernels`` package); the ops
are registered only under the installed name ``pnmix_patch.kernels``, so that probe
has no side effects and no op is registered twice.
"""

if __name__ == "pnmix_patch.kernels":
    from . import decode_append, decode_attention, gemv, gemv_swiglu, pack_keys, pack_values  # noqa: F401  (registers the ops)
