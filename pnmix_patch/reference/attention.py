"""Reference attention in float32: the math the decode kernels are tested against.

- :func:`masked_attention`: softmax attention with GQA over given keys and values and a boolean mask.
- :func:`chunk_attention`: exact causal attention of a chunk over itself (the prefill), through torch SDPA.
- :func:`cache_attention`: a chunk's queries over a PN-Mix cache layer (sinks, quantized groups,
  residual) plus the chunk itself; the CPU path of the decode step, and the path of every device for
  the layouts the fused decode kernels do not read. The quantized groups' logits come from the layer
  (``PNMixLayer.quantized_key_logits``: dequantized keys, or PolarQuant's table lookup).
- :func:`chunk_validity`: which tokens of a chunk are real, from transformers' 4D mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _segment_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """Bool ``[B, size]``: slot j of sequence b holds a token (j < lengths[b])."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """Float32 softmax attention with GQA.

    ``query [B, Hq, T, D]``, ``keys/values [B, H, S, D]``, ``allowed`` bool broadcastable to
    ``[B, 1, T, S]``. Rows with no allowed key return zeros.
    """
    return logits_attention(key_logits(query, keys) * scaling, values, allowed)


def key_logits(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Unscaled float32 logits ``[B, Hq, T, S]`` of ``query [B, Hq, T, D]`` over ``keys [B, H, S, D]`` (GQA)."""
    batch, query_heads, chunk, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.float().view(batch, kv_heads, query_heads // kv_heads, chunk, head_dim)
    return torch.einsum("bhgtd,bhsd->bhgts", grouped, keys.float()).reshape(batch, query_heads, chunk, keys.shape[2])


def logits_attention(logits: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Float32 softmax attention from scaled logits ``[B, Hq, T, S]`` over ``values [B, H, S, D]`` (GQA);
    ``allowed`` bool broadcastable to ``[B, 1, T, S]``. Rows with no allowed key return zeros."""
    batch, query_heads, chunk, slots = logits.shape
    kv_heads, head_dim = values.shape[1], values.shape[3]
    logits = logits.view(batch, kv_heads, query_heads // kv_heads, chunk, slots)
    allowed = allowed.unsqueeze(1)
    weights = torch.softmax(logits.masked_fill(~allowed, NEG_INF), dim=-1)
    # A row with no allowed key is zero; NaN from a non-finite key still propagates.
    weights = torch.where(allowed.any(-1, keepdim=True), weights, 0.0)
    # Slots no query may read (padding, unused buffer space) must not leak NaN through 0 * NaN.
    readable = allowed.flatten(1, 3).any(1)[:, None, :, None]
    output = torch.einsum("bhgts,bhsd->bhgtd", weights, torch.where(readable, values.float(), 0.0))
    return output.reshape(batch, query_heads, chunk, head_dim)


def chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Exact causal attention of a chunk over itself (no cache, or a cache holding nothing yet).

    ``query [B, Hq, T, D]``, ``key/value [B, H, T, D]``, ``valid`` bool ``[B, T]`` or None.
    Runs torch SDPA (flash or memory-efficient kernels on CUDA, no ``T x T`` float32
    scores), so long prompts prefill fast. Rows of padding queries are zero.
    """
    ratio = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(ratio, 1), value.repeat_interleave(ratio, 1)
    if valid is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    chunk = key.shape[2]
    # Padding never reaches the output, not even as NaN through 0 * NaN.
    key, value = (torch.where(valid[:, None, :, None], x, 0.0) for x in (key, value))
    allowed = (torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril() & valid[:, None, :])[:, None]
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return torch.where(allowed.any(-1, keepdim=True), output, 0.0)  # a row with no key: zeros, not NaN


def cache_attention(layer, query, key, value, valid, scaling) -> torch.Tensor:
    """Reference attention of ``query`` over ``layer``'s cache plus the chunk ``key/value``.

    The chunk is attended exactly and causally (a padding key is never attended);
    cached tokens are all visible. Output ``[B, Hq, T, D]`` in the query dtype.
    """
    chunk = key.shape[2]
    quantized_values = layer.quantized_values()
    logits = torch.cat(
        [
            key_logits(query, layer.sink_keys),
            layer.quantized_key_logits(query),
            key_logits(query, torch.cat([layer.residual_keys, key.to(layer.residual_keys.dtype)], dim=2)),
        ],
        dim=-1,
    )
    values = torch.cat([layer.sink_values.float(), quantized_values, layer.residual_values.float(), value.float()], dim=2)
    cached = torch.cat(
        [
            _segment_mask(layer.sink_len, layer.sink_keys.shape[2]),
            _segment_mask(layer.num_groups * layer.pnmix_config.key_group_size, quantized_values.shape[2]),
            _segment_mask(layer.residual_len, layer.residual_keys.shape[2]),
        ],
        dim=1,
    )
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()
    chunk_allowed = causal[None] & valid[:, None, :]
    allowed = torch.cat([cached[:, None, :].expand(-1, chunk, -1), chunk_allowed], dim=2)
    return logits_attention(logits * scaling, values, allowed[:, None]).to(query.dtype)


def chunk_validity(attention_mask: torch.Tensor | None, batch: int, chunk: int, device, start: int | None = None) -> torch.Tensor | None:
    """Which tokens of the new chunk are real, from transformers' 4D boolean mask.

    The last query row of a left-padded batch is a real token that may attend every
    real key, so its columns ``start .. start + chunk`` (the chunk's positions; by
    default the last ``chunk`` columns) mark the chunk's real tokens.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"PN-Mix attention expects a 4D attention mask or None, got shape {tuple(attention_mask.shape)}")
    columns = slice(-chunk, None) if start is None else slice(start, start + chunk)
    row = attention_mask[:, 0, -1, columns]
    valid = row if row.dtype == torch.bool else row == 0
    return valid.expand(batch, chunk).to(device)
