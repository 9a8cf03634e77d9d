"""PNMixConfig: presets, validation messages, selected-pair counts and nominal key bits."""

import math

import pytest

from pnmix_patch.config import (
    CHANNEL_CRITERIA,
    PRESETS,
    RESELECTION_MODES,
    SELECTION_CRITERIA,
    SELECTION_UNITS,
    SUPPORTED_BITS,
    PNMixConfig,
    resolve_config,
)

# ---------------------------------------------------------------- presets (spec section 3)

SPEC_PRESETS = {
    "pnmix-1": dict(
        pair_ratio=0.5,
        key_group_size=128,
        key_bits_high=3,
        key_bits_low=1,
        value_bits=2,
        sink_tokens=32,
        residual_tokens=128,
        midpoint_correction=True,
        selection="qk_pair_norm",
        quantize=True,
    ),
    "pnmix-2": dict(
        pair_ratio=0.4,
        key_group_size=64,
        key_bits_high=3,
        key_bits_low=1,
        value_bits=2,
        sink_tokens=32,
        residual_tokens=128,
        midpoint_correction=True,
        selection="qk_pair_norm",
        quantize=True,
    ),
    # KIVI: uniform 2-bit keys (per channel, G=128) and values, FP16 residual.
    "kivi-2": dict(
        pair_ratio=1.0,
        key_group_size=128,
        key_bits_high=2,
        key_bits_low=2,
        value_bits=2,
        sink_tokens=32,
        residual_tokens=128,
        quantize=True,
    ),
    "fp16": dict(quantize=False),
    # Kitty: 2-bit keys, top 25% of channels by magnitude at 4 bits, re-chosen per 128-token group.
    "kitty": dict(
        pair_ratio=0.25,
        key_group_size=128,
        key_bits_high=4,
        key_bits_low=2,
        value_bits=2,
        sink_tokens=32,
        residual_tokens=128,
        selection="k_magnitude",
        selection_unit="channel",
        reselection="per_group",
        quantize=True,
    ),
}


@pytest.mark.parametrize("name", sorted(SPEC_PRESETS))
def test_preset_parameters_follow_spec(name):
    preset = PRESETS[name]
    for field, expected in SPEC_PRESETS[name].items():
        assert getattr(preset, field) == expected, f"{name}.{field}"
    assert preset.name == name
    assert resolve_config(name) is preset


def test_value_group_of_presets_is_128_channels_clamped_to_head_dim():
    assert PRESETS["pnmix-1"].value_group(128) == 128
    assert PRESETS["pnmix-1"].value_group(64) == 64


def test_resolve_config_passes_a_config_through():
    cfg = PNMixConfig(pair_ratio=0.25, name="mine")
    assert resolve_config(cfg) is cfg


