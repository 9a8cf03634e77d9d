"""PN-Mix configuration: every knob of the method, validated on construction.

The presets (``docs/method.md``, "Presets"):

============  =====  ====  ===  ===  ===  ====  ====  =========
preset        r      G     b_H  b_L  b_V  N_s   N     key bits
============  =====  ====  ===  ===  ===  ====  ====  =========
``pnmix-1``   0.50   128   3    1    2    32    128   ~2.25
``pnmix-2``   0.40   64    3    1    2    32    128   ~2.31
``kivi-2``    1.00   128   2    -    2    32    128   2.25
``kitty``     0.25   128   4    2    2    32    128   ~2.76 (25% of *channels*, per group)
``fp16``      no quantization: the same cache and attention, nothing is flushed
============  =====  ====  ===  ===  ===  ====  ====  =========

Two baselines store keys in another format (``key_format``, ``docs/method.md``, "Baselines
in other key formats"):

- ``polarquant`` / ``polarquant-3``: PolarQuant. Every RoPE pair of a key is stored as a
  radius and an angle, each quantized per pair over groups of ``G`` tokens, 4 + 4 bits
  (3 + 3 bits) per pair: 4.25 (3.25) key bits per element with the 16-bit scales and zeros.
- ``chanmix``: ChanMix. Every channel of a (sequence, layer, KV head) is classified once at
  prefill as retrieval (4 bits), outlier (3), normal (2) or subnormal (1 bit); 1/16, 1/8 and
  1/4 of the channels are retrieval, outlier and subnormal, so the codes average exactly 2
  bits (2.25 with scales and zeros).

Their packed layouts are not the one the fused decode kernels read: their decode steps run the
PyTorch reference attention on every device (:attr:`PNMixConfig.fused_decode`).

``kivi-2`` is expressed as "every pair is selected, selected pairs get 2 bits",
so uniform and mixed precision share one storage layout and one code path.
The number of selected pairs per head is ``round(r * head_dim / 2)`` (13 of 32
pairs at r=0.4).

Two fields exist for the paper's baselines and ablations (``docs/method.md``, "Selection
criteria and ablations"), not for PN-Mix itself:

- ``reselection="per_group"``: every flushed group of ``G`` tokens chooses its own
  high-precision set from its own keys (and, for ``qk_pair_norm``, the running mean
  of the query pair norms of every real token seen so far), and stores it as a
  per-group bit mask. PN-Mix selects once per sequence at prefill (``"prefill"``).
- ``selection_unit="channel"``: single channels are ranked and boosted instead of
  RoPE pairs (Kitty ranks channels by magnitude); ``pair_ratio`` is then the
  fraction of channels, ``round(r * head_dim)``. Only the channel criteria
  (``k_magnitude``, ``k_range``) rank channels, and only per group.

``kitty`` is the Kitty baseline: 2-bit keys with the top 25% of key channels by
mean magnitude boosted to 4 bits, re-chosen per 128-token group; values, sinks and
residual as PN-Mix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SELECTION_CRITERIA = ("qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range")
"""Pair-selection criteria: the paper's query-key pair norm and three key-only baselines."""

SELECTION_UNITS = ("pair", "channel")
"""What is ranked and boosted: RoPE pairs (both channels together) or single channels."""

RESELECTION_MODES = ("prefill", "per_group")
"""When the high-precision set is chosen: once per sequence at prefill, or for every flushed group."""

CHANNEL_CRITERIA = ("k_magnitude", "k_range")
"""Criteria that score single channels (the others score pairs)."""

SUPPORTED_BITS = (1, 2, 3, 4, 8)
"""Bit widths the packed storage supports (bit planes, so any width packs exactly)."""

KEY_FORMATS = ("channel", "polar", "channel_classes")
"""How keys are stored: per-channel min-max codes at two widths (PN-Mix, KIVI, Kitty), a quantized
radius and angle per RoPE pair (PolarQuant), or per-channel codes at four widths by channel class
(ChanMix)."""

CHANNEL_CLASSES = ("retrieval", "outlier", "normal", "subnormal")
"""ChanMix's channel classes, in the order of ``class_bits`` and of their stored channels."""


