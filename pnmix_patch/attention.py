"""PN-Mix attention: the forward that replaces a patched model's attention modules.

The replacement keeps the module's own projections, q/k norms and RoPE (the
architecture adapter in ``pnmix_patch.patches`` says how), then hands the
post-RoPE queries, keys and values to the layer's :class:`~pnmix_patch.cache.PNMixLayer`,
which attends and appends. The decode steps of a static cache take the queries and keys
before the norms and RoPE instead, and its append kernel does both. Without a cache (``use_cache=False``), and for the
first chunk into an empty cache (the prefill), it is exact attention through torch
SDPA (:func:`~pnmix_patch.reference.attention.chunk_attention`).
"""

from __future__ import annotations

import torch

from .mixins import RuntimeMixin
from .reference.attention import chunk_attention, chunk_validity


def pnmix_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None, **kwargs):
    """Forward of a patched attention module (:class:`PNMixAttention`).

    A decode step into a static cache hands the query and key to the cache before the q/k norms and
    RoPE: its append kernel does both (``pnmix::decode_rotate_append``, one launch where compiled
    code takes three), where the architecture allows (the adapter's ``kernel_norms``).

    Under autocast the projections (and ``o_proj``) run in the autocast dtype, and the attention and
    the cache in the hidden states' own dtype with autocast off: the cache stores one dtype (autocast
    would leave the values in its dtype and promote the keys through RoPE's float32 cos/sin)."""
    cache = cache if cache is not None else past_key_values
    query, key, value = self._pnmix_adapter.project(self, hidden_states)
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        query, key, value = (x.to(hidden_states.dtype) for x in (query, key, value))
        with torch.autocast(device_type, enabled=False):
            output = _attend(self, hidden_states, query, key, value, position_embeddings, attention_mask, cache)
    else:
        output = _attend(self, hidden_states, query, key, value, position_embeddings, attention_mask, cache)
    return self.o_proj(output), None


class PNMixAttention(RuntimeMixin):
    """Mixin of a patched attention module: ``patch_model`` gives each attention module the class
    ``PNMix<its class>`` (:mod:`pnmix_patch.mixins`), whose forward is :func:`pnmix_attention_forward`."""

    prefix = "PNMix"
    forward = pnmix_attention_forward


def _attend(self, hidden_states, query, key, value, position_embeddings, attention_mask, cache) -> torch.Tensor:
    """The rest of :func:`pnmix_attention_forward` after the projections: q/k norms, RoPE, the cache's
    attention and append; output ``[B, T, Hq * D]``."""
    adapter = self._pnmix_adapter
    cos, sin = position_embeddings
    batch, chunk = hidden_states.shape[:2]
    layer = None
    if cache is not None:
        layer = cache.layers[self.layer_idx]
        if not hasattr(layer, "attend"):
            raise TypeError(
                f"a PN-Mix patched model needs a PNMixCache, got {type(cache).__name__} with a {type(layer).__name__} "
                f"at layer {self.layer_idx}; pass no cache (one is created) or a pnmix_patch.PNMixCache"
            )
    norms = adapter.kernel_norms(self) if layer is not None and layer.decodes(chunk) else None
    if norms is not None:
        output = layer.attend_rotating(query, key, value, cos, sin, norms, self.scaling)
    else:
        query, key = self._pnmix_rotary(*adapter.norms(self, query, key), cos, sin)
        if layer is None:
            output = chunk_attention(query, key, value, chunk_validity(attention_mask, batch, chunk, hidden_states.device), self.scaling)
        else:
            valid = layer.chunk_validity(attention_mask, batch, chunk, hidden_states.device)
            output = layer.attend(query, key, value, valid, self.scaling)
    return output.transpose(1, 2).reshape(batch, chunk, -1)
