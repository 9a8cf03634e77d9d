"""Static PN-Mix cache: storage of fixed size and address, so a decode step compiles whole.

:class:`PNMixStaticCache` holds the same packed layout as :class:`~pnmix_patch.cache.PNMixCache`,
preallocated for ``max_cache_len`` positions when the first chunk arrives:

- sinks and residual buffer as usual; packed groups for every token that can be
  flushed before ``max_cache_len`` is reached (``floor((L - N_s - 1) / N) * N / G``
  groups: the buffer always keeps the newest 1..N tokens); the ``fp16`` preset gets a
  residual of ``L - N_s`` slots instead and no groups;
- the stored channel order (``order``, int64 ``[B, H, D]``), computed once after
  the pairs are selected rather than at every step;
- per-sequence int32 lengths, an ``overflowed`` flag, the decode append's per-sequence
  counter (``arrivals``, zero between steps), and the position count ``cumulative_length``
  as device tensors.

Every tensor a decode step reads is marked as a static address for ``torch.compile`` and
is only ever written in place, so CUDA graphs replay on the same memory. In a
:class:`PNMixStaticCache` each field is one tensor stacked over the layers that run on
one device (a layer's tensors are views of its slot), and the decode step indexes it
inside the graph: a compiled call takes 18 cache tensors per device instead of 18 per
layer, each of which costs host time on every call (Dynamo's guards, the gathering of the
graph's inputs, the version count of a mutated input, the CUDA-graph tree's address
check).

Prefill (any chunk of more than one token, and the first chunk) runs the dynamic
cache's code, host synchronizations included: pair selection and the first packing
are outside the graph. A decode step (one token per sequence) is sync-free:
``pnmix::decode_append`` writes the token and flushes a full residual buffer on the
device, then ``pnmix::decode_attention`` reads the cache. Patched attention hands a decode
step's query and key over before the q/k norms and RoPE (:meth:`PNMixStaticLayer.attend_rotating`),
and ``pnmix::decode_rotate_append`` does those in the same kernel. No Python value changes
from step to step, so nothing recompiles as the sequence grows.

Decode tokens are taken as real tokens (``generate`` never feeds padding after the
prompt). A sequence that outgrows the storage during a compiled step cannot raise:
its attention output becomes NaN from then on (``overflowed``); eager steps raise
``ValueError`` past ``max_cache_len`` as the dynamic cache does.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .cache import _STATE, PNMixCache, PNMixLayer
from .config import PNMixConfig
from .kernels.decode_append import decode_append, decode_rotate_append
from .kernels.decode_attention import decode_attention
from .reference.attention import chunk_validity
from .reference.quantize import channel_order

_STATIC_STATE = (*_STATE, "order", "overflowed", "arrivals")
_DECODE_STATE = (
    "order",
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
    "overflowed",
    "arrivals",
    "cumulative_length",
)


class _LayerStack:
    """The storage of the layers of one static cache that run on one device: each field one
    tensor ``[layers, *shape]``, a layer's tensors views of its slot.

    The first member to allocate its own tensors (:meth:`PNMixStaticLayer.lazy_initialization`)
    allocates the stacks, so the peak is the stacks plus one layer's tensors; each member copies
    its tensors into its slot and keeps views of it. A member whose tensors differ in shape, dtype
    or device from the first one's keeps its own, with a warning (its slot stays allocated, unused).
    :meth:`release` frees the stacks and every member's tensors at once.

    The members hold the stack and the stack holds them weakly: no reference cycle, so a dropped
    cache's memory comes back at once, not when Python's cyclic garbage collector next runs."""

    def __init__(self, layers: list[PNMixStaticLayer]):
        self._layers = [weakref.ref(layer) for layer in layers]
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def layers(self) -> list[PNMixStaticLayer]:
        """The members still alive (all of them while their cache is)."""
        return [layer for layer in (ref() for ref in self._layers) if layer is not None]

    def adopt(self, layer: PNMixStaticLayer, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Copy ``own`` into ``layer``'s slot; returns the stacked tensors it went into, or None."""
        if not self.tensors:
            self.tensors = {name: t.new_zeros((len(self._layers), *t.shape)) for name, t in own.items()}
            if not torch.compiler.is_compiling():
                for tensor in self.tensors.values():
                    torch._dynamo.mark_static_address(tensor)
        stacks, slot = self.tensors, layer.stack_index
        for name, tensor in own.items():
            held = stacks.get(name)
            if held is None or (held.shape[1:], held.dtype, held.device) != (tensor.shape, tensor.dtype, tensor.device):
                stacked = "none" if held is None else f"{tuple(held.shape[1:])} {held.dtype} on {held.device}"
                warnings.warn(
                    f"static PN-Mix cache: a layer's {name} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                    f"its stack's {stacked}: the layer keeps tensors of its own (its slot stays allocated, unused, "
                    "and memory_report does not count it)",
                    stacklevel=2,
                )
                return None
        for name, tensor in own.items():
            stacks[name][slot].copy_(tensor)
        return stacks

    def release(self) -> None:
        """Drop the stacks and every member's tensors (an emptied cache meets a new batch size: every
        layer allocates again, and the cache no longer holds the old storage meanwhile)."""
        if any(layer.is_initialized and layer.seen_tokens for layer in self.layers):
            raise ValueError("a static PN-Mix cache can change its batch size only when every layer is empty (cache.reset())")
        self.tensors = {}
        for layer in self.layers:
            layer.release_storage()


