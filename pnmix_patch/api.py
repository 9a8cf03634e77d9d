"""The public API: ``patch_model`` / ``unpatch_model`` (the one line added to an existing script),
``new_cache``, and ``patch_gemv`` / ``unpatch_gemv`` (one-token linear products through ``pnmix::gemv``).

Patching a built model instance changes the class of some of its modules (:mod:`pnmix_patch.mixins`:
the model's classes are untouched, and a patched model deep-copies and pickles patched):

1. every attention module of the architecture becomes a ``PNMix<its class>``
   (:class:`~pnmix_patch.attention.PNMixAttention`), whose forward is
   :func:`~pnmix_patch.attention.pnmix_attention_forward`;
2. the decoder gets a subclass of its class that passes for it (:class:`PNMixDecoder`), whose forward turns a
   missing cache (``use_cache=True``) or the empty ``DynamicCache`` that ``generate`` creates into a
   :class:`~pnmix_patch.cache.PNMixCache`, and an empty transformers ``StaticCache``
   (``generate(..., cache_implementation="static")``) into a
   :class:`~pnmix_patch.static_cache.PNMixStaticCache` of the same ``max_cache_len``
   (kept on the decoder and reset in place on the next call, so compiled decode steps
   are reused; a new one when the layers' devices changed); ``generate`` then carries it from the model's outputs, so
   ``generate``, pipelines and hand-written loops need no change;
3. sets ``config._attn_implementation = "pnmix"``, registered with transformers'
   attention and mask interfaces (the mask is the boolean SDPA mask: without a
   registered mask function, left-padded batches would silently get no mask);
4. the causal LM around the decoder (the module ``generate`` is called on) gets a subclass that passes
   for its class (:class:`PNMixGenerator`): ``generate`` refuses a static PN-Mix cache too small for the
   prompt and ``max_new_tokens`` before any work, and its compiled decode steps on a CUDA static PN-Mix
   cache replay one captured CUDA graph (:class:`~pnmix_patch.graphed_decode.GraphedGenerateCall`).

``unpatch_model`` gives every module its class back.

``patch_gemv`` turns every ``torch.nn.Linear`` into a :class:`~pnmix_patch.linear.GemvLinear` and each gated
MLP of a supported architecture into a ``Gemv<its class>`` (:class:`~pnmix_patch.linear.GemvGatedMLP`), by
the same class swap; it is independent of the cache and serves unpatched models too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools

import torch
from transformers import AttentionInterface
from transformers.activations import SiLUActivation
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_masks_for_generate, sdpa_mask

from .attention import PNMixAttention
from .cache import PNMixCache
from .config import PNMixConfig, resolve_config
from .graphed_decode import GraphedGenerateCall
from .linear import GemvGatedMLP, GemvLinear
from .mixins import RuntimeMixin, mixed_class, set_classes, unmixed_class
from .patches import PATCHES, get_patch
from .patches.base import ArchitecturePatch
from .static_cache import PNMixStaticCache

ATTENTION_NAME = "pnmix"

AttentionInterface.register(ATTENTION_NAME, sdpa_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@dataclasses.dataclass
class PatchState:
    """What :func:`patch_model` keeps on the patched decoder (``_pnmix_state``)."""

    pnmix_config: PNMixConfig
    adapter: ArchitecturePatch
    attn_implementation: str  # the model's own, restored by unpatch_model
    static_cache: PNMixStaticCache | None = None  # reused by generate(cache_implementation="static")
    generate_call: GraphedGenerateCall | None = None  # what get_compiled_call hands generate

    def __getstate__(self):
        # A copy or a pickle of the model leaves the cache and the compiled call behind.
        return {**vars(self), "static_cache": None, "generate_call": None}


class PNMixDecoder(RuntimeMixin):
    """Mixin of a patched model's decoder (``LlamaModel`` of a ``LlamaForCausalLM``): its forward runs on a
    PN-Mix cache (point 2 of the module docstring), then the decoder's own. Each class made with it
    passes for the decoder's class (same name and module, see :class:`~pnmix_patch.mixins.RuntimeMixin`),
    shows the decoder's own signature and records where that takes the cache: ``cache``
    (transformers >= 5.24) or ``past_key_values``."""

    prefix = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if PNMixDecoder not in cls.__bases__:
            return  # a subclass of a patched decoder's class keeps its own forward
        own = super().forward
        parameters = list(inspect.signature(own).parameters)[1:]  # after self
        cache_name = "cache" if "cache" in parameters else "past_key_values"
        cls._pnmix_cache_argument = cache_name, parameters.index(cache_name)

        @functools.wraps(own)
        def forward(self, *args, **kwargs):
            # The decoder's forward as its class has it now (a later class-level patch of it counts).
            return super(cls, self).forward(*self._on_pnmix_cache(args, kwargs), **kwargs)

        cls.forward = forward

    def _on_pnmix_cache(self, args: tuple, kwargs: dict) -> list:
        """The positional arguments, and ``kwargs`` in place, with the cache made a PN-Mix one. Both names
        are accepted on every version (``cache``, and ``past_key_values``, still accepted by >= 5.24);
        the version's own is passed on."""
        if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None and self.config.output_attentions):
            raise ValueError(
                "output_attentions=True: PN-Mix attention never forms the attention weights (the decode kernels read "
                "packed keys and return outputs only). Pass output_attentions=False, or unpatch_model(model) to get them."
            )
        cache_name, position = self._pnmix_cache_argument
        args = list(args)
        cache = args[position] if len(args) > position else None
        for name in ("cache", "past_key_values"):
            given = kwargs.pop(name, None)
            cache = given if cache is None else cache
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = self.config.use_cache
        cache = _pnmix_cache_for(cache, use_cache, self)
        if len(args) > position:
            args[position] = cache
        else:
            kwargs[cache_name] = cache
        return args


