"""Saving, loading and sharing compressed prompt caches as ``.safetensors`` files.

A long document, a code base or a system prompt is prefilled once (the expensive part, and the
moment PN-Mix selects its pairs), saved, and answered many times later, in other processes or on
other machines:

.. code-block:: python

    cache = prefill(model, prompt_ids)                      # one forward pass, a progress bar per layer
    save_cache(cache, "doc.safetensors", model=model, prompt_token_ids=prompt_ids)
    ...
    cache = load_cache("doc.safetensors", model)            # a patched model of the same weights and config
    inputs = continuation_inputs(prompt_ids, [question_ids])
    model.generate(**inputs, **{cache_argument(model): cache}, max_new_tokens=...)

What a file holds
-----------------
One ``.safetensors`` file (no pickle): every state tensor of every layer exactly as the cache holds
it, never dequantized (tensor ``layers.<i>.<field>``: sinks, residual, packed key codes, key scales
and zeros, packed value codes, value scales and zeros, the selected-pair mask, per-sequence lengths,
and for per-group re-selection the per-group masks and query statistics), and the header metadata:

- ``format`` (``"pnmix-cache"``) and ``format_version`` (:data:`FORMAT_VERSION`);
- ``pnmix_config``: every field of the :class:`~pnmix_patch.PNMixConfig`;
- ``model``: the model's fingerprint (:func:`model_fingerprint`: model type, layers, heads, KV heads,
  head dim, hidden size, vocabulary, RoPE parameters, RoPE pairing, dtype, and with ``save_cache(...,
  model=...)`` a SHA-256 of the first layer's key projection weights, which tells apart two models of
  one shape);
- ``cache``: its kind (dynamic or static), batch size, positions consumed per layer;
- ``checksums``: a CRC-32 of every tensor's bytes, checked on load (a flipped bit is an error);
- optionally the prompt's token ids (tensor ``prompt_token_ids``) and free-form ``extra`` strings.

Only the used part of the growing dimensions is written: packed groups up to the longest sequence's
``num_groups``, and with the ``fp16`` preset the residual up to the longest one. A dynamic cache's
file therefore holds the bytes of its ``memory_report()["total_bytes"]`` plus the header, the prompt's
ids and one int32 per sequence and layer that the report leaves out (``query_count``, read by per-group
re-selection only); a static cache's file leaves out its preallocated, still empty storage. A file
loads into either kind.

Loading checks before it reads a tensor: a readable safetensors file (a truncated or damaged header
raises), the format and its version, the config against the model's (:func:`~pnmix_patch.patch_model`),
the fingerprint against the model's, every tensor's shape and dtype against what the config and the
fingerprint imply, free memory on a CUDA device; then, reading each tensor once (lazily, through
``safe_open``), its checksum and the lengths' bounds. Every error names what differs.

Sharing a prefix
----------------
``load_cache(path, model, batch_size=B)`` repeats each saved sequence ``B / saved`` times by copying
its packed words (``repeat_interleave`` of int32 codes, 16-bit scales and the 16- or 32-bit sinks and
residual): B requests then continue from one prefill, each with its own question
(:func:`continuation_inputs` builds the batch).

What is shared is the prefix's whole cache, its pair selection included: PN-Mix selects the pairs once
per sequence, from the chunk that first holds its real tokens, so the selection made from the prefix
is kept for the questions' tokens and for every generated token. The questions' tokens are a second
prefill chunk: they attend to the cache as decode steps do (sinks, packed groups, residual) and exactly
and causally among themselves, and join the residual, where they are quantized with the prefix's
selection when it flushes. They do not take part in the selection: the prefix's exact keys and queries
are gone once it is compressed, and a selection that changed per request would need the groups already
packed to be packed again. A request answered from a shared cache therefore generates exactly what
the same request gives when its prefix is prefilled alone (one chunk) and its question follows as a
second chunk; a single prefill of prefix and question together differs from both in two ways: its
selection also scores the question's tokens, and its question tokens see the prefix's exact keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .api import _decoder_of, _layer_devices, new_cache, patch_state
from .cache import _STATE, KEY_CODE_FIELDS, PNMixCache
from .config import PNMixConfig
from .reference.quantize import channel_order, key_code_shape, scale_dtype_for
from .static_cache import PNMixStaticCache, PNMixStaticLayer

FORMAT = "pnmix-cache"
"""The ``format`` metadata of a PN-Mix cache file."""

FORMAT_VERSION = 2
"""The version of the file layout this library writes and reads."""

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

_GROUP_FIELDS = ("key_codes_high", "key_codes_low", "key_scale", "key_zero", "group_mask_bits")
"""Fields whose dim 2 counts packed groups."""
_TOKEN_FIELDS = ("value_codes", "value_scale", "value_zero")
"""Fields whose dim 2 counts packed tokens (groups x G)."""
_PARTS = {
    "sinks": ("sink_keys", "sink_values"),
    "residual": ("residual_keys", "residual_values"),
    "packed_keys": ("key_codes_high", "key_codes_low"),
    "packed_values": ("value_codes",),
    "key_scales_zeros": ("key_scale", "key_zero"),
    "value_scales_zeros": ("value_scale", "value_zero"),
    "masks": ("pair_mask_bits", "group_mask_bits", "query_norm_sum", "query_count"),
    "lengths": ("sink_len", "residual_len", "num_groups", "selected"),
}
"""The parts of :meth:`~pnmix_patch.PNMixCache.memory_report`, by the fields that hold them."""
_FINGERPRINT_DIGEST = "k_proj_sha256"


class CacheFileError(ValueError):
    """A file that is not a PN-Mix cache this library can load into this model (the message says what differs)."""


@dataclass(frozen=True)
class CacheFileInfo:
    """What a PN-Mix cache file holds, read from its header (:func:`cache_info`)."""

    path: str
    format_version: int
    pnmix_config: PNMixConfig
    model: dict
    """The model's fingerprint (:func:`model_fingerprint`)."""
    kind: str
    """``"dynamic"`` or ``"static"``: the class of the cache that was saved."""
    batch_size: int
    seen_tokens: list[int]
    """Positions consumed per layer (padding included)."""
    prompt_token_ids: torch.Tensor | None
    extra: dict[str, str]
    parts: dict[str, int]
    """Bytes of the tensors of each part (``sinks``, ``residual``, ``packed_keys``, ...), summed over layers."""
    tensor_bytes: int
    file_bytes: int

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model the cache was saved from (its sinks' and residual's dtype)."""
        return DTYPES[self.model["dtype"]]


# ---------------------------------------------------------------------------------------- fingerprint
def model_fingerprint(model_or_config, dtype: torch.dtype | None = None, pairing: str | None = None, model=None) -> dict:
    """What a cache depends on in a model: ``model_type``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``, ``rope`` (the RoPE parameters),
    ``pairing``, ``dtype``, and where a model is given, ``k_proj_sha256``: a SHA-256 of the first key
    projection's weights (and bias), which tells apart two models of the same shape.

    Args:
        model_or_config: a patched model, or a model config (then ``dtype`` and ``pairing`` are needed).
        dtype, pairing: override the model's (a config alone has neither).
        model: the model whose weights are digested when ``model_or_config`` is a config.
    """
    if isinstance(model_or_config, torch.nn.Module):
        model = model_or_config
        state = patch_state(model)
        if state is None:
            raise ValueError("the model is not patched: call pnmix_patch.patch_model(model) first")
        config = model.config.get_text_config(decoder=True)
        pairing = pairing or state.adapter.pairing
        dtype = dtype or next(model.parameters()).dtype
    else:
        config = model_or_config.get_text_config(decoder=True) if hasattr(model_or_config, "get_text_config") else model_or_config
    if dtype is None or pairing is None:
        raise ValueError("model_fingerprint of a config needs dtype and pairing")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fingerprint = {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "rope": _rope_parameters(config),
        "pairing": pairing,
        "dtype": _dtype_name(dtype),
    }
    if model is not None:
        digest = _weights_digest(model)
        if digest is not None:
            fingerprint[_FINGERPRINT_DIGEST] = digest
    return fingerprint


def _rope_parameters(config) -> dict:
    """RoPE parameters as JSON values (``rope_parameters`` from transformers 5, ``rope_theta``/``rope_scaling`` before)."""
    parameters = getattr(config, "rope_parameters", None)
    if not parameters:
        parameters = {"rope_theta": getattr(config, "rope_theta", None), "rope_scaling": getattr(config, "rope_scaling", None)}
    parameters = {key: value for key, value in dict(parameters).items() if value is not None}  # unset fields vary by version
    return json.loads(json.dumps(parameters, sort_keys=True, default=str))


_DIGESTS: dict[int, tuple] = {}
"""``id(k_proj weight) -> (weakref to it, its (address, version) pairs, digest)``: a model is hashed again
only after its weights change (a tensor hashes by identity but compares by value, so no WeakKeyDictionary)."""


def _weights_digest(model) -> str | None:
    """SHA-256 of the first ``k_proj`` module's weight (and bias) bytes; None where they are not materialized."""
    for name, module in model.named_modules():
        if name.endswith("k_proj") and isinstance(getattr(module, "weight", None), torch.Tensor):
            tensors = [module.weight] + ([module.bias] if getattr(module, "bias", None) is not None else [])
            if any(t.device.type == "meta" for t in tensors):
                return None
            versions = tuple((t.data_ptr(), t._version) for t in tensors)
            known = _DIGESTS.get(id(module.weight))
            if known is not None and known[0]() is module.weight and known[1] == versions:
                return known[2]
            digest = hashlib.sha256()
            for tensor in tensors:
                digest.update(_tensor_bytes(tensor.detach()))
            for key in [key for key, entry in _DIGESTS.items() if entry[0]() is None]:
                del _DIGESTS[key]
            _DIGESTS[id(module.weight)] = (weakref.ref(module.weight), versions, digest.hexdigest())
            return digest.hexdigest()
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_bytes(tensor: torch.Tensor):
    """The bytes of a tensor (a contiguous CPU copy's buffer, any dtype)."""
    return tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------- saving
