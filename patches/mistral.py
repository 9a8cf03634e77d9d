"""Mistral: ``MistralAttention``, rotate_half RoPE (pairs (i, i + D/2))."""

from .base import ArchitecturePatch

PATCH = ArchitecturePatch(
    model_type="mistral",
    modeling_module="transformers.models.mistral.modeling_mistral",
    attention_class="MistralAttention",
    mlp_class="MistralMLP",
    qk_norm=False,
)