class PNMixGenerator(RuntimeMixin):
    """Mixin of a patched causal LM (``LlamaForCausalLM``; point 4 of the module docstring). Each class made
    with it passes for the model's class (see :class:`~pnmix_patch.mixins.RuntimeMixin`)."""

    prefix = ""

    def generate(self, *args, **kwargs):
        """The model's own ``generate``, after checking that a :class:`~pnmix_patch.PNMixStaticCache` passed as
        the cache holds the prompt and every generated token (a compiled step cannot raise past its end).

        Raises:
            ValueError: the static cache's ``max_cache_len`` is below the positions this call feeds it."""
        _check_static_cache_room(self, args, kwargs)
        return super().generate(*args, **kwargs)

    def create_masks_for_generate(self, *args, **kwargs):
        """The attention mask ``generate`` passes to a step on a compilable cache (its
        ``prepare_inputs_for_generation`` turns the 2-D mask into the model's 4-D mask ahead of the compiled
        call). A decode step of a static PN-Mix cache reads no mask (left padding is recorded in the cache at
        prefill), so there it is None: building the 4-D mask over ``max_cache_len`` positions is host work on
        every token, and the replayed graph (:class:`GraphedGenerateCall`) takes no mask at all. Every other
        step gets transformers' mask."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        embeds = kwargs.get("inputs_embeds")
        if isinstance(cache, PNMixStaticCache) and embeds is not None and cache.layers[0].decodes(embeds.shape[1]):
            return None
        parent = getattr(super(), "create_masks_for_generate", None)
        return parent(*args, **kwargs) if parent is not None else create_masks_for_generate(*args, **kwargs)

    def get_compiled_call(self, compile_config):
        """transformers' compiled call, wrapped so that decode steps on a CUDA static PN-Mix cache replay one
        captured CUDA graph (:class:`~pnmix_patch.graphed_decode.GraphedGenerateCall`). A compile config of
        another mode than ``"reduce-overhead"`` (no CUDA graphs wanted) gets transformers' call alone."""
        fallback = super().get_compiled_call(compile_config)
        if getattr(compile_config, "mode", "reduce-overhead") != "reduce-overhead":
            return fallback
        state = patch_state(self)
        if state.generate_call is None or state.generate_call.fallback is not fallback:
            state.generate_call = GraphedGenerateCall(self, fallback)
        return state.generate_call


