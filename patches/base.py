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
        pairing: RoPE pairing, ``"half"`` (``rotate_half``) or ``"interleaved"``.
    """

    model_type: str
    modeling_module: str
    attention_class: str
    mlp_class: str
    qk_norm: bool = False
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
        """Queries, keys and values ``[B, heads, T, D]`` before RoPE (after q/k norms); one launch for
        the three products of a token after :func:`pnmix_patch.patch_gemv`."""
        shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
        projections = stacked_products(hidden_states, (attention.q_proj, attention.k_proj, attention.v_proj))
        query, key, value = (projection.view(shape) for projection in projections)
        if self.qk_norm:
            query, key = attention.q_norm(query), attention.k_norm(key)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def rotary(self):
        """The architecture's own RoPE function ``(query, key, cos, sin) -> (query, key)``
        (looked up once, at patch time: a module import cannot be traced by ``torch.compile``)."""
        return self.module.apply_rotary_pos_emb
