"""Llama: ``LlamaAttention``, rotate_half RoPE (pairs (i, i + D/2))."""

from .base import ArchitecturePatch

PATCH = ArchitecturePatch(
    model_type="llama",
    modeling_module="transformers.models.llama.modeling_llama",
    attention_class="LlamaAttention",
    mlp_class="LlamaMLP",
    qk_norm=False,
)