@pytest.mark.parametrize("bad", ["pnmix-3", "PNMIX-1", "", None, 3])
def test_resolve_config_unknown_preset(bad):
    with pytest.raises(ValueError) as info:
        resolve_config(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in PRESETS:
        assert name in message, f"allowed preset {name} not named in: {message}"


# ---------------------------------------------------------------- validation

INVALID = [
    # (field, bad value, other fields, fragments of the "allowed" part of the message)
    ("pair_ratio", -0.1, {}, ["[0, 1]"]),
    ("pair_ratio", 1.5, {}, ["[0, 1]"]),
    ("pair_ratio", math.nan, {}, ["[0, 1]"]),
    ("pair_ratio", "0.5", {}, ["[0, 1]"]),
    ("pair_ratio", None, {}, ["[0, 1]"]),
    ("key_bits_high", 0, {}, [str(SUPPORTED_BITS)]),
    ("key_bits_high", 5, {}, [str(SUPPORTED_BITS)]),
    ("key_bits_high", 16, {}, [str(SUPPORTED_BITS)]),
    ("key_bits_high", True, {}, [str(SUPPORTED_BITS)]),
    ("key_bits_low", 6, {}, [str(SUPPORTED_BITS)]),
    ("key_bits_low", -1, {}, [str(SUPPORTED_BITS)]),
    ("value_bits", 7, {}, [str(SUPPORTED_BITS)]),
    ("value_bits", "2", {}, [str(SUPPORTED_BITS)]),
    ("key_group_size", 0, {}, ["multiple of 32"]),
    ("key_group_size", 48, {"residual_tokens": 96}, ["multiple of 32"]),
    ("key_group_size", 100, {}, ["multiple of 32"]),
    ("key_group_size", -128, {}, ["multiple of 32"]),
    ("key_group_size", 128.0, {}, ["multiple of 32"]),
    ("value_group_size", 0, {}, ["positive integer"]),
    ("value_group_size", -32, {}, ["positive integer"]),
    ("value_group_size", 64.5, {}, ["positive integer"]),
    ("sink_tokens", -1, {}, [">= 0"]),
    ("sink_tokens", 1.5, {}, [">= 0"]),
    ("residual_tokens", 0, {}, ["multiple of key_group_size=128"]),
    ("residual_tokens", 100, {}, ["multiple of key_group_size=128"]),
    ("residual_tokens", 64, {}, ["multiple of key_group_size=128"]),
    ("residual_tokens", 96, {"key_group_size": 64}, ["multiple of key_group_size=64"]),
    ("residual_tokens", -128, {}, ["multiple of key_group_size=128"]),
    ("midpoint_correction", 1, {}, ["True or False"]),
    ("midpoint_correction", "yes", {}, ["True or False"]),
    ("midpoint_correction", None, {}, ["True or False"]),
    ("selection", "qk", {}, list(SELECTION_CRITERIA)),
    ("selection", "random", {}, list(SELECTION_CRITERIA)),
    ("selection", "", {}, list(SELECTION_CRITERIA)),
    ("selection", None, {}, list(SELECTION_CRITERIA)),
    ("quantize", 0, {}, ["True or False"]),
    ("quantize", "no", {}, ["True or False"]),
    ("reselection", "online", {}, list(RESELECTION_MODES)),
    ("reselection", None, {}, list(RESELECTION_MODES)),
    ("selection_unit", "head", {}, list(SELECTION_UNITS)),
    # channel ranking: only channel criteria, only per group
    ("selection", "qk_pair_norm", {"selection_unit": "channel", "reselection": "per_group"}, list(CHANNEL_CRITERIA)),
    ("selection", "k_pair_norm", {"selection_unit": "channel", "reselection": "per_group"}, list(CHANNEL_CRITERIA)),
    ("reselection", "prefill", {"selection_unit": "channel", "selection": "k_magnitude"}, ["'per_group'"]),
]


@pytest.mark.parametrize("field, bad, others, allowed", INVALID, ids=[f"{f}={b!r}" for f, b, _, _ in INVALID])
def test_invalid_field_raises_with_clear_message(field, bad, others, allowed):
    with pytest.raises(ValueError) as info:
        PNMixConfig(**others, **{field: bad})
    message = str(info.value)
    assert field in message
    assert repr(bad) in message, f"bad value {bad!r} not named in: {message}"
    assert "allowed" in message
    for fragment in allowed:
        assert fragment in message, f"{fragment!r} not in: {message}"


@pytest.mark.parametrize("field", ["key_bits_high", "key_bits_low", "value_bits"])
@pytest.mark.parametrize("bad", [3.0, 2.5])
def test_bits_must_be_integers(field, bad):
    # 3.0 == 3 is "in" SUPPORTED_BITS, but a float bit width breaks the cache's integer
    # shapes later (torch.zeros(..., 3.0, ...) -> TypeError); it must be rejected up front.
    with pytest.raises(ValueError, match="allowed"):
        PNMixConfig(**{field: bad})


def test_replace_validates_again():
    cfg = PRESETS["pnmix-1"]
    assert cfg.replace(pair_ratio=0.25).pair_ratio == 0.25
    with pytest.raises(ValueError, match="pair_ratio"):
        cfg.replace(pair_ratio=2.0)


@pytest.mark.parametrize(
    "changes",
    [
        dict(pair_ratio=0.0),
        dict(pair_ratio=1.0),
        dict(pair_ratio=1),
        dict(key_group_size=32, residual_tokens=32),
        dict(key_group_size=64, residual_tokens=192),
        dict(sink_tokens=0),
        dict(key_bits_high=8, key_bits_low=4, value_bits=1),
        dict(selection="k_range", midpoint_correction=False),
        dict(reselection="per_group"),
        dict(reselection="per_group", selection="k_pair_norm"),
        dict(selection_unit="channel", reselection="per_group", selection="k_range"),
    ],
)
def test_valid_edge_values_accepted(changes):
    cfg = PNMixConfig(**changes)
    for field, value in changes.items():
        assert getattr(cfg, field) == value


def test_value_group_must_divide_head_dim():
    cfg = PNMixConfig(value_group_size=48)
    assert cfg.value_group(48) == 48
    with pytest.raises(ValueError) as info:
        cfg.value_group(64)
    assert "48" in str(info.value) and "64" in str(info.value) and "allowed" in str(info.value)


def test_value_group_is_the_head_dim_without_quantization():
    assert PNMixConfig(quantize=False, value_group_size=48).value_group(64) == 64


# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    "ratio, head_dim, expected",
    [(0.5, 64, 16), (0.4, 64, 13), (0.4, 128, 26), (0.5, 128, 32), (1.0, 64, 32), (0.0, 128, 0)],
)
def test_num_selected_pairs(ratio, head_dim, expected):
    assert PNMixConfig(pair_ratio=ratio).num_selected_pairs(head_dim) == expected


