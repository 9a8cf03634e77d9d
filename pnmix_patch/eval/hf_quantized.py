"""transformers' own quantized KV cache (``QuantizedCache``) as comparison methods of the evaluation.

A method here is a :class:`HFQuantizedMethod`: a backend of transformers' ``QuantizedCache``
(``quanto`` through optimum-quanto, ``hqq`` through HQQ, ``fp8`` where the installed
transformers has it) with its bit width and axes. It runs through transformers' own cache
classes and the unpatched model, as ``model.generate(..., cache_implementation="quantized",
cache_config=method.cache_config())`` would; nothing of it is re-implemented here.

Bits per element are read from the tensors the cache holds (:func:`quantized_cache_memory`):
the packed codes, every scale and zero point, and the unquantized residual, in their stored
dtypes (scales are in the model's dtype: float32 in a float32 model).

optimum-quanto and HQQ are the optional extra ``hf-quantized``
(``pip install -c constraints.txt -e ".[hf-quantized]"``); asking for a method whose package is
missing raises :class:`MissingExtraError` naming it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch

EXTRA = "hf-quantized"
"""The optional extra of setup.cfg that installs optimum-quanto and HQQ."""

INSTALL_HINT = f'pip install -c constraints.txt -e ".[{EXTRA}]"'

_BACKEND_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}
_BACKEND_PACKAGES = {"quanto": "optimum-quanto", "hqq": "hqq"}


class MissingExtraError(ImportError):
    """A transformers quantized-cache method was asked for without the package its backend needs."""


@dataclasses.dataclass(frozen=True)
class HFQuantizedMethod:
    """One configuration of transformers' ``QuantizedCache``.

    Args:
        name: the method's name in the evaluation (``hf-quanto-2``, ...).
        backend: ``"quanto"``, ``"hqq"`` or ``"fp8"``.
        nbits: bits per quantized element (None for ``fp8``: the backend takes no group-wise options).
        axis_key, axis_value: the axes transformers' documentation gives for the backend
            (quanto: 0; HQQ: 1); None for ``fp8``.
        q_group_size, residual_length: transformers' defaults (64 and 128) unless changed.
    """

    name: str
    backend: str
    nbits: int | None = None
    axis_key: int | None = None
    axis_value: int | None = None
    q_group_size: int | None = None
    residual_length: int | None = None

    quantize = True  # read like PNMixConfig.quantize by the evaluation

    def cache_config(self) -> dict:
        """The ``cache_config`` of ``generate(cache_implementation="quantized", cache_config=...)``."""
        fields = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
        return {"backend": self.backend} | {field: getattr(self, field) for field in fields if getattr(self, field) is not None}

    def new_cache(self, model):
        """An empty ``transformers.QuantizedCache`` of this configuration for ``model``."""
        require_backends([self])
        from transformers import QuantizedCache

        options = self.cache_config()
        backend = options.pop("backend")
        return QuantizedCache(backend, model.config.get_text_config(decoder=True), **options)

    def prefill_chunks(self, tokens: int, batch: int, kv_heads: int, head_dim: int) -> list[int]:
        """How to prefill ``tokens`` prompt tokens so that this cache can pack them: ``[tokens]``, or for
        HQQ along axis 1 the longest prefix it can pack, then the few tokens left as a second chunk.

        HQQ's ``pack_2bit_u8`` (``pack_4bit_u8``) splits the rows of quantization groups into 4 (2)
        equal parts and raises a ``RuntimeError`` when ``batch * kv_heads * tokens * head_dim /
        q_group_size`` rows are not a multiple of 4 (2): a plain ``generate`` fails on such prompts.
        The rest then enters the residual, and every later flush adds ``residual_length`` tokens,
        which keeps the row count packable.
        """
        if self.backend != "hqq" or self.axis_key != 1:
            return [tokens]
        factor, group = {1: 8, 2: 4, 4: 2}.get(self.nbits, 1), self.q_group_size or 64
        for prefix in range(tokens, 0, -1):
            elements = batch * kv_heads * prefix * head_dim
            if elements % group == 0 and (elements // group) % factor == 0:
                return [prefix] + ([tokens - prefix] if prefix < tokens else [])
        raise ValueError(f"{self.name}: no prefix of the {tokens}-token prompt packs into {group}-element groups")

    def record(self) -> dict:
        """What the results JSON stores as the method's ``config``."""
        return {"name": self.name, "transformers_quantized_cache": self.cache_config()}


HF_METHODS = {
    method.name: method
    for method in (
        HFQuantizedMethod("hf-quanto-2", "quanto", nbits=2, axis_key=0, axis_value=0, q_group_size=64, residual_length=128),
        HFQuantizedMethod("hf-quanto-4", "quanto", nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128),
        HFQuantizedMethod("hf-hqq-2", "hqq", nbits=2, axis_key=1, axis_value=1, q_group_size=64, residual_length=128),
        HFQuantizedMethod("hf-hqq-4", "hqq", nbits=4, axis_key=1, axis_value=1, q_group_size=64, residual_length=128),
        HFQuantizedMethod("hf-fp8", "fp8"),
    )
}
"""The comparison methods (transformers' documented axes: quanto 0, HQQ 1; group 64, residual 128)."""