class PNMixStaticLayer(PNMixLayer):
    """One decoder layer's static PN-Mix cache (see the module docstring)."""

    is_compileable = True

    def __init__(self, pnmix_config: PNMixConfig, pairing: str = "half", max_cache_len: int | None = None):
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"a static PN-Mix cache needs max_cache_len, a positive int; got {max_cache_len!r}")
        if pnmix_config.reselection != "prefill":
            raise ValueError(
                f"a static PN-Mix cache selects once per sequence (reselection='prefill'); got "
                f"reselection={pnmix_config.reselection!r}: use the dynamic PNMixCache for per-group re-selection"
            )
        if pnmix_config.key_format != "channel":
            raise ValueError(
                f"a static PN-Mix cache holds the per-channel key layout its fused decode step reads; got "
                f"key_format={pnmix_config.key_format!r} (allowed 'channel'): use the dynamic PNMixCache for the "
                "polar and channel-class formats"
            )
        self.cumulative_length = torch.zeros((), dtype=torch.int64)
        super().__init__(pnmix_config, pairing, max_cache_len)
        self.prefilled = False  # a one-token chunk is a decode step only after a prefill
        self.stack: _LayerStack | None = None  # set by PNMixStaticCache, with the layer's slot in it
        self.stack_index = 0
        self._stacks: dict[str, torch.Tensor] | None = None  # the stacked tensors holding this layer's (_LayerStack.adopt)
        self._storage: dict[str, torch.Tensor] = {}  # the layer's state tensors (_STATIC_STATE), once allocated
        # The decode step reads this bool, not self.pnmix_config: every layer holds the same config, and
        # Dynamo checks such a shared object on every call with one Python "is" test per layer.
        self.midpoint_correction = pnmix_config.midpoint_correction

    @property
    def stacked(self) -> bool:
        """Whether this layer's tensors are views of its slot in the stacked storage."""
        return self._stacks is not None

    @property
    def seen_tokens(self) -> int:
        """Positions consumed (a host read of ``cumulative_length``: eager code only)."""
        return int(self.cumulative_length)

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        self.cumulative_length.fill_(value)

    # ----------------------------------------------------------------- set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate every tensor for ``max_cache_len`` positions at once (the dynamic layer's, with room
        for all its groups, plus the decode kernels' order, overflow and arrival tensors), joined to the
        layer stack if the cache shares one, with addresses a compiled graph can keep."""
        super().lazy_initialization(key_states, value_states)
        pnmix_config = self.pnmix_config
        after_sinks = max(0, self.max_cache_len - pnmix_config.sink_tokens)
        if pnmix_config.quantize:
            flushes = max(0, after_sinks - 1) // pnmix_config.residual_tokens
            self._reserve_groups(flushes * pnmix_config.residual_tokens // pnmix_config.key_group_size)
        else:
            shape = (self.batch_size, self.num_heads, after_sinks, self.head_dim)
            self.residual_keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.residual_values = torch.zeros_like(self.residual_keys)
        self.order = channel_order(self.channel_mask)
        self.overflowed = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        self.arrivals = torch.zeros(self.batch_size, dtype=torch.int32, device=self.device)  # decode_append's counter
        self.cumulative_length = self.cumulative_length.to(self.device)
        own = {name: getattr(self, name) for name in (*_STATIC_STATE, "cumulative_length")}
        self._stacks = self.stack.adopt(self, own) if self.stack is not None else None
        if self.stacked:
            for name in own:
                setattr(self, name, self._stacks[name][self.stack_index])
        elif not torch.compiler.is_compiling():
            for tensor in own.values():
                torch._dynamo.mark_static_address(tensor)
        self._storage = {name: getattr(self, name) for name in _STATIC_STATE}

    def _reserve_groups(self, needed: int) -> None:
        if self._storage and needed > self.group_capacity:
            raise ValueError(
                f"a static PN-Mix cache holds {self.group_capacity} groups per sequence (max_cache_len="
                f"{self.max_cache_len}); {needed} were asked for: its storage cannot grow in place"
            )
        super()._reserve_groups(needed)

    def release_storage(self) -> None:
        """Drop every tensor of this layer (it allocates again with the next chunk); see :meth:`_LayerStack.release`."""
        for name in self._storage:
            delattr(self, name)
        self._storage, self._stacks = {}, None
        self.cumulative_length = torch.zeros((), dtype=torch.int64)
        self.is_initialized = False
        self.prefilled = False

    def _state(self, name: str) -> torch.Tensor:
        """One tensor a decode step reads: its slot of the stacked tensor, indexed here so that under
        ``torch.compile`` the graph's input is the stacked tensor (the layer's view would be a second
        input aliasing a mutated one), or the layer's own tensor."""
        return self._stacks[name][self.stack_index] if self.stacked else getattr(self, name)

    # ------------------------------------------------------------ transformers API
    def get_seq_length(self) -> torch.Tensor | int:
        """Positions consumed, as a device tensor (no host sync), or 0 before the first token."""
        return self._state("cumulative_length") if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """``(max_cache_len, 0)``: the mask spans the whole static length."""
        return self.max_cache_len, 0  # fixed, so the mask never changes shape

    def reset(self) -> None:
        """Empty the cache in place (same storage, same addresses: compiled graphs stay valid)."""
        if self.is_initialized:
            for tensor in self._storage.values():
                tensor.zero_()
        self.cumulative_length.zero_()
        self.prefilled = False
        self.all_selected = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices`` in place (as many as the batch: the storage keeps its shape).

        Raises:
            ValueError: ``indices`` does not hold one entry per sequence of the batch.
        """
        if self.is_initialized:
            indices = indices.to(self.device)
            if indices.shape[0] != self.batch_size:
                raise ValueError(f"a static PN-Mix cache keeps its batch size {self.batch_size}; got {indices.shape[0]} indices")
            for tensor in self._storage.values():
                tensor.copy_(tensor.index_select(0, indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Accepted only as a no-op (``repeats=1``): a static cache cannot change its batch size.

        Raises:
            ValueError: ``repeats`` is not 1 on an allocated cache.
        """
        if self.is_initialized and repeats != 1:
            raise ValueError(f"a static PN-Mix cache keeps its batch size {self.batch_size}; cannot repeat it {repeats} times")

    # ---------------------------------------------------------------- attend
    def chunk_validity(self, attention_mask: torch.Tensor | None, batch: int, chunk: int, device) -> torch.Tensor | None:
        """Which of a chunk's tokens are real, read from its columns of the static-length mask; None for a
        decode token (always real: no host read of the position)."""
        if self.prefilled and chunk == 1:
            return None  # a decode token is real; reading the mask would need the position on the host
        # The mask spans max_cache_len columns; the chunk's are at its positions.
        return chunk_validity(attention_mask, batch, chunk, device, start=self.seen_tokens)

    def attend(self, query, key, value, valid, scaling):
        """A decode step through the custom ops (append, then attention on the packed storage); a prompt
        chunk through the dynamic layer's code, whose results are copied back into the static storage
        (an emptied cache meeting a new batch size allocates again first)."""
        if self.decodes(key.shape[2]):
            self._check_room()
            return self._decode_step(query, key, value, scaling)
        if self.is_initialized and self.seen_tokens == 0 and key.shape[0] != self.batch_size:
            # An emptied cache meets a new batch size: allocate again (every layer sharing the storage).
            if self.stack is not None:
                self.stack.release()
            else:
                self.release_storage()
        output = super().attend(query, key, value, valid, scaling)
        # The dynamic code replaced some tensors (lengths, masks, residual): copy them back.
        for name, tensor in self._storage.items():
            current = getattr(self, name)
            if current is not tensor:
                tensor.copy_(current)
                setattr(self, name, tensor)
        self.order.copy_(channel_order(self.channel_mask))
        self.prefilled = True
        return output

    def decodes(self, chunk: int) -> bool:
        """Whether a chunk of ``chunk`` tokens per sequence is a decode step (see the module docstring)."""
        return self.prefilled and chunk == 1

    def attend_rotating(self, query, key, value, cos, sin, norms, scaling):
        """:meth:`attend` for a decode step (:meth:`decodes`) whose query and key ``[B, heads, 1, D]`` come
        before the q/k norms and RoPE (rotate_half pairing; ``cos``/``sin`` ``[B, 1, D]``): the append
        kernel norms and rotates them (``pnmix::decode_rotate_append``). ``norms``: ``(query weight, key
        weight, eps)``, or ``(None, None, 0.0)`` without norms."""
        self._check_room()
        return self._decode_step(query, key, value, scaling, rotation=(cos, sin, *norms))

    def _check_room(self) -> None:
        if not torch.compiler.is_compiling() and self.seen_tokens + 1 > self.max_cache_len:
            raise ValueError(
                f"the PN-Mix cache holds at most max_cache_len={self.max_cache_len} positions; "
                f"{self.seen_tokens} are cached and 1 more was given"
            )

    def _decode_step(self, query, key, value, scaling, rotation=None) -> torch.Tensor:
        s = {name: self._state(name) for name in _DECODE_STATE}
        packed = [
            s[name] for name in ("key_codes_high", "key_codes_low", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
        ]
        cache = (
            s["order"],
            s["sink_keys"],
            s["sink_values"],
            s["sink_len"],
            s["residual_keys"],
            s["residual_values"],
            s["residual_len"],
            *packed,
            s["num_groups"],
            s["overflowed"],
            s["arrivals"],
            self.midpoint_correction,
        )
        if rotation is None:
            decode_append(key[:, :, 0], value[:, :, 0], *cache)
            query = query[:, :, 0]
        else:
            query = decode_rotate_append(query[:, :, 0], key[:, :, 0], value[:, :, 0], *rotation, *cache)
        s["cumulative_length"].add_(1)
        output = decode_attention(
            query,
            s["order"],
            s["sink_keys"],
            s["sink_values"],
            s["sink_len"],
            *packed,
            s["num_groups"],
            s["residual_keys"],
            s["residual_values"],
            s["residual_len"],
            scaling,
            s["overflowed"],
        )
        return output.unsqueeze(2)

    def memory_bytes(self) -> dict[str, int]:
        """The dynamic layer's parts, plus the static layer's channel order (with the masks) and its
        overflow, arrival and length tensors (with the lengths)."""
        parts = super().memory_bytes()
        if self.is_initialized:

            def size(tensor):
                return tensor.numel() * tensor.element_size()

            parts["masks"] += size(self.order)
            parts["lengths"] += size(self.overflowed) + size(self.arrivals) + size(self.cumulative_length)
        return parts


class PNMixStaticCache(PNMixCache):
    """A :class:`~pnmix_patch.cache.PNMixCache` of :class:`PNMixStaticLayer` s: compileable.

    Args:
        config: the model's ``PretrainedConfig``.
        pnmix_config: a :class:`~pnmix_patch.PNMixConfig` or preset name.
        pairing: RoPE pairing of the architecture (``"half"`` or ``"interleaved"``).
        max_cache_len: positions to preallocate for (prompt plus generated tokens); required.
        layer_devices: the device each decoder layer runs on (:func:`~pnmix_patch.new_cache`
            reads them from the model): the layers of one device share one stacked storage
            (devices compare as given: ``"cuda"`` and ``"cuda:0"`` are two). Default: one
            storage for all layers, so every layer not on the device of the first layer to allocate
            keeps tensors of its own, with a warning.

    Raises:
        ValueError: no ``max_cache_len``; ``layer_devices`` not one device per layer.
    """

    layer_class = PNMixStaticLayer

    def __init__(
        self,
        config,
        pnmix_config: PNMixConfig | str = "pnmix-1",
        pairing: str = "half",
        max_cache_len: int | None = None,
        layer_devices=None,
    ):
        if max_cache_len is None:
            raise ValueError("a static PN-Mix cache needs max_cache_len (prompt plus generated tokens)")
        super().__init__(config, pnmix_config, pairing, max_cache_len)
        devices = [None] * len(self.layers) if layer_devices is None else [None if d is None else torch.device(d) for d in layer_devices]
        if len(devices) != len(self.layers):
            raise ValueError(f"layer_devices names {len(devices)} devices; the model has {len(self.layers)} layers")
        self.layer_devices = devices
        for device in dict.fromkeys(devices):
            members = [layer for layer, own in zip(self.layers, devices) if own == device]
            stack = _LayerStack(members)
            for slot, layer in enumerate(members):
                layer.stack, layer.stack_index = stack, slot
