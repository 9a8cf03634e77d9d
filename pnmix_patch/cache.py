"""The PN-Mix KV cache: a transformers ``Cache`` whose layers hold packed integers.

Token regions of every sequence ``b`` (``docs/method.md``, "Online quantization")::

    [ sinks: first N_s tokens, 16-bit ][ quantized groups of G tokens ][ residual: 1..N newest, 16-bit ]

- Only real tokens are stored: left padding is dropped on the way in, so a
  quantization group never includes padding and never mixes sequences; every
  sequence has its own ``sink_len``, ``num_groups`` and ``residual_len``
  (int32 device tensors, read by the kernels).
- The residual buffer is flushed (quantized into ``N / G`` new groups) when it is
  full and another token arrives; it therefore always holds the 1..N most recent
  tokens. The ``fp16`` preset never flushes: the residual just grows.
- Pairs are selected once per sequence, from the first chunk holding real tokens
  (the prompt), and stored as a packed bit mask ``[B, H, ceil(D/64)]`` int32.
- The key format (``PNMixConfig.key_format``) decides the packed key tensors: per-channel
  codes at two widths (``key_codes_low``: the low planes of every channel, ``key_codes_high``: the
  planes above them of the selected channels; :mod:`.reference.quantize`), PolarQuant's radius and angle
  codes (``key_codes_radius`` / ``key_codes_angle``, :mod:`.reference.polar`) or ChanMix's four
  channel classes (``key_codes_retrieval`` ... ``key_codes_subnormal`` and the per-sequence
  ``channel_class_bits``, :mod:`.reference.chanmix`, classified at prefill like the pairs).
  Values, sinks and residual are the same in every format.

Attention through a layer (:meth:`PNMixLayer.attend`) is: flush full residual
buffers of sequences receiving tokens; attend over the cache plus the new chunk's
exact keys and values (causal within the chunk, so prefill is exact attention; into
an empty cache it runs as torch SDPA);
append the chunk. A decode step therefore sees sinks, quantized groups and the
residual including its own token.

Nothing dequantized is kept between steps: the reference attention dequantizes
on the fly, the Triton kernel reads codes in registers. Only configurations with
``PNMixConfig.fused_decode`` take the fused decode op (Triton or Gluon on CUDA); the others,
whose layouts the kernels do not read, attend through the PyTorch reference on every device
(:meth:`PNMixLayer.fused_decode_step`).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import PNMixConfig, resolve_config
from .kernels.decode_attention import decode_attention
from .kernels.pack_keys import pack_keys
from .kernels.pack_values import pack_values
from .reference.attention import cache_attention, chunk_attention, chunk_validity, key_logits
from .reference.chanmix import classify_channels, dequantize_class_keys, pack_classes, quantize_class_keys, unpack_classes
from .reference.polar import dequantize_polar_keys, polar_key_logits, quantize_polar_keys
from .reference.quantize import channel_order, dequantize_keys, dequantize_values, key_code_shape, scale_dtype_for
from .reference.selection import (
    PAIRINGS,
    group_channel_masks,
    pack_mask,
    pair_norms,
    pair_scores,
    pairs_to_channels,
    select_top_pairs,
    split_pairs,
    unpack_mask,
)

_STATE = (
    "sink_keys",
    "sink_values",
    "sink_len",
    "residual_keys",
    "residual_values",
    "residual_len",
    "key_codes_high",
    "key_codes_low",
    "key_scale",
    "key_zero",
    "value_codes",
    "value_scale",
    "value_zero",
    "num_groups",
    "pair_mask_bits",
    "selected",
    "group_mask_bits",
    "query_norm_sum",
    "query_count",
)
"""State of a layer of the per-channel key format (``key_format="channel"``), the one the static cache and
the cache files hold."""

KEY_CODE_FIELDS = {
    "channel": ("key_codes_high", "key_codes_low"),
    "polar": ("key_codes_radius", "key_codes_angle"),
    "channel_classes": ("key_codes_retrieval", "key_codes_outlier", "key_codes_normal", "key_codes_subnormal"),
}
"""The packed key code tensors of each key format."""

_FORMAT_ONLY_STATE = {"channel": ("pair_mask_bits",), "polar": (), "channel_classes": ("channel_class_bits",)}
"""State besides the key codes that one key format has and the others lack (only the per-channel format
selects pairs; the channel classes are stored as bit planes)."""
_SHARED_STATE = tuple(name for name in _STATE if name not in KEY_CODE_FIELDS["channel"] + _FORMAT_ONLY_STATE["channel"])
_FORMAT_STATE = {key_format: _SHARED_STATE + fields + _FORMAT_ONLY_STATE[key_format] for key_format, fields in KEY_CODE_FIELDS.items()}
_ALL_STATE = tuple(dict.fromkeys(name for names in _FORMAT_STATE.values() for name in names))


class PNMixLayer(CacheLayerMixin):
    """One decoder layer's PN-Mix cache (see the module docstring for the layout)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, pnmix_config: PNMixConfig, pairing: str = "half", max_cache_len: int | None = None):
        super().__init__()
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing={pairing!r} is invalid: allowed {PAIRINGS}")
        self.pnmix_config = pnmix_config
        self.pairing = pairing
        self.max_cache_len = max_cache_len
        self.seen_tokens = 0  # positions consumed, padding included (what transformers counts)

    # ----------------------------------------------------------------- set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the layer's tensors for the first chunk's batch, heads and head dim (empty code
        tensors that grow by groups), after checking its dtype and head dim.

        Raises:
            TypeError: the keys are not float16, bfloat16 or float32.
            ValueError: an odd head dim, or a quantizing config with a head dim that is not a multiple of 32.
        """
        batch, heads, _, head_dim = key_states.shape
        if not key_states.is_floating_point() or key_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"PN-Mix caches float16, bfloat16 or float32 keys, got {key_states.dtype}")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} has no RoPE pairs: allowed an even head dim")
        pnmix_config = self.pnmix_config
        if pnmix_config.quantize and head_dim % 32:
            raise ValueError(f"head_dim={head_dim} cannot be bit-packed: allowed a multiple of 32")
        self.batch_size, self.num_heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_high = pnmix_config.selected_channels(head_dim)
        self.value_group = pnmix_config.value_group(head_dim)
        residual_capacity = pnmix_config.residual_tokens if pnmix_config.quantize else 0

        def floats(*shape):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        def ints(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        scale_dtype = scale_dtype_for(self.dtype)
        self.key_code_names = KEY_CODE_FIELDS[pnmix_config.key_format]
        self.sink_keys, self.sink_values = (
            floats(batch, heads, pnmix_config.sink_tokens, head_dim),
            floats(batch, heads, pnmix_config.sink_tokens, head_dim),
        )
        self.residual_keys = floats(batch, heads, residual_capacity, head_dim)
        self.residual_values = floats(batch, heads, residual_capacity, head_dim)
        self.sink_len, self.residual_len, self.num_groups = ints(batch), ints(batch), ints(batch)
        for name, (bits, channels) in zip(self.key_code_names, pnmix_config.key_code_widths(head_dim)):
            setattr(self, name, ints(batch, heads, *key_code_shape(0, bits, pnmix_config.key_group_size, channels)))
        if pnmix_config.key_format == "channel_classes":
            self.channel_class_bits = ints(batch, heads, 2, -(-head_dim // 32))
        self.key_scale = torch.zeros(batch, heads, 0, head_dim, dtype=scale_dtype, device=self.device)
        self.key_zero = torch.zeros_like(self.key_scale)
        self.value_codes = ints(batch, heads, 0, pnmix_config.value_bits, head_dim // 32)
        self.value_scale = torch.zeros(batch, heads, 0, head_dim // self.value_group, dtype=scale_dtype, device=self.device)
        self.value_zero = torch.zeros_like(self.value_scale)
        if pnmix_config.key_format == "channel":  # (the other formats select no pairs)
            self.pair_mask_bits = ints(batch, heads, -(-head_dim // 64))
        self.selected = torch.zeros(batch, dtype=torch.bool, device=self.device)
        self.all_selected = False  # host copy of selected.all(): once True, no scoring and no sync
        # Per-group re-selection only (pnmix_config.reselection="per_group"): a selection mask per
        # stored group, and the running sum of GQA-averaged query pair norms for qk_pair_norm.
        units = head_dim if pnmix_config.selection_unit == "channel" else head_dim // 2
        self.group_mask_bits = ints(batch, heads, 0, -(-units // 32))
        tracks_queries = pnmix_config.reselection == "per_group" and pnmix_config.selection == "qk_pair_norm"
        self.query_norm_sum = torch.zeros(batch, heads, head_dim // 2 if tracks_queries else 0, device=self.device)
        self.query_count = ints(batch)
        self.is_initialized = True

    @property
    def state_names(self) -> tuple[str, ...]:
        """The names of this layer's state tensors (they depend on the key format)."""
        return _FORMAT_STATE[self.pnmix_config.key_format]

    @property
    def key_group_names(self) -> tuple[str, ...]:
        """The tensors holding one entry per key group: the packed codes, then scale and zero."""
        return (*self.key_code_names, "key_scale", "key_zero")

    # ------------------------------------------------------------ transformers API
    def update(self, key_states, value_states, *args, **kwargs):
        """Not supported: PN-Mix attention writes and reads this layer itself (raises ``NotImplementedError``)."""
        raise NotImplementedError(
            "A PN-Mix cache layer is read and written by PN-Mix attention (PNMixLayer.attend), which returns the "
            "attention output directly; it never hands full key/value tensors back. Patch the model with "
            "pnmix_patch.patch_model(model) instead of using this cache with unpatched attention."
        )

    def get_seq_length(self) -> int:
        """Positions consumed, padding included."""
        return self.seen_tokens

    def get_max_length(self) -> int:
        """``max_cache_len``, or -1 for a cache without one."""
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """``(cached + new positions, 0)``: the mask spans what the chunk attends to."""
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        """Drop every tensor: the next chunk allocates again."""
        self.seen_tokens = 0
        self.is_initialized = False
        for name in _ALL_STATE:
            if hasattr(self, name):
                delattr(self, name)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering: :meth:`batch_select_indices`."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices`` (in that order, repeats allowed): the batch may change size."""
        if self.is_initialized:
            for name in self.state_names:
                setattr(self, name, getattr(self, name).index_select(0, indices.to(self.device)))
            self.batch_size = self.sink_len.shape[0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times in place (``generate``'s expansion for several returns)."""
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    # ------------------------------------------------------------------ state
    @property
    def selected_pairs(self) -> torch.Tensor:
        """Selected-pair mask, bool ``[batch, kv_heads, head_dim // 2]``."""
        return unpack_mask(self.pair_mask_bits, self.head_dim // 2)

    @property
    def channel_mask(self) -> torch.Tensor:
        """Channels stored at ``key_bits_high``, bool ``[batch, kv_heads, head_dim]``."""
        return pairs_to_channels(self.selected_pairs, self.pairing)

    @property
    def stored_channel_mask(self) -> torch.Tensor:
        """High-precision channels the packed keys were written with: bool ``[B, H, D]`` (one
        selection per sequence) or ``[B, H, groups, D]`` (per-group re-selection)."""
        if self.pnmix_config.reselection == "prefill":
            return self.channel_mask
        if self.pnmix_config.selection_unit == "channel":
            return unpack_mask(self.group_mask_bits, self.head_dim)
        return pairs_to_channels(unpack_mask(self.group_mask_bits, self.head_dim // 2), self.pairing)

    @property
    def channel_classes(self) -> torch.Tensor:
        """ChanMix's channel classes (``key_format="channel_classes"``), int64 ``[batch, kv_heads, head_dim]``:
        0 retrieval, 1 outlier, 2 normal, 3 subnormal."""
        return unpack_classes(self.channel_class_bits, self.head_dim)

    @property
    def group_capacity(self) -> int:
        """Key groups the packed tensors have room for (they grow when a flush needs more)."""
        return self.key_scale.shape[2]

    # ---------------------------------------------------------------- attend
    def chunk_validity(self, attention_mask: torch.Tensor | None, batch: int, chunk: int, device) -> torch.Tensor | None:
        """Bool ``[B, chunk]`` real-token mask of the next chunk (None: all real), from the 4D mask."""
        return chunk_validity(attention_mask, batch, chunk, device)

    def fused_decode_step(self, chunk: int) -> bool:
        """Whether a chunk of ``chunk`` tokens attends through the fused decode op (``pnmix::decode_attention``:
        the Triton or Gluon kernel on CUDA, its PyTorch reference elsewhere). Only a one-token step of a
        configuration with ``PNMixConfig.fused_decode`` does: the polar and channel-class formats and
        per-group re-selection store layouts the kernels cannot read, so they always take the reference
        attention (``reference.attention.cache_attention``), on CUDA too."""
        return chunk == 1 and self.pnmix_config.fused_decode

    def decodes(self, chunk: int) -> bool:
        """Whether a chunk of ``chunk`` tokens is a decode step that ``attend_rotating`` serves: never here
        (:class:`~pnmix_patch.static_cache.PNMixStaticLayer` has it; this cache's steps run the reference path)."""
        return False

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Attention of a chunk of queries over this cache, then append the chunk.

        Args:
            query: ``[B, Hq, T, D]``, post-RoPE.
            key, value: ``[B, H, T, D]``, post-RoPE keys of the same chunk.
            valid: bool ``[B, T]`` (False = padding) or None when all tokens are real.
            scaling: softmax scale.
        Returns:
            ``[B, Hq, T, D]`` in the query dtype; rows of padding queries are zero.
        """
        chunk = key.shape[2]
        if self.max_cache_len is not None and self.seen_tokens + chunk > self.max_cache_len:
            raise ValueError(
                f"the PN-Mix cache holds at most max_cache_len={self.max_cache_len} positions; "
                f"{self.seen_tokens} are cached and {chunk} more were given"
            )
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        if key.shape[0] != self.batch_size:
            raise ValueError(f"batch size {key.shape[0]} does not match the cache's batch size {self.batch_size}")
        all_real = valid is None  # (then the prefill takes SDPA's causal path, no mask)
        if valid is None:
            valid = torch.ones(key.shape[0], chunk, dtype=torch.bool, device=key.device)
        incoming = valid.sum(1).to(torch.int32)
        self._select_pairs(query, key, valid, incoming, all_real)
        # A full residual buffer is flushed before a token is added to it.
        self._flush(self.residual_keys, self.residual_values, incoming.gt(0) & self.residual_len.eq(self.residual_capacity))
        if self.fused_decode_step(chunk):
            # Decode: the token joins the residual, then the fused op reads the packed cache
            # (Triton on CUDA, the PyTorch reference elsewhere).
            self._append(key, value, valid, incoming)
            output = self._decode_attention(query[:, :, 0], scaling).unsqueeze(2)
        else:
            if self.seen_tokens == 0:  # the prefill: nothing cached, exact causal attention through SDPA
                output = chunk_attention(query, key, value, None if all_real else valid, scaling)
            else:
                output = cache_attention(self, query, key, value, valid, scaling)
            self._append(key, value, valid, incoming)
        self.seen_tokens += chunk
        return output

    def _decode_attention(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return decode_attention(
            query,
            channel_order(self.channel_mask),
            self.sink_keys,
            self.sink_values,
            self.sink_len,
            self.key_codes_high,
            self.key_codes_low,
            self.key_scale,
            self.key_zero,
            self.value_codes,
            self.value_scale,
            self.value_zero,
            self.num_groups,
            self.residual_keys,
            self.residual_values,
            self.residual_len,
            scaling,
        )

    @property
    def residual_capacity(self) -> int:
        """Tokens the full-precision residual buffer holds before a flush (-1 where nothing is quantized)."""
        return self.residual_keys.shape[2] if self.pnmix_config.quantize else -1

    def _select_pairs(self, query, key, valid, incoming, all_real: bool = False) -> None:
        if not self.pnmix_config.quantize:
            return
        if self.pnmix_config.reselection == "per_group":
            self._track_query_norms(query, valid)  # groups select when they are flushed
            return
        if self.all_selected or self.pnmix_config.key_format == "polar":  # (the polar format selects nothing)
            return
        # Scored for the whole batch, kept for the sequences selecting now; the launches are
        # queued before the one host sync (selected.all()), so they overlap the GPU's work.
        pending = incoming.gt(0) & ~self.selected
        if self.pnmix_config.key_format == "channel_classes":
            classes = classify_channels(query, key, None if all_real else valid, self.pnmix_config.class_counts(self.head_dim))
            self.channel_class_bits = torch.where(pending[:, None, None, None], pack_classes(classes), self.channel_class_bits)
        else:
            scores = pair_scores(query, key, None if all_real else valid, self.pnmix_config.selection, self.pairing)
            new_bits = pack_mask(select_top_pairs(scores, self.num_high // 2))
            self.pair_mask_bits = torch.where(pending[:, None, None], new_bits, self.pair_mask_bits)
        self.selected = self.selected | pending
        self.all_selected = bool(self.selected.all())

    def _append(self, key, value, valid, incoming) -> None:
        batch, heads, chunk, head_dim = key.shape
        # Move each sequence's real tokens to the front of the chunk (stable: order kept).
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        index = order[:, None, :, None].expand(-1, heads, -1, head_dim)
        key, value = key.gather(2, index), value.gather(2, index)
        positions = torch.arange(chunk, device=key.device)

        # Sinks take the first real tokens until N_s are held.
        to_sinks = torch.minimum(self.pnmix_config.sink_tokens - self.sink_len, incoming)
        rows, cols = torch.nonzero(positions[None, :] < to_sinks[:, None], as_tuple=True)
        slots = self.sink_len[rows] + cols
        self.sink_keys[rows, :, slots] = key[rows, :, cols]
        self.sink_values[rows, :, slots] = value[rows, :, cols]
        self.sink_len = self.sink_len + to_sinks

        # The rest streams through the residual buffer: [old residual | new tokens].
        to_residual = incoming - to_sinks
        total = self.residual_len + to_residual
        if not self.pnmix_config.quantize:
            flushed = torch.zeros_like(total)
            capacity = max(int(total.max()), self.residual_keys.shape[2])
        else:
            capacity = self.pnmix_config.residual_tokens
            # Flush whole buffers while more than N tokens remain, keeping the newest 1..N.
            flushed = torch.where(to_residual > 0, (total - 1).clamp_min(0) // capacity * capacity, 0)
        stream_len = max(int(total.max()), self.residual_keys.shape[2])
        stream_k = key.new_zeros(batch, heads, stream_len, head_dim)
        stream_v = value.new_zeros(batch, heads, stream_len, head_dim)
        stream_k[:, :, : self.residual_keys.shape[2]] = self.residual_keys
        stream_v[:, :, : self.residual_values.shape[2]] = self.residual_values
        rows, cols = torch.nonzero(positions[None, :] < to_residual[:, None], as_tuple=True)
        slots = self.residual_len[rows] + cols
        stream_k[rows, :, slots] = key[rows, :, to_sinks[rows] + cols]
        stream_v[rows, :, slots] = value[rows, :, to_sinks[rows] + cols]

        if bool(flushed.gt(0).any()):
            self._flush(stream_k, stream_v, flushed.gt(0), flushed)
        keep = (flushed[:, None] + torch.arange(capacity, device=key.device)).clamp_max(stream_len - 1)
        keep = keep[:, None, :, None].expand(-1, heads, -1, head_dim)
        self.residual_keys, self.residual_values = stream_k.gather(2, keep), stream_v.gather(2, keep)
        self.residual_len = total - flushed

    def _flush(self, keys, values, rows_mask, counts=None) -> None:
        """Quantize the first ``counts[b]`` tokens (default: the whole buffer) of ``keys/values[b]``
        into new groups of every sequence ``b`` in ``rows_mask``; shift the buffers if they are the residual."""
        if not self.pnmix_config.quantize or not bool(rows_mask.any()):
            return
        pnmix_config = self.pnmix_config
        group = pnmix_config.key_group_size
        rows = torch.nonzero(rows_mask, as_tuple=True)[0]
        if counts is None:
            counts = torch.where(rows_mask, self.residual_len, 0)
        longest = int(counts.max())
        block_k, block_v = keys[rows, :, :longest], values[rows, :, :longest]
        key_groups, group_masks = self._pack_key_groups(block_k, rows)
        value_codes, value_scale, value_zero = pack_values(
            block_v, pnmix_config.value_bits, self.value_group, pnmix_config.midpoint_correction, group
        )

        new_groups = counts[rows] // group
        self._reserve_groups(int((self.num_groups[rows] + new_groups).max()))
        group_rows, group_cols = torch.nonzero(
            torch.arange(longest // group, device=keys.device)[None] < new_groups[:, None], as_tuple=True
        )
        target_rows, target_groups = rows[group_rows], self.num_groups[rows][group_rows] + group_cols
        for name, packed in zip(self.key_group_names, key_groups):
            getattr(self, name)[target_rows, :, target_groups] = packed[group_rows, :, group_cols]
        if group_masks is not None:
            self.group_mask_bits[target_rows, :, target_groups] = group_masks[group_rows, :, group_cols]
        token_offsets = torch.arange(group, device=keys.device)
        target_tokens = (target_groups * group)[:, None] + token_offsets
        source_tokens = (group_cols * group)[:, None] + token_offsets
        target_rows_t, group_rows_t = target_rows[:, None].expand_as(target_tokens), group_rows[:, None].expand_as(target_tokens)
        self.value_codes[target_rows_t, :, target_tokens] = value_codes[group_rows_t, :, source_tokens]
        self.value_scale[target_rows_t, :, target_tokens] = value_scale[group_rows_t, :, source_tokens]
        self.value_zero[target_rows_t, :, target_tokens] = value_zero[group_rows_t, :, source_tokens]
        self.num_groups = self.num_groups + torch.zeros_like(self.num_groups).index_put((rows,), new_groups)
        if keys is self.residual_keys:
            self.residual_len = torch.where(rows_mask, 0, self.residual_len)

    def _pack_key_groups(self, block_k, rows):
        """Quantize and pack ``block_k [rows, H, tokens, D]`` (whole groups) into key groups.

        Returns the tensors of :attr:`key_group_names` (for the per-channel format ``pack_keys``'s
        four) and, with per-group re-selection, every group's packed selection mask
        ``[rows, H, groups, words]`` (else None).
        """
        pnmix_config = self.pnmix_config
        if pnmix_config.key_format == "polar":
            groups = quantize_polar_keys(
                block_k, pnmix_config.key_group_size, pnmix_config.radius_bits, pnmix_config.angle_bits, self.pairing
            )
            return groups, None
        if pnmix_config.key_format == "channel_classes":
            groups = quantize_class_keys(
                block_k,
                self.channel_classes[rows],
                pnmix_config.class_counts(self.head_dim),
                pnmix_config.class_bits,
                pnmix_config.key_group_size,
                pnmix_config.midpoint_correction,
            )
            return groups, None

        def pack(keys, order):
            return pack_keys(
                keys,
                order,
                self.num_high,
                pnmix_config.key_group_size,
                pnmix_config.key_bits_high,
                pnmix_config.key_bits_low,
                pnmix_config.midpoint_correction,
            )

        if pnmix_config.reselection == "prefill":
            return pack(block_k, channel_order(self.channel_mask[rows])), None
        batch, heads, tokens, head_dim = block_k.shape
        group = pnmix_config.key_group_size
        query_mean = None
        if pnmix_config.selection == "qk_pair_norm":
            query_mean = self.query_norm_sum[rows] / self.query_count[rows].clamp_min(1)[:, None, None]
        grouped = block_k.reshape(batch, heads, tokens // group, group, head_dim)
        masks = group_channel_masks(grouped, pnmix_config.selection, pnmix_config.selection_unit, self.pairing, self.num_high, query_mean)
        orders = channel_order(masks)
        parts = [pack(block_k[:, :, g * group : (g + 1) * group], orders[:, :, g]) for g in range(tokens // group)]
        units = masks if pnmix_config.selection_unit == "channel" else split_pairs(masks, self.pairing)[0]
        return tuple(torch.cat(part, dim=2) for part in zip(*parts)), pack_mask(units)

    def _track_query_norms(self, query, valid) -> None:
        """Add the chunk's real queries' pair norms (GQA-averaged per KV head) to the running sum."""
        if self.query_norm_sum.shape[-1] == 0:
            return
        batch, _, _, head_dim = query.shape
        norms = torch.where(valid[:, None, :, None], pair_norms(query, self.pairing), 0.0).sum(2)
        self.query_norm_sum = self.query_norm_sum + norms.view(batch, self.num_heads, -1, head_dim // 2).mean(2)
        self.query_count = self.query_count + valid.sum(1).to(torch.int32)

    def _reserve_groups(self, needed: int) -> None:
        """Grow the packed storage to hold ``needed`` groups per sequence."""
        extra = needed - self.group_capacity
        if extra <= 0:
            return
        group = self.pnmix_config.key_group_size

        def grow(tensor, dim_extra):
            shape = list(tensor.shape)
            shape[2] = dim_extra
            return torch.cat([tensor, tensor.new_zeros(shape)], dim=2)

        for name in self.key_group_names:
            setattr(self, name, grow(getattr(self, name), extra))
        self.value_codes = grow(self.value_codes, extra * group)
        self.value_scale, self.value_zero = grow(self.value_scale, extra * group), grow(self.value_zero, extra * group)
        if self.pnmix_config.reselection == "per_group":
            self.group_mask_bits = grow(self.group_mask_bits, extra)

    # ---------------------------------------------------------------- reading
    def quantized_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float32 keys and values of the quantized region, ``[B, H, groups*G, D]``
        (transient, for the reference attention and for tests)."""
        return self.quantized_keys(), self.quantized_values()

    def _empty_quantized(self) -> torch.Tensor:
        return torch.zeros(self.batch_size, self.num_heads, 0, self.head_dim, device=self.device)

    def quantized_keys(self) -> torch.Tensor:
        """Dequantized float32 keys of the quantized region, ``[B, H, groups*G, D]``, in channel order."""
        if self.group_capacity == 0:
            return self._empty_quantized()
        key_format = self.pnmix_config.key_format
        if key_format == "polar":
            return dequantize_polar_keys(self.key_codes_radius, self.key_codes_angle, self.key_scale, self.key_zero, self.pairing)
        if key_format == "channel_classes":
            codes = tuple(getattr(self, name) for name in self.key_code_names)
            return dequantize_class_keys(codes, self.key_scale, self.key_zero, self.channel_classes)
        return dequantize_keys(self.key_codes_high, self.key_codes_low, self.key_scale, self.key_zero, self.stored_channel_mask)

    def quantized_values(self) -> torch.Tensor:
        """Dequantized float32 values of the quantized region, ``[B, H, groups*G, D]``."""
        if self.group_capacity == 0:
            return self._empty_quantized()
        return dequantize_values(self.value_codes, self.value_scale, self.value_zero, self.pnmix_config.key_group_size)

    def quantized_key_logits(self, query: torch.Tensor) -> torch.Tensor:
        """Unscaled logits ``query . key`` of ``query [B, Hq, T, D]`` over the quantized keys: float32
        ``[B, Hq, T, groups*G]``. The polar format reads them by table lookup over its angle levels
        (:func:`~pnmix_patch.reference.polar.polar_key_logits`), without rebuilding a key; the others
        from the dequantized keys."""
        if self.pnmix_config.key_format == "polar" and self.group_capacity:
            return polar_key_logits(query, self.key_codes_radius, self.key_codes_angle, self.key_scale, self.key_zero, self.pairing)
        return key_logits(query, self.quantized_keys())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by each part of this layer (0 before the first token)."""
        if not self.is_initialized:
            return dict.fromkeys(MEMORY_PARTS, 0) | {"quantized_elements": 0}

        def size(*names):
            return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)

        return {
            "sinks": size("sink_keys", "sink_values"),
            "residual": size("residual_keys", "residual_values"),
            "packed_keys": size(*self.key_code_names),
            "packed_values": size("value_codes"),
            "key_scales_zeros": size("key_scale", "key_zero"),
            "value_scales_zeros": size("value_scale", "value_zero"),
            "masks": self._mask_bytes(size),
            "lengths": size("sink_len", "residual_len", "num_groups", "selected"),
            # element slots of the quantized region (per keys, and per values)
            "quantized_elements": self.batch_size * self.num_heads * self.group_capacity * self.pnmix_config.key_group_size * self.head_dim,
        }

    def _mask_bytes(self, size) -> int:
        """Bytes of the selection state the packed keys need to be read: per-group masks (and the query
        statistics they are chosen with), ChanMix's channel classes, or the prefill pair mask where it
        selects some pairs but not all (the polar format selects nothing)."""
        if self.pnmix_config.reselection == "per_group":
            return size("group_mask_bits", "query_norm_sum", "query_count")
        if self.pnmix_config.key_format == "channel_classes":
            return size("channel_class_bits")
        if self.pnmix_config.key_format == "channel" and 0 < self.num_high < self.head_dim:
            return size("pair_mask_bits")
        return 0


MEMORY_PARTS = (
    "sinks",
    "residual",
    "packed_keys",
    "packed_values",
    "key_scales_zeros",
    "value_scales_zeros",
    "masks",
    "lengths",
)


def summarize_memory(parts: dict[str, int]) -> dict:
    """Add ``total_bytes`` and bits per quantized element to summed per-part byte counts."""
    report = {name: parts[name] for name in MEMORY_PARTS}
    report["scales_zeros"] = parts["key_scales_zeros"] + parts["value_scales_zeros"]
    report["total_bytes"] = sum(parts[name] for name in MEMORY_PARTS)
    elements = parts["quantized_elements"]
    report["quantized_elements"] = elements
    report["key_bits_per_element"] = (
        8 * (parts["packed_keys"] + parts["key_scales_zeros"] + parts["masks"]) / elements if elements else math.nan
    )
    report["value_bits_per_element"] = 8 * (parts["packed_values"] + parts["value_scales_zeros"]) / elements if elements else math.nan
    return report


class PNMixCache(Cache):
    """A transformers ``Cache`` of :class:`PNMixLayer` s, one per decoder layer.

    Args:
        config: the model's ``PretrainedConfig`` (for the number of layers), as transformers' caches take it.
        pnmix_config: a :class:`PNMixConfig` or preset name.
        pairing: RoPE pairing of the architecture (``"half"`` or ``"interleaved"``).
        max_cache_len: positions the cache accepts; more raises ``ValueError``. Default None: the cache
            grows as long as the generation does, like transformers' ``DynamicCache`` (its packed groups
            are reserved as they fill).
    """

    layer_class = PNMixLayer

    def __init__(self, config, pnmix_config: PNMixConfig | str = "pnmix-1", pairing: str = "half", max_cache_len: int | None = None):
        self.pnmix_config = resolve_config(pnmix_config)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.model_config = text_config  # the decoder's config, read by pnmix_patch.cache_io.save_cache
        layers = [self.layer_class(self.pnmix_config, pairing, max_cache_len) for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)

    def memory_report(self) -> dict:
        """Bytes really held by each part, summed over layers, and bits per quantized element.

        Keys: ``sinks``, ``residual``, ``packed_keys``, ``packed_values``,
        ``key_scales_zeros``, ``value_scales_zeros`` (and their sum ``scales_zeros``),
        ``masks``, ``lengths``, ``total_bytes``, ``quantized_elements``,
        ``key_bits_per_element`` and ``value_bits_per_element`` (NaN while nothing is
        quantized). Bits are storage bytes over the element slots of the quantized
        region; key bits include the selected-pair masks.
        """
        totals = dict.fromkeys((*MEMORY_PARTS, "quantized_elements"), 0)
        for layer in self.layers:
            for name, value in layer.memory_bytes().items():
                totals[name] += value
        return summarize_memory(totals)
