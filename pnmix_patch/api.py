"""``patch_model`` / ``unpatch_model``: the one line added to an existing script.

Patching a built model instance:

1. replaces the ``forward`` of every attention module of the architecture with
   :func:`~pnmix_patch.attention.pnmix_attention_forward` (instance attribute, so
   ``unpatch_model`` restores the class's own forward exactly);
2. wraps the decoder's ``forward`` so that a missing cache (``use_cache=True``) or
   the empty ``DynamicCache`` that ``generate`` creates becomes a
   :class:`~pnmix_patch.cache.PNMixCache`, and an empty transformers ``StaticCache``
   (``generate(..., cache_implementation="static")``) a
   :class:`~pnmix_patch.static_cache.PNMixStaticCache` of the same ``max_cache_len``
   (kept on the model and reset in place on the next call, so compiled decode steps
   are reused; a new one when the layers' devices changed); ``generate`` then carries it from the model's outputs, so
   ``generate``, pipelines and hand-written loops need no change;
3. sets ``config._attn_implementation = "pnmix"``, registered with transformers'
   attention and mask interfaces (the mask is the boolean SDPA mask: without a
   registered mask function, left-padded batches would silently get no mask).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import types

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import pnmix_attention_forward
from .cache import PNMixCache
from .config import PNMixConfig, resolve_config
from .patches import get_patch
from .static_cache import PNMixStaticCache

ATTENTION_NAME = "pnmix"
_STATE_ATTRIBUTE = "_pnmix_state"

AttentionInterface.register(ATTENTION_NAME, sdpa_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def patch_model(model: torch.nn.Module, config: PNMixConfig | str = "pnmix-1") -> torch.nn.Module:
    """Rewrite ``model``'s attention into PN-Mix attention, in place.

    Args:
        model: a transformers Llama, Mistral, Qwen2 or Qwen3 model (``*ForCausalLM`` or
            the bare decoder).
        config: a :class:`~pnmix_patch.PNMixConfig` or a preset name
            (``"pnmix-1"``, ``"pnmix-2"``, ``"kivi-2"``, ``"fp16"``).

    Returns:
        The same model. Patching again only changes the config. The patched forwards are bound to
        the modules at run time and do not pickle: :func:`unpatch_model` before ``torch.save(model)``
        (``state_dict`` and ``save_pretrained`` are unaffected).

    Raises:
        ValueError: unsupported architecture or configuration (sliding windows).
    """
    pnmix_config = resolve_config(config)
    model_config = model.config.get_text_config(decoder=True)
    adapter = get_patch(model_config.model_type)
    adapter.check_config(model_config)
    _check_shapes_and_dtype(model, model_config, pnmix_config)
    state = getattr(model, _STATE_ATTRIBUTE, None)
    if state is not None:
        state["config"] = pnmix_config
        return model

    attention_type = adapter.attention_type()
    attentions = [m for m in model.modules() if isinstance(m, attention_type)]
    if not attentions:
        raise ValueError(f"found no {adapter.attention_class} module in {type(model).__name__}")
    for attention in attentions:
        # A copy per module: one adapter shared by all of them would cost a compiled call one
        # Python "is" test per layer in Dynamo's guards.
        attention._pnmix_adapter = dataclasses.replace(adapter)
        attention._pnmix_rotary = adapter.rotary()
        attention.forward = types.MethodType(pnmix_attention_forward, attention)

    decoder = _decoder_of(model)
    state = {
        "config": pnmix_config,
        "adapter": adapter,
        "attentions": attentions,
        "decoder": decoder,
        "attn_implementation": model_config._attn_implementation,
    }
    decoder.forward = _cache_creating_forward(decoder, decoder.forward, state)
    model_config._attn_implementation = ATTENTION_NAME
    setattr(model, _STATE_ATTRIBUTE, state)
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model`: the original forwards and attention implementation are back."""
    state = getattr(model, _STATE_ATTRIBUTE, None)
    if state is None:
        return model
    for attention in state["attentions"]:
        del attention.forward
        del attention._pnmix_adapter
        del attention._pnmix_rotary
    del state["decoder"].forward
    model.config.get_text_config(decoder=True)._attn_implementation = state["attn_implementation"]
    delattr(model, _STATE_ATTRIBUTE)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched."""
    return hasattr(model, _STATE_ATTRIBUTE)


def new_cache(model: torch.nn.Module, max_cache_len: int | None = None, static: bool = False) -> PNMixCache:
    """An empty PN-Mix cache for a patched ``model`` (its config and RoPE pairing).

    Args:
        model: a model patched with :func:`patch_model`.
        max_cache_len: positions the cache accepts (prompt plus generated tokens);
            default the model's ``max_position_embeddings``; required when ``static``.
        static: a :class:`~pnmix_patch.static_cache.PNMixStaticCache` (preallocated,
            compileable with ``torch.compile(fullgraph=True)`` and CUDA graphs) instead
            of the growing :class:`~pnmix_patch.cache.PNMixCache`.
    """
    state = getattr(model, _STATE_ATTRIBUTE, None)
    if state is None:
        raise ValueError("the model is not patched: call pnmix_patch.patch_model(model) first")
    if static:
        return PNMixStaticCache(model.config, state["config"], state["adapter"].pairing, max_cache_len, _layer_devices(model))
    return PNMixCache(model.config, state["config"], state["adapter"].pairing, max_cache_len)


def _layer_devices(model: torch.nn.Module) -> list[torch.device] | None:
    """The device of each decoder layer: of its first parameter or buffer, else the previous layer's
    (None when no layer has any)."""
    found = [next(itertools.chain(layer.parameters(), layer.buffers()), None) for layer in _decoder_of(model).layers]
    known = [tensor.device for tensor in found if tensor is not None]
    if not known:
        return None
    devices, device = [], known[0]  # leading layers without tensors: the first device found
    for tensor in found:
        device = device if tensor is None else tensor.device
        devices.append(device)
    return devices


def _check_shapes_and_dtype(model, model_config, pnmix_config: PNMixConfig) -> None:
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} has no RoPE pairs: allowed an even head dim")
    if pnmix_config.quantize and head_dim % 32:
        raise ValueError(f"head_dim={head_dim} cannot be bit-packed: allowed a multiple of 32 (or the 'fp16' preset)")
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"model dtype {dtype} is not supported: allowed torch.float16, torch.bfloat16, torch.float32")


def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward creates the cache (``LlamaModel`` for ``LlamaForCausalLM``)."""
    if hasattr(model, "embed_tokens") and hasattr(model, "layers"):
        return model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"cannot find the decoder of {type(model).__name__}")
    return decoder