def _check_static_cache_room(model, args: tuple, kwargs: dict) -> None:
    """Raise before ``generate`` starts when its cache is a static PN-Mix cache of too few positions: the
    prompt and every generated token but the last are fed to the model (transformers' own rule for
    ``max_new_tokens`` and ``max_length``, the former first)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, PNMixStaticCache):
        return
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if prompt is None:
        prompt = kwargs.get("inputs_embeds")
    if not isinstance(prompt, torch.Tensor):
        return  # transformers reports a missing prompt itself
    generation_config = kwargs.get("generation_config") or model.generation_config
    max_new_tokens = kwargs.get("max_new_tokens", generation_config.max_new_tokens)
    prompt_length = prompt.shape[1]
    if max_new_tokens is not None:
        total, asked = prompt_length + max_new_tokens, f"a prompt of {prompt_length} tokens and max_new_tokens={max_new_tokens}"
    else:
        total = kwargs.get("max_length", generation_config.max_length)
        asked = f"max_length={total} (prompt of {prompt_length} tokens)"
    needed = total - 1  # the last generated token is never fed back
    limit = cache.layers[0].max_cache_len
    if needed > limit:
        raise ValueError(
            f"the PNMixStaticCache holds max_cache_len={limit} positions; this generate call feeds it up to {needed} "
            f"({asked}): build it with max_cache_len >= {needed}, e.g. "
            f"pnmix_patch.new_cache(model, max_cache_len={needed}, static=True), or lower max_new_tokens"
        )


def patch_model(model: torch.nn.Module, pnmix_config: PNMixConfig | str = "pnmix-1") -> torch.nn.Module:
    """Rewrite ``model``'s attention into PN-Mix attention, in place.

    Args:
        model: a transformers Llama, Mistral, Qwen2 or Qwen3 model (``*ForCausalLM`` or
            the bare decoder).
        pnmix_config: a :class:`~pnmix_patch.PNMixConfig` or the name of one of
            :data:`~pnmix_patch.PRESETS` (``"pnmix-1"``, ``"pnmix-2"``, ``"kivi-2"``, ``"kitty"``,
            ``"polarquant"``, ``"polarquant-3"``, ``"chanmix"``, ``"fp16"``).

    Returns:
        The same model. Patching again only changes the config. The model deep-copies
        (``copy.deepcopy``) and pickles (``torch.save(model)``) patched; it loads where
        ``pnmix_patch`` imports. ``state_dict`` and ``save_pretrained`` are unaffected.

    Raises:
        ValueError: unsupported architecture or configuration (sliding windows); a head dim that is
            odd, or not a multiple of 32 for a quantizing config; a module to patch with a ``forward``
            set on the instance (other than accelerate's hooks, which keep running, see
            :func:`~pnmix_patch.mixins.set_classes`).
        TypeError: ``model`` is not a transformers model; its dtype is not float16, bfloat16 or float32.

    A patched model refuses ``output_attentions=True`` (PN-Mix attention never forms the weights).
    """
    pnmix_config = resolve_config(pnmix_config)
    if not hasattr(getattr(model, "config", None), "get_text_config"):
        raise TypeError(
            f"patch_model needs a transformers model (a PreTrainedModel with a config: Llama, Mistral, Qwen2 or Qwen3), "
            f"got {type(model).__name__}"
        )
    model_config = model.config.get_text_config(decoder=True)
    adapter = get_patch(model_config.model_type)
    adapter.check_config(model_config)
    _check_shapes_and_dtype(model, model_config, pnmix_config)
    state = patch_state(model)
    if state is not None:
        state.pnmix_config = pnmix_config
        return model

    attention_type = adapter.attention_type()
    attentions = [m for m in model.modules() if isinstance(m, attention_type)]
    if not attentions:
        raise ValueError(f"found no {adapter.attention_class} module in {type(model).__name__}")
    decoder = _decoder_of(model)
    generator = [(model, mixed_class(PNMixGenerator, type(model)))] if model is not decoder and hasattr(model, "generate") else []
    set_classes(
        [(decoder, mixed_class(PNMixDecoder, type(decoder)))]
        + generator
        + [(attention, mixed_class(PNMixAttention, type(attention))) for attention in attentions]
    )
    for attention in attentions:
        # A copy per module: one adapter shared by all of them would cost a compiled call one
        # Python "is" test per layer in Dynamo's guards.
        attention._pnmix_adapter = dataclasses.replace(adapter)
        attention._pnmix_rotary = adapter.rotary()
    decoder._pnmix_state = PatchState(pnmix_config, adapter, model_config._attn_implementation)
    model_config._attn_implementation = ATTENTION_NAME
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model`: every module has its own class again, the model its attention implementation.

    Raises:
        ValueError: a patched module has since been given a ``forward`` on the instance (see
            :func:`~pnmix_patch.mixins.set_classes`); nothing is changed then."""
    state = patch_state(model)
    if state is None:
        return model
    decoder = _decoder_of(model)
    attentions = [(m, own) for m in model.modules() if (own := unmixed_class(type(m), PNMixAttention)) is not None]
    own = unmixed_class(type(model), PNMixGenerator)
    generator = [(model, own)] if own is not None else []
    set_classes([(decoder, unmixed_class(type(decoder), PNMixDecoder)), *generator, *attentions])
    for attention, _ in attentions:
        del attention._pnmix_adapter, attention._pnmix_rotary
    del decoder._pnmix_state
    model.config.get_text_config(decoder=True)._attn_implementation = state.attn_implementation
    return model


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The state :func:`patch_model` keeps for ``model`` (its PN-Mix config: ``.pnmix_config``), None if not patched."""
    try:
        decoder = _decoder_of(model)
    except ValueError:
        return None
    return decoder._pnmix_state if isinstance(decoder, PNMixDecoder) else None


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched."""
    return patch_state(model) is not None