@dataclass(frozen=True)
class PNMixConfig:
    """Parameters of PN-Mix key/value cache quantization.

    Args:
        pair_ratio: fraction ``r`` of RoPE pairs per (sequence, layer, KV head) that get
            ``key_bits_high``; the others get ``key_bits_low``. In [0, 1]. With
            ``selection_unit="channel"``, the fraction of channels.
        key_group_size: ``G``, tokens per key quantization group (per channel). Multiple of 32.
        key_bits_high: ``b_H``, bits of the selected pairs' channels.
        key_bits_low: ``b_L``, bits of the other channels.
        value_bits: ``b_V``, bits of values (per token).
        value_group_size: channels per value quantization group; clamped to the head dim.
        sink_tokens: ``N_s``, first tokens of each sequence kept in full precision.
        residual_tokens: ``N``, most recent tokens kept in full precision; the buffer is
            quantized when full. Multiple of ``key_group_size``.
        midpoint_correction: move 1-bit reconstruction levels from {min, max} to the bin
            midpoints ``min + 0.25 * range`` and ``min + 0.75 * range``.
        selection: pair-selection criterion, one of :data:`SELECTION_CRITERIA`.
        quantize: ``False`` keeps every token in full precision (the ``fp16`` preset).
        name: label used in reports.
        reselection: ``"prefill"`` (PN-Mix: one selection per sequence) or ``"per_group"``
            (every flushed key group selects again; baselines and ablation), one of
            :data:`RESELECTION_MODES`.
        selection_unit: ``"pair"`` or ``"channel"`` (:data:`SELECTION_UNITS`); ``"channel"``
            needs a channel criterion (:data:`CHANNEL_CRITERIA`) and ``reselection="per_group"``.
        key_format: how keys are stored, one of :data:`KEY_FORMATS`. ``"channel"`` (default) uses
            ``pair_ratio``, ``key_bits_high``, ``key_bits_low``, ``selection``, ``reselection`` and
            ``selection_unit``; ``"polar"`` uses ``radius_bits`` and ``angle_bits`` instead, and
            ``"channel_classes"`` uses ``class_bits`` and ``class_fractions`` (both need
            ``reselection="prefill"`` and ``selection_unit="pair"``, the defaults, and ignore the
            other selection fields).
        radius_bits: ``key_format="polar"``: bits of a pair's quantized radius.
        angle_bits: ``key_format="polar"``: bits of a pair's quantized angle.
        class_bits: ``key_format="channel_classes"``: bits of the retrieval, outlier, normal and
            subnormal channels (:data:`CHANNEL_CLASSES`), non-increasing.
        class_fractions: ``key_format="channel_classes"``: fractions of the channels that are
            retrieval, outlier and subnormal (``round(f * head_dim)`` each); the rest are normal.
    """

    pair_ratio: float = 0.5
    key_group_size: int = 128
    key_bits_high: int = 3
    key_bits_low: int = 1
    value_bits: int = 2
    value_group_size: int = 128
    sink_tokens: int = 32
    residual_tokens: int = 128
    midpoint_correction: bool = True
    selection: str = "qk_pair_norm"
    quantize: bool = True
    name: str = "custom"
    reselection: str = "prefill"
    selection_unit: str = "pair"
    key_format: str = "channel"
    radius_bits: int = 4
    angle_bits: int = 4
    class_bits: tuple[int, int, int, int] = (4, 3, 2, 1)
    class_fractions: tuple[float, float, float] = (0.0625, 0.125, 0.25)

    def __post_init__(self):
        def fail(field, value, allowed):
            raise ValueError(f"PNMixConfig.{field}={value!r} is invalid: allowed {allowed}")

        # Sequences read back from JSON (a saved cache's header) are lists: keep tuples, so configs stay hashable.
        for field in ("class_bits", "class_fractions"):
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))

        if not isinstance(self.pair_ratio, (int, float)) or not 0.0 <= self.pair_ratio <= 1.0:
            fail("pair_ratio", self.pair_ratio, "a number in [0, 1]")
        for field in ("key_bits_high", "key_bits_low", "value_bits"):
            value = getattr(self, field)
            if not _positive_int(value) or value not in SUPPORTED_BITS:
                fail(field, value, f"one of {SUPPORTED_BITS}")
        if self.key_bits_low > self.key_bits_high:
            fail("key_bits_low", self.key_bits_low, f"at most key_bits_high={self.key_bits_high} (the selected pairs get the higher width)")
        if not _positive_int(self.key_group_size) or self.key_group_size % 32:
            fail("key_group_size", self.key_group_size, "a positive multiple of 32 (bits pack into 32-bit words)")
        if not _positive_int(self.value_group_size):
            fail("value_group_size", self.value_group_size, "a positive integer")
        if not _positive_int(self.sink_tokens, allow_zero=True):
            fail("sink_tokens", self.sink_tokens, "an integer >= 0")
        if not _positive_int(self.residual_tokens) or self.residual_tokens % self.key_group_size:
            fail(
                "residual_tokens",
                self.residual_tokens,
                f"a positive multiple of key_group_size={self.key_group_size} (a full buffer flushes whole groups)",
            )
        if not isinstance(self.midpoint_correction, bool):
            fail("midpoint_correction", self.midpoint_correction, "True or False")
        if self.selection not in SELECTION_CRITERIA:
            fail("selection", self.selection, f"one of {SELECTION_CRITERIA}")
        if not isinstance(self.quantize, bool):
            fail("quantize", self.quantize, "True or False")
        if self.reselection not in RESELECTION_MODES:
            fail("reselection", self.reselection, f"one of {RESELECTION_MODES}")
        if self.selection_unit not in SELECTION_UNITS:
            fail("selection_unit", self.selection_unit, f"one of {SELECTION_UNITS}")
        if self.selection_unit == "channel" and self.selection not in CHANNEL_CRITERIA:
            fail("selection", self.selection, f"a channel criterion {CHANNEL_CRITERIA} with selection_unit='channel'")
        if self.selection_unit == "channel" and self.reselection != "per_group":
            fail("reselection", self.reselection, "'per_group' with selection_unit='channel'")
        self._check_key_format(fail)

    def _check_key_format(self, fail) -> None:
        """Validate ``key_format`` and the fields of the polar and channel-class formats."""
        if self.key_format not in KEY_FORMATS:
            fail("key_format", self.key_format, f"one of {KEY_FORMATS}")
        for field in ("radius_bits", "angle_bits"):
            value = getattr(self, field)
            if not _positive_int(value) or value not in SUPPORTED_BITS:
                fail(field, value, f"one of {SUPPORTED_BITS}")
        bits = self.class_bits
        if not (isinstance(bits, tuple) and len(bits) == 4 and all(_positive_int(b) and b in SUPPORTED_BITS for b in bits)):
            fail("class_bits", bits, f"4 widths (retrieval, outlier, normal, subnormal), each one of {SUPPORTED_BITS}")
        if any(later > earlier for earlier, later in zip(bits, bits[1:])):
            fail("class_bits", bits, "non-increasing widths (retrieval >= outlier >= normal >= subnormal)")
        fractions = self.class_fractions
        if not (
            isinstance(fractions, tuple)
            and len(fractions) == 3
            and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f <= 1.0 for f in fractions)
            and sum(fractions) <= 1.0
        ):
            fail("class_fractions", fractions, "3 fractions in [0, 1] (retrieval, outlier, subnormal) summing to at most 1")
        if self.key_format != "channel":
            if self.reselection != "prefill":
                fail("reselection", self.reselection, f"'prefill' with key_format={self.key_format!r} (its layout is fixed per sequence)")
            if self.selection_unit != "pair":
                fail("selection_unit", self.selection_unit, f"'pair' with key_format={self.key_format!r} (it selects no pairs)")

    @property
    def fused_decode(self) -> bool:
        """Whether a decode step reads the packed cache through the fused decode op (the Triton and
        Gluon kernels on CUDA): only the per-channel layout selected once at prefill. Every other
        configuration (per-group re-selection, the polar and channel-class formats) attends through
        the PyTorch reference (``reference.attention.cache_attention``) on every device."""
        return self.quantize and self.reselection == "prefill" and self.key_format == "channel"

    def class_counts(self, head_dim: int) -> tuple[int, int, int, int]:
        """Channels per head of each class of ``key_format="channel_classes"`` (retrieval, outlier,
        normal, subnormal): ``round(f * head_dim)`` for the three fractions, the rest normal."""
        retrieval, outlier, subnormal = (int(round(f * head_dim)) for f in self.class_fractions)
        normal = head_dim - retrieval - outlier - subnormal
        if normal < 0:
            raise ValueError(
                f"class_fractions={self.class_fractions!r} leave no channels at head_dim={head_dim} "
                f"(counts {retrieval}, {outlier}, {subnormal}): allowed fractions whose rounded counts sum to at most {head_dim}"
            )
        return retrieval, outlier, normal, subnormal

    def replace(self, **changes) -> PNMixConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_selected_pairs(self, head_dim: int) -> int:
        """Pairs per head that get ``key_bits_high``: ``round(r * head_dim / 2)``."""
        return int(round(self.pair_ratio * head_dim / 2))

    def num_high_channels(self, head_dim: int) -> int:
        """Channels per head stored at ``key_bits_high``: both channels of every selected pair,
        or ``round(r * head_dim)`` single channels with ``selection_unit="channel"``."""
        if self.selection_unit == "channel":
            return int(round(self.pair_ratio * head_dim))
        return 2 * self.num_selected_pairs(head_dim)

    def selected_channels(self, head_dim: int) -> int:
        """Channels per head whose codes have the high planes: :meth:`num_high_channels`, or every
        channel for a config that does not quantize (its keys are all kept at full precision)."""
        return self.num_high_channels(head_dim) if self.quantize else head_dim

    def key_code_widths(self, head_dim: int) -> list[tuple[int, int]]:
        """``(planes, channels)`` of each packed key code tensor of :attr:`key_format` at ``head_dim``, in
        the cache's order (``pnmix_patch.cache.KEY_CODE_FIELDS``): per-channel codes as the selected
        channels' planes above the low ones and every channel's low planes (a config that does not
        quantize: all channels "selected"), polar codes as radii and angles, ChanMix codes by class.
        Each tensor holds ``[groups, planes, key_group_size / 32, channels]`` int32 words per head."""
        if self.key_format == "polar":
            return [(self.radius_bits, head_dim // 2), (self.angle_bits, head_dim // 2)]
        if self.key_format == "channel_classes":
            return list(zip(self.class_bits, self.class_counts(head_dim)))
        return [(self.key_bits_high - self.key_bits_low, self.selected_channels(head_dim)), (self.key_bits_low, head_dim)]

    def value_group(self, head_dim: int) -> int:
        """Channels per value group for this head dim: the group size clamped to the head dim, or the
        head dim for a config that does not quantize (one scale and zero per token, never used).

        Raises:
            ValueError: the group size neither divides the head dim nor is at least the head dim.
        """
        if not self.quantize:
            return head_dim
        group = min(self.value_group_size, head_dim)
        if head_dim % group:
            raise ValueError(
                f"value_group_size={self.value_group_size} does not divide head_dim={head_dim}: "
                f"allowed a divisor of {head_dim} or a value >= {head_dim}"
            )
        return group

    def nominal_key_bits(self, head_dim: int) -> float:
        """Key bits per quantized element: codes plus a 16-bit scale and zero per channel per group
        (selection masks excluded). The polar format has a scale and zero for the radius and for the
        angle of every pair, the same ``32 / G`` bits per element."""
        if self.key_format == "polar":
            return (self.radius_bits + self.angle_bits) / 2 + 32 / self.key_group_size
        if self.key_format == "channel_classes":
            counts = self.class_counts(head_dim)
            return sum(c * b for c, b in zip(counts, self.class_bits)) / head_dim + 32 / self.key_group_size
        high_channels = self.num_high_channels(head_dim)
        code_bits = (high_channels * self.key_bits_high + (head_dim - high_channels) * self.key_bits_low) / head_dim
        return code_bits + 32 / self.key_group_size


def _positive_int(value, allow_zero=False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)


PRESETS: dict[str, PNMixConfig] = {
    "pnmix-1": PNMixConfig(name="pnmix-1"),
    "pnmix-2": PNMixConfig(pair_ratio=0.4, key_group_size=64, name="pnmix-2"),
    "kivi-2": PNMixConfig(pair_ratio=1.0, key_bits_high=2, key_bits_low=2, name="kivi-2"),
    "kitty": PNMixConfig(
        pair_ratio=0.25,
        key_bits_high=4,
        key_bits_low=2,
        selection="k_magnitude",
        selection_unit="channel",
        reselection="per_group",
        name="kitty",
    ),
    "polarquant": PNMixConfig(key_format="polar", radius_bits=4, angle_bits=4, name="polarquant"),
    "polarquant-3": PNMixConfig(key_format="polar", radius_bits=3, angle_bits=3, name="polarquant-3"),
    "chanmix": PNMixConfig(key_format="channel_classes", midpoint_correction=False, name="chanmix"),
    "fp16": PNMixConfig(quantize=False, name="fp16"),
}
"""The named configs that ``patch_model``, ``new_cache``, ``pnmix eval`` and the lm-eval model take by name."""


def resolve_config(pnmix_config: PNMixConfig | str) -> PNMixConfig:
    """Turn a preset name or a :class:`PNMixConfig` into a config."""
    if isinstance(pnmix_config, PNMixConfig):
        return pnmix_config
    if isinstance(pnmix_config, str) and pnmix_config in PRESETS:
        return PRESETS[pnmix_config]
    raise ValueError(f"pnmix_config={pnmix_config!r} is not a PNMixConfig or a preset name: allowed presets {sorted(PRESETS)}")
