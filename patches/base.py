"""What an architecture adapter says: which modules to rewrite, how to project, RoPE pairing.

Every supported architecture computes attention the same way up to the RoPE
application; an adapter names the attention class, whether per-head q/k norms
come first (Qwen3), the RoPE pairing, and which configurations it refuses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ..linear import stacked_products


@dataclass(frozen=True)
class ArchitecturePatch:
    """How PN-Mix rewrites the attention of one architecture.

    Args:
        model_type: the ``config.model_type`` it serves.
        modeling_module: the transformers module defining the attention class.
        attention_class: name of the attention ``nn.Module`` whose forward is replaced.
        mlp_class: name of the gated MLP ``nn.Module`` (``down_proj(act_fn(gate_proj(x)) *
            up_proj(x))``), whose one-token products :func:`pnmix_patch.patch_gemv` fuses.
        qk_norm: the module applies ``q_norm``/``k_norm`` per head before RoPE; pair
            norms are taken after them.
        norm_class: the class of ``q_norm``/``k_norm`` (named as in ``modeling_module``) whose forward
            the decode append kernel repeats (transformers' RMSNorm); see :meth:`kernel_norms`.
        pairing: RoPE pairing, ``"half"`` (``rotate_half``) or ``"interleaved"``.
    """

    model_type: str
    modeling_module: str
    attention_class: str
    mlp_class: str
    qk_norm: bool = False
    norm_class: str = ""
    pairing: str = "half"

    @property
    def module(self):
        return importlib.import_module(self.modeling_module)

    def attention_type(self) -> type:
        return getattr(self.module, self.attention_class)

    def check_config(self, config) -> None:
        """Raise for configurations PN-Mix cannot serve faithfully."""
        layer_types = getattr(config, "layer_types", None) or []
        sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        if sliding or (self.model_type == "mistral" and getattr(config, "sliding_window", None) is not None):
            raise ValueError(
                f"{self.model_type} model uses sliding-window attention (layer_types={layer_types or None}, "
                f"sliding_window={getattr(config, 'sliding_window', None)}); PN-Mix supports full attention only. "
                "Set config.sliding_window=None (and use_sliding_window=False) to run with full attention."
            )

    def project(self, attention: torch.nn.Module, hidden_states: torch.Tensor):
        """Queries, keys and values ``[B, heads, T, D]`` before the q/k norms (:meth:`norms`) and RoPE;
        one launch for the three products of a token after :func:`pnmix_patch.patch_gemv`."""
        shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
        projections = stacked_products(hidden_states, (attention.q_proj, attention.k_proj, attention.v_proj))
        query, key, value = (projection.view(shape).transpose(1, 2) for projection in projections)
        return query, key, value

    def norms(self, attention: torch.nn.Module, query: torch.Tensor, key: torch.Tensor):
        """Queries and keys through the module's ``q_norm``/``k_norm`` (per head; Qwen3), or as given."""
        if self.qk_norm:
            return attention.q_norm(query), attention.k_norm(key)
        return query, key

    def kernel_norms(self, attention: torch.nn.Module):
        """What the decode append kernel needs to run :meth:`norms` and RoPE itself
        (``pnmix::decode_rotate_append``): ``(query weight, key weight, eps)``, ``(None, None, 0.0)``
        without q/k norms; None where it cannot: another RoPE pairing than rotate_half, or norms that
        are not two modules of ``norm_class`` with one epsilon (the kernel repeats that class's forward).
        Classes are compared by name: importing the module cannot be traced by ``torch.compile``."""
        if self.pairing != "half":
            return None
        if not self.qk_norm:
            return None, None, 0.0
        q_norm, k_norm = attention.q_norm, attention.k_norm
        norm_type = type(q_norm)
        ours = norm_type.__name__ == self.norm_class and norm_type.__module__ == self.modeling_module
        if not (ours and type(k_norm) is norm_type and q_norm.variance_epsilon == k_norm.variance_epsilon):
            return None
        return q_norm.weight, k_norm.weight, q_norm.variance_epsilon

    def rotary(self):
        """The architecture's own RoPE function ``(query, key, cos, sin) -> (query, key)``
        (looked up once, at patch time: a module import cannot be traced by ``torch.compile``)."""
        return self.module.apply_rotary_pos_emb