def new_cache(model: torch.nn.Module, max_cache_len: int | None = None, static: bool = False) -> PNMixCache:
    """An empty PN-Mix cache for a patched ``model`` (its config and RoPE pairing).

    Args:
        model: a model patched with :func:`patch_model`.
        max_cache_len: positions the cache accepts (prompt plus generated tokens); required when
            ``static``. Default for the dynamic cache: no limit (it grows like ``DynamicCache``).
        static: a :class:`~pnmix_patch.static_cache.PNMixStaticCache` (preallocated,
            compileable with ``torch.compile(fullgraph=True)`` and CUDA graphs) instead
            of the growing :class:`~pnmix_patch.cache.PNMixCache`.

    Raises:
        ValueError: ``model`` is not patched; ``max_cache_len`` missing or below 1 for a static cache.
    """
    state = patch_state(model)
    if state is None:
        raise ValueError("the model is not patched: call pnmix_patch.patch_model(model) first")
    if static:
        return PNMixStaticCache(model.config, state.pnmix_config, state.adapter.pairing, max_cache_len, _layer_devices(model))
    return PNMixCache(model.config, state.pnmix_config, state.adapter.pairing, max_cache_len)


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


def _pnmix_cache_for(cache, use_cache, decoder):
    """``cache`` as a patched ``decoder`` runs on it (see the module docstring, point 2)."""
    model_config, state = decoder.config, decoder._pnmix_state
    if isinstance(cache, PNMixCache):
        return cache
    if cache is None:
        return PNMixCache(model_config, state.pnmix_config, state.adapter.pairing) if use_cache else None
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:
        return PNMixCache(model_config, state.pnmix_config, state.adapter.pairing)
    if type(cache) is StaticCache and not cache.is_initialized:
        return _reusable_static_cache(cache.layers[0].max_cache_len, decoder)
    if isinstance(cache, Cache):
        raise TypeError(
            f"a PN-Mix patched model cannot use a {type(cache).__name__} "
            f"(holding {cache.get_seq_length()} tokens): pass no cache, an empty DynamicCache or StaticCache, "
            "or a PNMixCache"
        )
    raise TypeError(f"cache must be a transformers Cache or None, got {type(cache).__name__}")


def _reusable_static_cache(max_cache_len: int, decoder) -> PNMixStaticCache:
    """The patched ``decoder``'s static PN-Mix cache for ``max_cache_len``, emptied in place (same addresses,
    so a compiled decode step and its CUDA graphs are reused), or a new one."""
    state = decoder._pnmix_state
    cache, devices = state.static_cache, _layer_devices(decoder)
    if (
        cache is None
        or cache.pnmix_config != state.pnmix_config
        or cache.layers[0].max_cache_len != max_cache_len
        or cache.layer_devices != (devices or [None] * len(cache.layers))
    ):
        cache = PNMixStaticCache(decoder.config, state.pnmix_config, state.adapter.pairing, max_cache_len, devices)
        state.static_cache = cache
    else:
        cache.reset()
    return cache


def _gated_mlp_class(model: torch.nn.Module) -> type | None:
    """The gated MLP class of ``model``'s architecture, if it is a supported one."""
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

    The gain is measured with the decode step replayed as a CUDA graph (``GraphedDecodeStep`` or
    ``torch.compile(..., mode="reduce-overhead")``, ``docs/performance.md``). Eager, each product
    also pays a custom op's and a Triton launch's host time (unmeasured on a GPU). A model patched
    by this function (and :func:`~pnmix_patch.patch_model`) deep-copies and pickles (``torch.save(model)``),
    and loads patched where ``pnmix_patch`` imports. Its ``state_dict`` and ``save_pretrained`` are unchanged.
    Layers hooked by accelerate (CPU offload) before patching keep their hooks, around the new forward.
    """
    modules = list(model.modules())
    if not any(type(module) in (torch.nn.Linear, GemvLinear) for module in modules):
        raise ValueError(
            f"{type(model).__name__} has no layer of the exact class torch.nn.Linear to patch "
            "(subclasses, such as quantized linear layers, are left alone)"
        )
    mlp_class = _gated_mlp_class(model)
    gated = [m for m in modules if type(m) is mlp_class and isinstance(m.act_fn, (torch.nn.SiLU, SiLUActivation))]
    set_classes(
        [(m, GemvLinear) for m in modules if type(m) is torch.nn.Linear] + [(m, mixed_class(GemvGatedMLP, mlp_class)) for m in gated]
    )
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
