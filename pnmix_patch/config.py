"""PN-Mix configuration: every knob of the method, validated on construction.

The presets (``docs/method.md``, "Presets"):

============  =====  ====  ===  ===  ===  ====  ====  =========
preset        r      G     b_H  b_L  b_V  N_s   N     key bits
============  =====  ====  ===  ===  ===  ====  ====  =========
``pnmix-1``   0.50   128   3    1    2    32    128   ~2.26
``pnmix-2``   0.40   64    3    1    2    32    128   ~2.31
``kivi-2``    1.00   128   2    -    2    32    128   2.25
``kitty``     0.25   128   4    2    2    32    128   ~2.76 (25% of *channels*, per group)
``fp16``      no quantization: the same cache and attention, nothing is flushed
============  =====  ====  ===  ===  ===  ====  ====  =========

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

    def __post_init__(self):
        def fail(field, value, allowed):
            raise ValueError(f"PNMixConfig.{field}={value!r} is invalid: allowed {allowed}")

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

    def value_group(self, head_dim: int) -> int:
        """Channels per value group for this head dim (the group size, clamped to the head dim)."""
        group = min(self.value_group_size, head_dim)
        if head_dim % group:
            raise ValueError(
                f"value_group_size={self.value_group_size} does not divide head_dim={head_dim}: "
                f"allowed a divisor of {head_dim} or a value >= {head_dim}"
            )
        return group

    def nominal_key_bits(self, head_dim: int) -> float:
        """Key bits per quantized element: codes plus a 16-bit scale and zero per channel per group
        (selection masks excluded)."""
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
    "fp16": PNMixConfig(quantize=False, name="fp16"),
}


def resolve_config(pnmix_config: PNMixConfig | str) -> PNMixConfig:
    """Turn a preset name or a :class:`PNMixConfig` into a config."""
    if isinstance(pnmix_config, PNMixConfig):
        return pnmix_config
    if isinstance(pnmix_config, str) and pnmix_config in PRESETS:
        return PRESETS[pnmix_config]
    raise ValueError(f"pnmix_config={pnmix_config!r} is not a PNMixConfig or a preset name: allowed presets {sorted(PRESETS)}")
