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
from transformers.activations import SiLUActivation

from .kernels.gemv import MAX_STACKED, gemv, gemv_stacked
from .kernels.gemv_swiglu import gemv_swiglu
from .mixins import RuntimeMixin, mixed_class, set_classes, unmixed_class


def _one_token(x: torch.Tensor, linear: torch.nn.Linear) -> bool:
    """``x`` is one token (``[..., in_features]``, every leading dim 1) of the weight's dtype, the
    weight a plain parameter (not a tensor subclass such as a sharded ``DTensor``) and autocast off
    (it would cast the operands)."""
    return (x.shape[:-1].numel() == 1 and x.dtype == linear.weight.dtype and type(linear.weight) is torch.nn.Parameter
            and not torch.is_autocast_enabled(x.device.type))  # fmt: skip


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
    return (not wants_grad and 1 <= len(linears) <= MAX_STACKED
            and all(type(m) is GemvLinear and _one_token(x, m) and _unhooked(m) for m in linears)
            and len({m.bias is None for m in linears}) == 1)  # fmt: skip


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


def _gated_mlp_class(model: torch.nn.Module) -> type | None:
    """The gated MLP class of ``model``'s architecture, if it is a supported one."""
    from .patches import PATCHES  # here, not at import: the adapters import this module

    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    adapter = PATCHES.get(getattr(text_config, "model_type", None))
    return getattr(adapter.module, adapter.mlp_class) if adapter is not None else None


def patch_gemv(model: torch.nn.Module) -> torch.nn.Module:
    """Route the one-token products of ``model``'s ``torch.nn.Linear`` layers to ``torch.ops.pnmix.gemv``,
    and fuse those that read the same token.

    Args:
        model: any module; every submodule whose class is exactly ``torch.nn.Linear`` becomes a
            :class:`GemvLinear` (in a transformers decoder: the attention and MLP projections and the
            LM head). In a Llama, Mistral, Qwen2 or Qwen3 model with a SiLU activation, each MLP also
            becomes a ``Gemv<MLP class>`` (:class:`GemvGatedMLP`): gate, up and SiLU in one launch.
            PN-Mix's attention (:func:`~pnmix_patch.patch_model`) reads q, k and v in one launch.

    Returns:
        The same model. Patching again changes nothing.

    Raises:
        ValueError: the model has no ``torch.nn.Linear`` layer (nor a patched one); a layer to patch has a
            ``forward`` set on the instance (other than accelerate's hooks, which keep running, see
            :func:`~pnmix_patch.mixins.set_classes`). Nothing is changed then.

    The gain was measured with the decode step replayed as a CUDA graph (``GraphedDecodeStep`` or
    ``torch.compile(..., mode="reduce-overhead")``, ``benchmarks/RESULTS.md``). Eager, each product
    also pays a custom op's and a Triton launch's host time (not measured on a GPU). A model patched
    by this function (and :func:`~pnmix_patch.patch_model`) deep-copies and pickles (``torch.save(model)``),
    and loads patched where ``pnmix_patch`` imports. Its ``state_dict`` and ``save_pretrained`` are unchanged.
    Layers hooked by accelerate (CPU offload) before patching keep their hooks, around the new forward.
    """
    modules = list(model.modules())
    if not any(type(module) in (torch.nn.Linear, GemvLinear) for module in modules):
        raise ValueError(f"{type(model).__name__} has no layer of the exact class torch.nn.Linear to patch "
                         "(subclasses, such as quantized linear layers, are left alone)")
    mlp_class = _gated_mlp_class(model)
    gated = [m for m in modules if type(m) is mlp_class and isinstance(m.act_fn, (torch.nn.SiLU, SiLUActivation))]
    set_classes([(m, GemvLinear) for m in modules if type(m) is torch.nn.Linear]
                + [(m, mixed_class(GemvGatedMLP, mlp_class)) for m in gated])  # fmt: skip
    return model


def unpatch_gemv(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_gemv`: every :class:`GemvLinear` layer is a ``torch.nn.Linear`` again, every MLP of its own class.

    Raises:
        ValueError: a patched layer has since been given a ``forward`` on the instance (see
            :func:`~pnmix_patch.mixins.set_classes`); nothing is changed then."""

    def own_class(module):
        return torch.nn.Linear if type(module) is GemvLinear else unmixed_class(type(module), GemvGatedMLP)

    set_classes((module, cls) for module in model.modules() if (cls := own_class(module)) is not None)
    return model