def transformers_has_backend(backend: str) -> bool:
    """Whether the installed transformers' ``QuantizedCache`` offers ``backend``."""
    import inspect

    from transformers import cache_utils

    if backend == "fp8":
        return hasattr(cache_utils, "Fp8QuantizedLayer")
    return f'"{backend}"' in inspect.getsource(cache_utils.QuantizedCache.__init__)


def require_backends(methods) -> None:
    """Raise before any work if a method's backend is missing.

    :class:`MissingExtraError` (naming the ``hf-quantized`` extra) when optimum-quanto or HQQ is
    not installed; ``ValueError`` when the installed transformers has no such backend (``fp8``
    before transformers added it).
    """
    missing = sorted(
        {_BACKEND_PACKAGES[m.backend] for m in methods if _BACKEND_MODULES[m.backend] and not _installed(_BACKEND_MODULES[m.backend])}
    )
    if missing:
        names = ", ".join(m.name for m in methods if _BACKEND_PACKAGES.get(m.backend) in missing)
        raise MissingExtraError(
            f"{names} run transformers' QuantizedCache through {' and '.join(missing)}, which is not installed: "
            f"install the {EXTRA!r} extra: {INSTALL_HINT}"
        )
    for method in methods:
        if not transformers_has_backend(method.backend):
            import transformers

            raise ValueError(f"{method.name}: transformers {transformers.__version__} has no {method.backend!r} backend of QuantizedCache")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        return False


# ----------------------------------------------------------------------------- bit accounting
_SCALE_NAMES = ("scale", "shift", "zero")


def _stored(value, name: str = "") -> tuple[int, int]:
    """``(code bytes, scale and zero bytes)`` of one stored quantized state, walking its tensors.

    Handles tensor subclasses that flatten into inner tensors (optimum-quanto's ``WeightQBitsTensor``
    holds a ``PackedTensor`` of codes, a scale and a shift), tuples (HQQ: codes and a dict of
    metadata with its scale and zero; fp8: codes and a scale) and dicts.
    """
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            inner, _ = value.__tensor_flatten__()
            parts = [_stored(getattr(value, attribute), attribute) for attribute in inner]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        size = value.numel() * value.element_size()
        return (0, size) if any(word in name.lower() for word in _SCALE_NAMES) else (size, 0)
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and all(isinstance(item, torch.Tensor) for item in value):  # fp8: (codes, scale)
            return _stored(value[0])[0], sum(_stored(value[1], "scale"))
        parts = [_stored(item, name) for item in value]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if isinstance(value, dict):
        parts = [_stored(item, str(key)) for key, item in value.items()]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return 0, 0


def _logical_elements(value) -> int:
    """Element slots of one stored quantized state (its dequantized shape)."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, tuple) and isinstance(value[1], dict):  # HQQ: (codes, meta with the original shape)
        return math.prod(value[1]["shape"])
    if isinstance(value, tuple):  # fp8: (codes, scale)
        return value[0].numel()
    raise TypeError(f"unknown quantized state {type(value).__name__}")


def quantized_cache_memory(cache) -> dict:
    """Bytes that a transformers ``QuantizedCache`` holds, read from its tensors, and bits per element.

    Returns ``residual`` (the unquantized keys and values not yet flushed), ``packed_keys``,
    ``packed_values``, ``key_scales_zeros``, ``value_scales_zeros``, ``scales_zeros``,
    ``total_bytes``, ``quantized_elements`` (element slots of the quantized keys, = of the values),
    ``key_bits_per_element`` / ``value_bits_per_element`` (codes with their scales and zeros over the
    quantized elements, as ``PNMixCache.memory_report`` counts them), ``cached_elements`` (keys of
    every cached token) and ``bits_per_element`` (every stored byte, residual included, over the
    keys and values of every cached token).
    """
    parts = dict.fromkeys(("residual", "packed_keys", "packed_values", "key_scales_zeros", "value_scales_zeros"), 0)
    quantized = cached = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for state in (layer.keys, layer.values):
            if isinstance(state, torch.Tensor):
                parts["residual"] += state.numel() * state.element_size()
        residual_keys = layer.keys.numel() if isinstance(layer.keys, torch.Tensor) else 0
        if layer._quantized_keys is None:
            cached += residual_keys
            continue
        for kind, state in (("keys", layer._quantized_keys), ("values", layer._quantized_values)):
            codes, scales = _stored(state)
            parts[f"packed_{kind}"] += codes
            parts[f"{kind[:-1]}_scales_zeros"] += scales
        elements = _logical_elements(layer._quantized_keys)
        quantized += elements
        cached += elements + residual_keys
    report = dict(parts)
    report["scales_zeros"] = parts["key_scales_zeros"] + parts["value_scales_zeros"]
    report["total_bytes"] = sum(parts.values())
    report["quantized_elements"] = quantized
    report["cached_elements"] = cached
    for kind in ("key", "value"):
        stored = parts[f"packed_{kind}s"] + parts[f"{kind}_scales_zeros"]
        report[f"{kind}_bits_per_element"] = 8 * stored / quantized if quantized else math.nan
    report["bits_per_element"] = 8 * report["total_bytes"] / (2 * cached) if cached else math.nan
    return report