def test_num_selected_pairs_of_presets():
    assert PRESETS["pnmix-1"].num_selected_pairs(64) == 16
    assert PRESETS["pnmix-2"].num_selected_pairs(64) == 13
    assert PRESETS["pnmix-2"].num_selected_pairs(128) == 26
    assert PRESETS["kivi-2"].num_selected_pairs(128) == 64


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_nominal_key_bits_pnmix1_any_head_dim(head_dim):
    # 0.5 * 3 + 0.5 * 1 + 32 / 128
    assert PRESETS["pnmix-1"].nominal_key_bits(head_dim) == pytest.approx(2.25, abs=1e-12)


def test_nominal_key_bits_pnmix2_and_kivi2():
    # 26 channels at 3 bits, 38 at 1 bit, fp16 scale+zero per 64 tokens: 116/64 + 0.5
    assert PRESETS["pnmix-2"].nominal_key_bits(64) == pytest.approx(2.3125, abs=1e-12)
    # 52 of 128 channels at 3 bits: (156 + 76) / 128 + 0.5
    assert PRESETS["pnmix-2"].nominal_key_bits(128) == pytest.approx(232 / 128 + 0.5, abs=1e-12)
    assert PRESETS["kivi-2"].nominal_key_bits(128) == pytest.approx(2.25, abs=1e-12)


@pytest.mark.parametrize(
    "changes, head_dim, expected",
    [
        (dict(pair_ratio=0.25), 64, 16),  # 8 pairs, both channels
        (dict(pair_ratio=0.25, selection_unit="channel", reselection="per_group", selection="k_magnitude"), 64, 16),
        (dict(pair_ratio=1 / 3, selection_unit="channel", reselection="per_group", selection="k_magnitude"), 64, 21),
        (dict(pair_ratio=0.375, selection_unit="channel", reselection="per_group", selection="k_range"), 64, 24),
        (dict(pair_ratio=0.4), 64, 26),
    ],
)
def test_num_high_channels_pairs_or_single_channels(changes, head_dim, expected):
    assert PNMixConfig(**changes).num_high_channels(head_dim) == expected


@pytest.mark.parametrize("preset, head_dim, expected", [("pnmix-1", 128, 64), ("pnmix-2", 64, 26), ("kivi-2", 128, 128), ("fp16", 64, 64)])
def test_selected_channels_are_every_channel_without_quantization(preset, head_dim, expected):
    assert PRESETS[preset].selected_channels(head_dim) == expected


@pytest.mark.parametrize(
    "preset, head_dim, expected",
    [
        ("pnmix-1", 128, [(2, 64), (1, 128)]),  # 32 of 64 pairs: 64 channels with planes 1-2 above plane 0
        ("pnmix-2", 128, [(2, 52), (1, 128)]),  # 26 of 64 pairs
        ("pnmix-2", 64, [(2, 26), (1, 64)]),
        ("kivi-2", 128, [(0, 128), (2, 128)]),  # every channel at 2 bits: no planes above the low ones
        ("kitty", 64, [(2, 16), (2, 64)]),  # 16 single channels at 4 bits over 2
        ("fp16", 128, [(2, 128), (1, 128)]),  # nothing quantized: the tensors stay empty, every channel "selected"
        ("polarquant", 128, [(4, 64), (4, 64)]),  # radius and angle per pair
    ],
)
def test_key_code_widths(preset, head_dim, expected):
    assert PRESETS[preset].key_code_widths(head_dim) == expected


def test_key_code_widths_of_channel_classes_cover_every_channel():
    config = PRESETS["chanmix"]
    widths = config.key_code_widths(128)
    assert [planes for planes, _ in widths] == list(config.class_bits)
    assert sum(channels for _, channels in widths) == 128


def test_nominal_key_bits_kitty():
    # 16 of 64 channels at 4 bits, 48 at 2 bits, fp16 scale+zero per 128 tokens: 2.5 + 0.25
    assert PRESETS["kitty"].nominal_key_bits(64) == pytest.approx(2.75, abs=1e-12)
    assert PRESETS["kitty"].nominal_key_bits(128) == pytest.approx(2.75, abs=1e-12)


def test_low_key_bits_above_high_key_bits_are_refused():
    with pytest.raises(ValueError, match=r"key_bits_low=3 is invalid: allowed at most key_bits_high=1"):
        PNMixConfig(key_bits_low=3, key_bits_high=1)
