"""Qwen3: ``Qwen3Attention``, rotate_half RoPE (pairs (i, i + D/2)), per-head q_norm/k_norm before RoPE."""

from .base import ArchitecturePatch

PATCH = ArchitecturePatch(
    model_type="qwen3",
    modeling_module="transformers.models.qwen3.modeling_qwen3",
    attention_class="Qwen3Attention",
    mlp_class="Qwen3MLP",
    qk_norm=True,
    norm_class="Qwen3RMSNorm",
)
