"""``patch_gemv`` / ``unpatch_gemv``: a model's one-token linear products through ``pnmix::gemv``.

A batch-1 decode step reads every weight once, and the products' speed decides most of its time
once the cache is small (at 32K tokens PN-Mix's step reads 0.62 GB of cache against 15.0 GB of
Llama-3.1-8B's weights). On CUDA, ``torch.ops.pnmix.gemv`` (``kernels/gemv.py``) reads them closer
to the memory's speed than cuBLAS does through ``F.linear`` at one token (``benchmarks/RESULTS.md``).
This is independent of the cache: it serves a PN-Mix patched model and an unpatched one alike
(a fair bf16 baseline too).

Patching turns every ``torch.nn.Linear`` module (the exact class: subclasses such as quantized
linears keep theirs) into a :class:`GemvLinear` by changing its class, weights untouched: an input
holding one token goes to the op, anything else (prefill, batches) to ``F.linear``, a choice on
static shapes that ``torch.compile`` resolves while tracing. A class, not a ``forward`` set on each
instance: Dynamo guards a module's type anyway, while an instance attribute would add a guard per
layer to every compiled call. ``unpatch_gemv`` gives the modules their class back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.gemv import gemv


class GemvLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose one-token products run ``torch.ops.pnmix.gemv`` (made by :func:`patch_gemv`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear``, through ``pnmix::gemv`` when ``x`` holds one token (``[..., in_features]`` with
        every leading dim 1) of the weight's dtype, the weight is a plain parameter (not a tensor
        subclass such as a sharded ``DTensor``) and autocast is off (it would cast the operands)."""
        if (x.shape[:-1].numel() != 1 or x.dtype != self.weight.dtype or type(self.weight) is not torch.nn.Parameter
                or torch.is_autocast_enabled(x.device.type)):  # fmt: skip
            return F.linear(x, self.weight, self.bias)
        return gemv(x.reshape(-1), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def patch_gemv(model: torch.nn.Module) -> torch.nn.Module:
    """Route the one-token products of ``model``'s ``torch.nn.Linear`` layers to ``torch.ops.pnmix.gemv``.

    Args:
        model: any module; every submodule whose class is exactly ``torch.nn.Linear`` becomes a
            :class:`GemvLinear` (in a transformers decoder: the attention and MLP projections and the
            LM head).

    Returns:
        The same model. Patching again changes nothing.

    Raises:
        ValueError: the model has no ``torch.nn.Linear`` layer (nor a patched one).

    The gain was measured with the decode step replayed as a CUDA graph (``GraphedDecodeStep`` or
    ``torch.compile(..., mode="reduce-overhead")``, ``benchmarks/RESULTS.md``). Eager, each product
    also pays a custom op's and a Triton launch's host time (not measured on a GPU).
    """
    modules = list(model.modules())
    if not any(type(module) in (torch.nn.Linear, GemvLinear) for module in modules):
        raise ValueError(f"{type(model).__name__} has no layer of the exact class torch.nn.Linear to patch "
                         "(subclasses, such as quantized linear layers, are left alone)")
    for module in modules:
        if type(module) is torch.nn.Linear:
            module.__class__ = GemvLinear
    return model


def unpatch_gemv(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_gemv`: every :class:`GemvLinear` layer is a ``torch.nn.Linear`` again."""
    for module in model.modules():
        if type(module) is GemvLinear:
            module.__class__ = torch.nn.Linear
    return model
