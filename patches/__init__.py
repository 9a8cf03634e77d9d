"""Per-architecture adapters, mapped from ``config.model_type``."""

from . import llama, mistral, qwen2, qwen3
from .base import ArchitecturePatch

PATCHES: dict[str, ArchitecturePatch] = {p.PATCH.model_type: p.PATCH for p in (llama, mistral, qwen2, qwen3)}

SUPPORTED_MODEL_TYPES = tuple(PATCHES)


def get_patch(model_type: str) -> ArchitecturePatch:
    """The adapter for ``model_type``; a clear error for anything else."""
    if model_type not in PATCHES:
        raise ValueError(f"model_type={model_type!r} is not supported by PN-Mix: supported model types are {list(SUPPORTED_MODEL_TYPES)}")
    return PATCHES[model_type]


__all__ = ["ArchitecturePatch", "PATCHES", "SUPPORTED_MODEL_TYPES", "get_patch"]
