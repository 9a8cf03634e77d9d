"""Qwen2: ``Qwen2Attention``, rotate_half RoPE (pairs (i, i + D/2))."""

from .base import ArchitecturePatch

PATCH = ArchitecturePatch(
    model_type="qwen2",
    modeling_module="transformers.models.qwen2.modeling_qwen2",
    attention_class="Qwen2Attention",
    mlp_class="Qwen2MLP",
    qk_norm=False,
)