def save_cache(
    cache: PNMixCache,
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    prompt_token_ids: torch.Tensor | None = None,
    extra: dict[str, str] | None = None,
) -> CacheFileInfo:
    """Write ``cache`` (a :class:`~pnmix_patch.PNMixCache` or :class:`~pnmix_patch.PNMixStaticCache`
    holding a prefilled prompt) to one ``.safetensors`` file, as held: packed codes, scales, sinks,
    residual, masks and lengths, never dequantized (see the module docstring for the layout).

    Args:
        cache: the cache, every layer holding tokens.
        path: the file to write (replaced atomically: a reader never sees half a file).
        model: the patched model that filled it: its fingerprint then includes a digest of its
            weights, so that :func:`load_cache` refuses another model of the same shape. Without it
            the fingerprint comes from the config the cache was built with.
        prompt_token_ids: the prompt's token ids, ``[batch, tokens]`` or ``[tokens]``, stored so that
            a reader can continue the right text (:func:`continuation_inputs`) or check it.
        extra: strings to keep in the header (``CacheFileInfo.extra``), e.g. a chat template's tail.

    Returns:
        The written file's :class:`CacheFileInfo`.

    Raises:
        ValueError: an empty cache or layer, a static cache whose sequence outgrew its storage, a
            ``model`` whose fingerprint differs from the cache's config, prompt ids of another batch size, a
            cache in the polar or channel-class key format.
    """
    if not isinstance(cache, PNMixCache):
        raise TypeError(f"save_cache saves a PNMixCache or PNMixStaticCache, got {type(cache).__name__}")
    if cache.pnmix_config.key_format != "channel":
        raise ValueError(
            f"save_cache writes the per-channel key layout only; this cache has key_format={cache.pnmix_config.key_format!r} "
            "(allowed 'channel')"
        )
    layers = cache.layers
    empty = [index for index, layer in enumerate(layers) if not layer.is_initialized or layer.get_seq_length() == 0]
    if empty:
        raise ValueError(f"the cache holds no tokens in layers {empty}: prefill it first (pnmix_patch.cache_io.prefill)")
    first = layers[0]
    static = isinstance(cache, PNMixStaticCache)
    if static and any(bool(layer.overflowed.any()) for layer in layers):
        raise ValueError("a sequence outgrew the static cache's max_cache_len: its state is lost and cannot be saved")
    fingerprint = model_fingerprint(cache.model_config, first.dtype, first.pairing, model=model)
    if model is not None:
        own = model_fingerprint(model, dtype=first.dtype)
        _check_fields("the model passed to save_cache", own, fingerprint, "model", "cache")
    tensors, seen = {}, []
    for index, layer in enumerate(layers):
        if (layer.batch_size, layer.num_heads, layer.head_dim, layer.dtype) != (
            first.batch_size,
            first.num_heads,
            first.head_dim,
            first.dtype,
        ):
            raise ValueError(f"layer {index} holds another batch, head count, head dim or dtype than layer 0: cannot save")
        for field, tensor in _used_state(layer).items():
            tensors[f"layers.{index}.{field}"] = tensor.detach().cpu().contiguous()
        seen.append(int(layer.get_seq_length()))
    if prompt_token_ids is not None:
        ids = torch.as_tensor(prompt_token_ids).detach().cpu().to(torch.int64)
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.dim() != 2 or ids.shape[0] != first.batch_size:
            raise ValueError(f"prompt_token_ids of shape {list(ids.shape)}: allowed [tokens] or [batch={first.batch_size}, tokens]")
        tensors["prompt_token_ids"] = ids.contiguous()
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "pnmix_config": json.dumps(dataclasses.asdict(cache.pnmix_config), sort_keys=True),
        "model": json.dumps(fingerprint, sort_keys=True),
        "cache": json.dumps(
            {
                "kind": "static" if static else "dynamic",
                "batch_size": first.batch_size,
                "seen_tokens": seen,
                "max_cache_len": first.max_cache_len,
            }
        ),
        "checksums": json.dumps({name: zlib.crc32(_tensor_bytes(t)) for name, t in tensors.items()}),
        "extra": json.dumps(dict(extra or {})),
    }
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)
    return cache_info(path)


