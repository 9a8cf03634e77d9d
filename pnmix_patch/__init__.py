"""pnmix-patch: PN-Mix KV-cache quantization for Hugging Face transformers.

One line, ``patch_model(model)``, rewrites the attention of Llama, Mistral, Qwen2
and Qwen3 models so that their KV cache holds keys at ~2.25 bits (pair-norm guided
mixed precision) and values at 2 bits. See ``README.md`` and ``docs/method.md``.
"""

from .api import is_patched, new_cache, patch_gemv, patch_model, unpatch_gemv, unpatch_model
from .cache import PNMixCache, PNMixLayer
from .cache_io import CacheFileError, CacheFileInfo, cache_argument, cache_info, continuation_inputs, load_cache, prefill, save_cache
from .config import PRESETS, SELECTION_CRITERIA, PNMixConfig
from .graphed_decode import GraphedDecodeStep
from .linear import GemvLinear
from .patches import SUPPORTED_MODEL_TYPES
from .static_cache import PNMixStaticCache, PNMixStaticLayer

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CacheFileError",
    "CacheFileInfo",
    "SELECTION_CRITERIA",
    "SUPPORTED_MODEL_TYPES",
    "GemvLinear",
    "GraphedDecodeStep",
    "PNMixCache",
    "PNMixConfig",
    "PNMixLayer",
    "PNMixStaticCache",
    "PNMixStaticLayer",
    "cache_argument",
    "cache_info",
    "continuation_inputs",
    "is_patched",
    "load_cache",
    "new_cache",
    "patch_gemv",
    "patch_model",
    "prefill",
    "save_cache",
    "unpatch_gemv",
    "unpatch_model",
]
