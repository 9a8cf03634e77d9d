"""Linear layers whose one-token products run ``pnmix::gemv`` (:func:`pnmix_patch.patch_gemv` installs them).

A batch-1 decode step reads every weight once, and the products' speed decides most of its time
once the cache is small (at 32K tokens PN-Mix's step reads 0.62 GB of cache against 15.0 GB of
Llama-3.1-8B's weights). On CUDA, ``torch.ops.pnmix.gemv`` (``kernels/gemv.py``) reads them closer
to the memory's speed than cuBLAS does through ``F.linear`` at one token.
This is independent of the cache: it serves a PN-Mix patched model and an unpatched one alike
(a fair bf16 baseline too).

Patching turns every ``torch.nn.Linear`` module (the exact class: subclasses such as quantized
linears keep theirs) into a :class:`GemvLinear` by changing its class, weights untouched: an input
holding one token goes to the op, anything else (prefill, batches) to ``F.linear``, a choice on
static shapes that ``torch.compile`` resolves while tracing. A class, not a ``forward`` set on each
instance: Dynamo guards a module's type anyway, while an instance attribute would add a guard per
layer to every compiled call. ``unpatch_gemv`` gives the modules their class back.

Products that read the same token are also fused, one launch instead of two or three (fewer
launches and kernel tails per step), when no gradient is needed (the fused ops have no backward)
and none of the layers has a forward hook (a user's, or accelerate's CPU offload, which moves a
layer's weights in when the layer is called: such layers are called one by one):

- the gated MLP of a supported architecture (``mlp_class`` of its adapter in ``pnmix_patch.patches``,
  with a SiLU activation) becomes a subclass whose forward reads the gate and up weights and applies
  the SiLU in one ``pnmix::gemv_swiglu``;
- :func:`stacked_products` reads a layer's q, k and v weights in one ``pnmix::gemv_stacked``. PN-Mix's
  attention forward projects through it; a model's own (unpatched) attention forward calls the
  three layers one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from .kernels.gemv import MAX_STACKED, gemv, gemv_stacked
from .kernels.gemv_swiglu import gemv_swiglu
from .mixins import RuntimeMixin


def _one_token(x: torch.Tensor, linear: torch.nn.Linear) -> bool:
    """``x`` is one token (``[..., in_features]``, every leading dim 1) of the weight's dtype, the
    weight a plain parameter (not a tensor subclass such as a sharded ``DTensor``) and autocast off
    (it would cast the operands)."""
    return (
        x.shape[:-1].numel() == 1
        and x.dtype == linear.weight.dtype
        and type(linear.weight) is torch.nn.Parameter
        and not torch.is_autocast_enabled(x.device.type)
    )


def _unhooked(module: torch.nn.Module) -> bool:
    """No forward hook would run on ``module``'s call: none of its own, no global one, and no accelerate
    hook (``_hf_hook``: CPU offload moves the weights in only when the layer itself is called)."""
    hooks = module._forward_hooks or module._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks
    return not hooks and not hasattr(module, "_hf_hook")


def _fusable(x: torch.Tensor, linears) -> bool:
    """One launch may serve all of ``linears`` on ``x``: 1 to ``MAX_STACKED`` layers, each a
    :class:`GemvLinear` that would send ``x`` to the op and has no hook (a fused launch never calls the
    layers, so their hooks could not run), they all have a bias or none does, and no gradient is needed."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for m in linears for p in m.parameters()))
    return (
        not wants_grad
        and 1 <= len(linears) <= MAX_STACKED
        and all(type(m) is GemvLinear and _one_token(x, m) and _unhooked(m) for m in linears)
        and len({m.bias is None for m in linears}) == 1
    )


class GemvLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose one-token products run ``torch.ops.pnmix.gemv`` (made by :func:`patch_gemv`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear``, through ``pnmix::gemv`` when ``x`` holds one token of the weight's dtype, the
        weight is a plain parameter and autocast is off."""
        if not _one_token(x, self):
            return F.linear(x, self.weight, self.bias)
        return gemv(x.reshape(-1), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def stacked_products(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, in one launch of ``pnmix::gemv_stacked`` when ``x`` is
    one token, every layer an unhooked :class:`GemvLinear` and no gradient is needed (1 to 3 layers of
    one input size, e.g. an attention's q, k and v projections; more are called one by one)."""
    if not _fusable(x, linears):
        return tuple(linear(x) for linear in linears)
    biases = [] if linears[0].bias is None else [linear.bias for linear in linears]
    stacked = gemv_stacked(x.reshape(-1), [linear.weight for linear in linears], biases)
    sizes = [linear.out_features for linear in linears]
    return tuple(y.view(*x.shape[:-1], size) for y, size in zip(stacked.split(sizes), sizes))


class GemvGatedMLP(RuntimeMixin):
    """Mixin of a gated MLP (``down_proj(silu(gate_proj(x)) * up_proj(x))``) whose one-token gate and up
    products and SiLU run in one ``pnmix::gemv_swiglu`` (:func:`patch_gemv` gives each MLP the class
    ``Gemv<its MLP class>``, see :mod:`pnmix_patch.mixins`)."""

    prefix = "Gemv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fusable(x, (self.gate_proj, self.up_proj)):
            return super().forward(x)
        hidden = gemv_swiglu(x.reshape(-1), self.gate_proj.weight, self.up_proj.weight, self.gate_proj.bias, self.up_proj.bias)
        return self.down_proj(hidden.view(*x.shape[:-1], -1))