def _cache_creating_forward(decoder, original, state):
    """Wrap the decoder's forward so that it runs on a PN-Mix cache."""
    parameters = list(inspect.signature(original).parameters)
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    cache_position = parameters.index(cache_name)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        args = list(args)
        cache = args[cache_position] if len(args) > cache_position else None
        # Accept both names on every version: ``cache`` (transformers >= 5.24) and
        # ``past_key_values`` (older, still accepted there); pass the version's own.
        for name in ("cache", "past_key_values"):
            given = kwargs.pop(name, None)
            cache = given if cache is None else cache
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = decoder.config.use_cache
        cache = _pnmix_cache_for(cache, use_cache, decoder, state)
        if len(args) > cache_position:
            args[cache_position] = cache
        else:
            kwargs[cache_name] = cache
        return original(*args, **kwargs)

    return forward


def _pnmix_cache_for(cache, use_cache, decoder, state):
    model_config = decoder.config
    if isinstance(cache, PNMixCache):
        return cache
    if cache is None:
        return PNMixCache(model_config, state["config"], state["adapter"].pairing) if use_cache else None
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:
        return PNMixCache(model_config, state["config"], state["adapter"].pairing)
    if type(cache) is StaticCache and not cache.is_initialized:
        return _reusable_static_cache(cache.layers[0].max_cache_len, decoder, state)
    if isinstance(cache, Cache):
        raise TypeError(
            f"a PN-Mix patched model cannot use a {type(cache).__name__} "
            f"(holding {cache.get_seq_length()} tokens): pass no cache, an empty DynamicCache or StaticCache, "
            "or a PNMixCache"
        )
    raise TypeError(f"cache must be a transformers Cache or None, got {type(cache).__name__}")


def _reusable_static_cache(max_cache_len: int, decoder, state) -> PNMixStaticCache:
    """The model's static PN-Mix cache for ``max_cache_len``, emptied in place (same addresses,
    so a compiled decode step and its CUDA graphs are reused), or a new one."""
    cache, devices = state.get("static_cache"), _layer_devices(decoder)
    if (cache is None or cache.pnmix_config != state["config"] or cache.layers[0].max_cache_len != max_cache_len
            or cache.layer_devices != (devices or [None] * len(cache.layers))):  # fmt: skip
        cache = PNMixStaticCache(decoder.config, state["config"], state["adapter"].pairing, max_cache_len, devices)
        state["static_cache"] = cache
    else:
        cache.reset()
    return cache