def _used_state(layer) -> dict[str, torch.Tensor]:
    """The layer's state tensors cut to their used extent (see the module docstring)."""
    config = layer.pnmix_config
    groups = int(layer.num_groups.max()) if layer.group_capacity else 0
    state = {}
    for field in _STATE:
        tensor = getattr(layer, field)
        if field in _GROUP_FIELDS and tensor.dim() > 2:
            tensor = tensor[:, :, :groups]
        elif field in _TOKEN_FIELDS:
            tensor = tensor[:, :, : groups * config.key_group_size]
        elif field in ("residual_keys", "residual_values") and not config.quantize:
            tensor = tensor[:, :, : int(layer.residual_len.max())]
        state[field] = tensor
    return state


# ---------------------------------------------------------------------------------------- reading the header
def _open(path):
    """``safe_open`` of ``path`` on the CPU, with every failure as a :class:`CacheFileError`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such cache file")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as error:
        raise CacheFileError(f"{path} is not a readable safetensors file (truncated or damaged?): {error}") from None
    except Exception as error:  # an unreadable header may surface as another exception type
        raise CacheFileError(f"{path} is not a readable safetensors file (truncated or damaged?): {error}") from None


def cache_info(path: str | os.PathLike) -> CacheFileInfo:
    """The header of a PN-Mix cache file: config, model fingerprint, batch, tokens, bytes per part.

    Reads no tensor data but the prompt's token ids.

    Raises:
        FileNotFoundError: no such file.
        CacheFileError: not a readable safetensors file, not a PN-Mix cache, another format version.
    """
    handle = _open(path)
    with handle as reader:
        metadata = reader.metadata() or {}
        if metadata.get("format") != FORMAT:
            found = f"'format' is {metadata['format']!r}" if "format" in metadata else "no 'format' metadata"
            raise CacheFileError(f"{path} is a safetensors file but not a PN-Mix cache ({found}; a PN-Mix cache has {FORMAT!r})")
        version = metadata.get("format_version")
        if version != str(FORMAT_VERSION):
            raise CacheFileError(
                f"{path} has PN-Mix cache format_version {version!r}; this version of pnmix-patch reads format_version "
                f"{FORMAT_VERSION}: save the cache again with this version"
            )
        try:
            fields = json.loads(metadata["pnmix_config"])
            pnmix_config = PNMixConfig(**fields)
            model = json.loads(metadata["model"])
            DTYPES[model["dtype"]], model["num_key_value_heads"], model["head_dim"]  # noqa: B018 (present and known)
            layout = json.loads(metadata["cache"])
            kind, batch_size, seen_tokens = layout["kind"], int(layout["batch_size"]), [int(n) for n in layout["seen_tokens"]]
            json.loads(metadata["checksums"])
            extra = json.loads(metadata.get("extra", "{}"))
        except (KeyError, TypeError, ValueError) as error:
            raise CacheFileError(f"{path}: the PN-Mix cache header is damaged ({type(error).__name__}: {error})") from None
        parts = dict.fromkeys(_PARTS, 0)
        total = 0
        part_of = {field: part for part, fields in _PARTS.items() for field in fields}
        for name in reader.keys():
            piece = reader.get_slice(name)
            size = math.prod(piece.get_shape()) * _element_size(piece.get_dtype())
            total += size
            field = name.rsplit(".", 1)[-1]
            if field in part_of:
                parts[part_of[field]] += size
        prompt = reader.get_tensor("prompt_token_ids") if "prompt_token_ids" in reader.keys() else None
    return CacheFileInfo(
        path=str(path),
        format_version=FORMAT_VERSION,
        pnmix_config=pnmix_config,
        model=model,
        kind=kind,
        batch_size=batch_size,
        seen_tokens=seen_tokens,
        prompt_token_ids=prompt,
        extra=extra,
        parts=parts,
        tensor_bytes=total,
        file_bytes=Path(path).stat().st_size,
    )


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def _element_size(name: str) -> int:
    dtype = _SAFETENSORS_DTYPES.get(name)
    if dtype is None:
        raise CacheFileError(f"a tensor of dtype {name}: a PN-Mix cache holds only {sorted(_SAFETENSORS_DTYPES)}")
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------- loading
def load_cache(
    path: str | os.PathLike,
    model: torch.nn.Module,
    batch_size: int | None = None,
    static: bool = False,
    max_cache_len: int | None = None,
    cache: PNMixCache | None = None,
    prompt_token_ids: torch.Tensor | None = None,
    verify: bool = True,
) -> PNMixCache:
    """Load a cache saved by :func:`save_cache` for ``model``, ready to continue (decode, or a further chunk).

    Args:
        path: the ``.safetensors`` file.
        model: a model patched with :func:`~pnmix_patch.patch_model` with the file's config; the same
            architecture, shape, RoPE, dtype (and, where the file has the digest, weights). Each layer's
            tensors go to the device its decoder layer runs on.
        batch_size: sequences of the loaded cache, a multiple of the saved batch: each saved sequence is
            repeated ``batch_size / saved`` times, copying its packed words (a shared prefix, see the module
            docstring). Default: the saved batch.
        static: load into a :class:`~pnmix_patch.PNMixStaticCache` of ``max_cache_len`` positions, its
            preallocated storage filled in place (a compiled or graphed decode step then runs on it).
        max_cache_len: positions the loaded cache accepts (required with ``static``).
        cache: an existing cache of ``model`` to load into instead (a static one keeps its storage and
            addresses where the batch size is unchanged, so a graphed step built on it stays valid);
            whatever it held is dropped.
        prompt_token_ids: the prompt the caller expects the file to hold: ``[tokens]`` or ``[saved batch,
            tokens]``; a file without prompt ids, or with others, raises.
        verify: check every tensor's CRC-32 (one pass over the bytes read).

    Returns:
        The loaded cache: the same tokens, selections, codes and lengths as the saved one.

    Raises:
        FileNotFoundError: no such file.
        CacheFileError (a ``ValueError``): the file is not a readable safetensors file (truncated or
            damaged), not a PN-Mix cache, of another format version, of another config or model, of
            another dtype than the model, damaged data (a checksum or a length out of bounds), too large
            for the device's free memory or for ``max_cache_len``; prompt ids that differ.
        ValueError: an unpatched model, a batch size that is not a multiple of the saved one.
    """
    info = cache_info(path)
    state = patch_state(model)
    if state is None:
        raise ValueError(
            f"the model is not patched: call pnmix_patch.patch_model(model, config) first, with the file's config "
            f"(pnmix_patch.cache_info({str(path)!r}).pnmix_config: {info.pnmix_config.name})"
        )
    _check_fields(f"{path}: the PN-Mix config", _config_fields(info.pnmix_config), _config_fields(state.pnmix_config), "file", "model")
    own = model_fingerprint(model)
    if info.model.get("dtype") != own["dtype"]:
        raise CacheFileError(
            f"{path} holds a {info.model.get('dtype')} cache; the model computes in {own['dtype']}: load the model "
            f"with dtype=torch.{info.model.get('dtype')} (a cache is never converted: its scales' dtype follows it)"
        )
    if _FINGERPRINT_DIGEST not in info.model:
        own.pop(_FINGERPRINT_DIGEST, None)
    _check_fields(f"{path}: the model", info.model, own, "file", "model")
    if prompt_token_ids is not None:
        expected = torch.as_tensor(prompt_token_ids).cpu().to(torch.int64)
        expected = expected[None] if expected.dim() == 1 else expected
        if info.prompt_token_ids is None:
            raise CacheFileError(f"{path} holds no prompt token ids to compare with the {expected.shape[-1]} given")
        if not torch.equal(info.prompt_token_ids, expected):
            saved = info.prompt_token_ids
            raise CacheFileError(f"{path} holds another prompt: {list(saved.shape)} token ids, the given {list(expected.shape)} differ")
    saved_batch = info.batch_size
    batch = saved_batch if batch_size is None else batch_size
    if not isinstance(batch, int) or batch < 1 or batch % saved_batch:
        raise ValueError(f"batch_size={batch_size!r}: allowed a positive multiple of the saved batch size {saved_batch}")
    repeats = batch // saved_batch
    layers = len(info.seen_tokens)

    if cache is None:
        if static and max_cache_len is None:
            raise ValueError(f"static=True needs max_cache_len: the saved {max(info.seen_tokens)} positions plus the tokens to generate")
        cache = new_cache(model, max_cache_len, static=static)
    elif not isinstance(cache, PNMixCache) or len(cache.layers) != layers:
        raise ValueError(f"cache= must be a PNMixCache of the model's {layers} layers, got {type(cache).__name__}")
    elif cache.pnmix_config != state.pnmix_config:
        raise ValueError("cache= was built with another PN-Mix config than the model's")
    static = isinstance(cache, PNMixStaticCache)
    for index, seen in enumerate(info.seen_tokens):
        limit = cache.layers[index].max_cache_len
        if limit is not None and seen >= limit:
            raise CacheFileError(f"{path} holds {seen} positions; the cache's max_cache_len={limit} leaves no room to continue")
    devices = _layer_devices(model) or [torch.device("cpu")] * layers
    with _open(path) as reader:
        checksums = json.loads(reader.metadata()["checksums"])
        expected_shapes = [_expected_shapes(reader, index, info, path) for index in range(layers)]
        _check_free_memory(path, expected_shapes, devices, repeats)
        if static:
            cache.reset()
        for index, layer in enumerate(cache.layers):
            tensors = {}
            for field in _STATE:
                name = f"layers.{index}.{field}"
                tensor = reader.get_tensor(name)
                if verify and zlib.crc32(_tensor_bytes(tensor)) != checksums.get(name):
                    raise CacheFileError(f"{path}: tensor {name} fails its checksum: the file is damaged")
                tensors[field] = tensor
            _check_lengths(path, index, tensors, info)
            _fill_layer(layer, index, tensors, info, devices[index], repeats)
    return cache


def _config_fields(config: PNMixConfig) -> dict:
    fields = dataclasses.asdict(config)
    fields.pop("name")  # a label: two configs of the same values are one
    return fields


def _check_fields(what: str, have: dict, want: dict, have_name: str, want_name: str) -> None:
    differing = [
        f"{key}: {have_name} {have.get(key)!r}, {want_name} {want.get(key)!r}"
        for key in sorted(set(have) | set(want))
        if have.get(key) != want.get(key)
    ]
    if differing:
        raise CacheFileError(f"{what} differs: " + "; ".join(differing))


def _expected_shapes(reader, index: int, info: CacheFileInfo, path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Check every tensor of layer ``index``: present, of the shape and dtype the config and fingerprint imply."""
    config, model = info.pnmix_config, info.model
    batch, heads, head_dim, dtype = info.batch_size, model["num_key_value_heads"], model["head_dim"], info.dtype
    names = set(reader.keys())
    shapes = {}
    for field in _STATE:
        name = f"layers.{index}.{field}"
        if name not in names:
            raise CacheFileError(f"{path}: tensor {name} is missing")
        piece = reader.get_slice(name)
        shapes[field] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype()))
    groups = shapes["key_scale"][0][2] if len(shapes["key_scale"][0]) == 4 else -1
    residual = shapes["residual_keys"][0][2] if len(shapes["residual_keys"][0]) == 4 else -1
    scale = scale_dtype_for(dtype)
    units = head_dim if config.selection_unit == "channel" else head_dim // 2
    tracks_queries = config.reselection == "per_group" and config.selection == "qk_pair_norm"
    value_group = config.value_group(head_dim)
    per_group = config.reselection == "per_group"
    want = {
        "sink_keys": ((batch, heads, config.sink_tokens, head_dim), dtype),
        "sink_values": ((batch, heads, config.sink_tokens, head_dim), dtype),
        "sink_len": ((batch,), torch.int32),
        "residual_keys": ((batch, heads, residual if not config.quantize else config.residual_tokens, head_dim), dtype),
        "residual_values": ((batch, heads, residual if not config.quantize else config.residual_tokens, head_dim), dtype),
        "residual_len": ((batch,), torch.int32),
        **{
            name: ((batch, heads, *key_code_shape(groups, planes, config.key_group_size, channels)), torch.int32)
            for name, (planes, channels) in zip(KEY_CODE_FIELDS["channel"], config.key_code_widths(head_dim))
        },
        "key_scale": ((batch, heads, groups, head_dim), scale),
        "key_zero": ((batch, heads, groups, head_dim), scale),
        "value_codes": ((batch, heads, groups * config.key_group_size, config.value_bits, head_dim // 32), torch.int32),
        "value_scale": ((batch, heads, groups * config.key_group_size, head_dim // value_group), scale),
        "value_zero": ((batch, heads, groups * config.key_group_size, head_dim // value_group), scale),
        "num_groups": ((batch,), torch.int32),
        "pair_mask_bits": ((batch, heads, -(-head_dim // 64)), torch.int32),
        "selected": ((batch,), torch.bool),
        "group_mask_bits": ((batch, heads, groups if per_group else 0, -(-units // 32)), torch.int32),
        "query_norm_sum": ((batch, heads, head_dim // 2 if tracks_queries else 0), torch.float32),
        "query_count": ((batch,), torch.int32),
    }
    if groups < 0 or residual < 0 or (groups and not config.quantize):
        raise CacheFileError(
            f"{path}: layer {index}'s key_scale or residual_keys has shape {shapes['key_scale'][0]}, {shapes['residual_keys'][0]}"
        )
    for field, (shape, dtype_) in want.items():
        if shapes[field] != (shape, dtype_):
            found_shape, found_dtype = shapes[field]
            raise CacheFileError(
                f"{path}: tensor layers.{index}.{field} is {list(found_shape)} {found_dtype}; the file's config and model "
                f"fingerprint imply {list(shape)} {dtype_}"
            )
    return {field: shape for field, (shape, _) in want.items()} | {"_dtypes": {field: d for field, (_, d) in want.items()}}


def _check_free_memory(path, expected_shapes, devices, repeats: int) -> None:
    needed: dict[torch.device, int] = {}
    for shapes, device in zip(expected_shapes, devices):
        dtypes = shapes["_dtypes"]
        size = sum(
            math.prod(shape) * torch.empty((), dtype=dtypes[field]).element_size() for field, shape in shapes.items() if field != "_dtypes"
        )
        needed[device] = needed.get(device, 0) + size * repeats
    for device, size in needed.items():
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if size > free:
                raise CacheFileError(f"{path}: the cache needs {size:,d} bytes on {device}, which has {free:,d} free")


def _check_lengths(path, index: int, tensors: dict, info: CacheFileInfo) -> None:
    config = info.pnmix_config
    groups = tensors["key_scale"].shape[2]
    residual = tensors["residual_keys"].shape[2]
    bounds = {"sink_len": config.sink_tokens, "num_groups": groups, "residual_len": residual}
    for field, limit in bounds.items():
        lengths = tensors[field]
        if bool((lengths < 0).any()) or bool((lengths > limit).any()):
            raise CacheFileError(f"{path}: layers.{index}.{field} = {lengths.tolist()} is out of bounds [0, {limit}]: the file is damaged")
    held = tensors["sink_len"] + tensors["num_groups"] * config.key_group_size + tensors["residual_len"]
    if bool((held > info.seen_tokens[index]).any()):
        raise CacheFileError(
            f"{path}: layer {index} holds {held.tolist()} tokens per sequence, more than its {info.seen_tokens[index]} positions"
        )


def _fill_layer(layer, index: int, tensors: dict, info: CacheFileInfo, device: torch.device, repeats: int) -> None:
    """Put the saved tensors into ``layer``: a static layer's preallocated storage is filled in place
    (allocated first where it is not, or was for another batch size or device); a dynamic layer adopts
    them. Rows are repeated ``repeats`` times."""
    batch = info.batch_size * repeats
    heads, head_dim = info.model["num_key_value_heads"], info.model["head_dim"]
    static = isinstance(layer, PNMixStaticLayer)
    if not static:
        layer.reset()
    elif layer.is_initialized and (layer.batch_size != batch or layer.device != device):
        if layer.stack is not None:
            layer.stack.release()  # every layer of the stack allocates again (the cache was reset)
        else:
            layer.release_storage()
    if not layer.is_initialized:
        empty = torch.empty(batch, heads, 0, head_dim, dtype=info.dtype, device=device)
        layer.lazy_initialization(empty, empty)
    for field, tensor in tensors.items():
        tensor = tensor.to(device)
        if not static:
            setattr(layer, field, tensor.repeat_interleave(repeats, 0) if repeats > 1 else tensor)
            continue
        target = getattr(layer, field)
        if tensor.dim() > 2:
            if tensor.shape[2] > target.shape[2]:
                raise CacheFileError(
                    f"{info.path}: layers.{index}.{field} holds {tensor.shape[2]} slots; the static cache's "
                    f"max_cache_len={layer.max_cache_len} preallocates {target.shape[2]}"
                )
            target = target[:, :, : tensor.shape[2]]
        target.unflatten(0, (info.batch_size, repeats)).copy_(tensor.unsqueeze(1))
    layer.all_selected = bool(layer.selected.all())
    layer.seen_tokens = info.seen_tokens[index]
    if static:
        layer.order.copy_(channel_order(layer.channel_mask))
        layer.prefilled = True


# ---------------------------------------------------------------------------------------- prefill and continuation
def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache: PNMixCache | None = None,
    progress: bool = True,
) -> PNMixCache:
    """Prefill a prompt into a PN-Mix cache in one forward pass (one chunk: the pairs are selected from
    the whole prompt), computing the last position's logits only; a progress bar advances per decoder layer.

    Args:
        model: a patched model.
        input_ids: ``[batch, tokens]`` (``[tokens]`` for one sequence).
        attention_mask: ``[batch, tokens]``, 0 for left padding; None: every token real.
        cache: the cache to fill (default: a new dynamic one, :func:`~pnmix_patch.new_cache`).
        progress: show the progress bar.
    """
    if patch_state(model) is None:
        raise ValueError("the model is not patched: call pnmix_patch.patch_model(model) first")
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    cache = new_cache(model) if cache is None else cache
    decoder_layers = _decoder_of(model).layers
    bar = tqdm(total=len(decoder_layers), desc=f"prefill {input_ids.shape[1]} tokens", unit="layer", disable=not progress)

    def advance(*_) -> None:  # a forward hook returning a value would replace the layer's output
        bar.update(1)

    hooks = [layer.register_forward_hook(advance) for layer in decoder_layers]
    argument = cache_argument(model)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=True, **{argument: cache})
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return cache


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` and ``model.generate`` take a cache: ``"cache"`` from
    transformers 5.24, ``"past_key_values"`` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def continuation_inputs(prompt_token_ids: torch.Tensor, continuations: list, pad_token_id: int = 0, device=None) -> dict[str, torch.Tensor]:
    """``generate`` inputs for requests that continue one cached prompt, each with its own tokens.

    Builds ``input_ids [B, P + longest]`` = the prompt, then each continuation left-padded to the
    longest, and the ``attention_mask`` (0 at the padding). ``generate`` feeds only the tokens past the
    cache (the padded continuations) and numbers the positions from the mask, so each request's tokens
    follow the prompt directly, as if alone; the PN-Mix cache stores no padding.

    Args:
        prompt_token_ids: the cached prompt, ``[P]`` or ``[1, P]`` (a stored one: ``cache_info(path).prompt_token_ids``).
        continuations: one sequence of token ids per request (each at least one token).
        pad_token_id: the id written at the padding (never attended).
        device: where to put the tensors (default: the prompt's).
    """
    prompt = torch.as_tensor(prompt_token_ids).reshape(-1).to(torch.int64)
    rows = [torch.as_tensor(c).reshape(-1).to(torch.int64) for c in continuations]
    if not rows or any(row.numel() == 0 for row in rows):
        raise ValueError("continuation_inputs needs at least one continuation, each of at least one token")
    longest = max(row.numel() for row in rows)
    input_ids = torch.full((len(rows), prompt.numel() + longest), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    input_ids[:, : prompt.numel()] = prompt
    attention_mask[:, : prompt.numel()] = 1
    for index, row in enumerate(rows):
        input_ids[index, input_ids.shape[1] - row.numel() :] = row
        attention_mask[index, input_ids.shape[1] - row.numel() :] = 1
    device = device if device is not None else prompt.device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
