"""Per-group re-selection in the cache (``reselection="per_group"``): Kitty and the online ablation."""

import pytest
import torch
from conftest import assert_left_padded_batch_generates_alone, tiny_model

from pnmix_patch import PRESETS, PNMixLayer
from pnmix_patch.reference.quantize import dequantize_keys, quantize_keys
from pnmix_patch.reference.selection import group_channel_masks, pair_norms

HEADS, QUERY_HEADS, D, G, SINKS = 2, 4, 32, 128, 32
PER_GROUP_PNMIX = PRESETS["pnmix-1"].replace(reselection="per_group", name="pnmix-1-per-group")


def random_chunk(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    # channels of very different scales, changing along the sequence, so selections differ by group
    scales = torch.rand(HEADS, tokens // 64 + 1, D, generator=gen).mul(4).exp().repeat_interleave(64, 1)[:, :tokens]
    key = torch.randn(1, HEADS, tokens, D, generator=gen) * scales
    query = torch.randn(1, QUERY_HEADS, tokens, D, generator=gen)
    value = torch.randn(1, HEADS, tokens, D, generator=gen)
    return query, key, value


def expected_groups(key, masks, config):
    """Reference dequantized keys of the groups after the sinks, each with its own mask."""
    groups = masks.shape[2]
    grouped = key[:, :, SINKS : SINKS + groups * G]
    parts = [
        quantize_keys(
            grouped[:, :, g * G : (g + 1) * G],
            masks[:, :, g],
            int(masks[0, 0, g].sum()),
            G,
            config.key_bits_high,
            config.key_bits_low,
            config.midpoint_correction,
        )
        for g in range(groups)
    ]
    return dequantize_keys(*(torch.cat(tensors, 2) for tensors in zip(*parts)), masks)


@pytest.mark.parametrize("name", ["kitty", "pnmix-1-per-group"])
def test_every_group_selects_from_its_own_keys(name):
    config = PRESETS["kitty"] if name == "kitty" else PER_GROUP_PNMIX
    query, key, value = random_chunk(SINKS + 2 * G + 40, seed=1)
    layer = PNMixLayer(config)
    layer.attend(query, key, value, None, D**-0.5)
    assert int(layer.num_groups[0]) == 2 and int(layer.residual_len[0]) == 40

    grouped = key[:, :, SINKS : SINKS + 2 * G].reshape(1, HEADS, 2, G, D)
    query_mean = None
    if config.selection == "qk_pair_norm":  # the running mean of the prompt's query pair norms
        query_mean = pair_norms(query, "half").mean(2).view(1, HEADS, 2, D // 2).mean(2)
    masks = group_channel_masks(grouped, config.selection, config.selection_unit, "half", layer.num_high, query_mean)
    stored = layer.stored_channel_mask[:, :, :2]
    assert torch.equal(stored, masks)
    assert stored.sum(-1).eq(config.num_high_channels(D)).all()
    assert not torch.equal(stored[:, :, 0], stored[:, :, 1])  # the selection really changes between groups
    quantized, _ = layer.quantized_keys_values()
    torch.testing.assert_close(quantized[:, :, : 2 * G], expected_groups(key, masks, config), rtol=0, atol=1e-5)


def test_kitty_boosts_single_channels_not_pairs():
    query, key, value = random_chunk(SINKS + 2 * G + 8, seed=2)
    layer = PNMixLayer(PRESETS["kitty"])
    layer.attend(query, key, value, None, D**-0.5)
    mask = layer.stored_channel_mask[0, :, 0]
    assert mask.sum(-1).eq(8).all()  # 25% of 32 channels
    first, second = mask[:, : D // 2], mask[:, D // 2 :]
    assert not torch.equal(first, second)  # a pair-level selection would make these equal


def test_per_group_decode_steps_flush_and_select_again():
    query, key, value = random_chunk(SINKS + G + 1 + G, seed=3)
    layer = PNMixLayer(PRESETS["kitty"])
    prefill = SINKS + G + 1
    layer.attend(query[:, :, :prefill], key[:, :, :prefill], value[:, :, :prefill], None, D**-0.5)
    assert int(layer.num_groups[0]) == 1
    for position in range(prefill, key.shape[2]):
        step = slice(position, position + 1)
        output = layer.attend(query[:, :, step], key[:, :, step], value[:, :, step], None, D**-0.5)
        assert output.shape == (1, QUERY_HEADS, 1, D) and torch.isfinite(output).all()
    assert int(layer.num_groups[0]) == 2 and int(layer.residual_len[0]) == 1  # flushed by the last step
    masks = group_channel_masks(key[:, :, SINKS : SINKS + 2 * G].reshape(1, HEADS, 2, G, D), "k_magnitude", "channel", "half", 8)
    assert torch.equal(layer.stored_channel_mask[:, :, :2], masks)


def test_per_group_key_bits_include_the_group_masks():
    query, key, value = random_chunk(SINKS + 4 * G + 1, seed=4)
    for config, codes in ((PRESETS["kitty"], 2.5), (PER_GROUP_PNMIX, 2.0)):
        layer = PNMixLayer(config)
        layer.attend(query, key, value, None, D**-0.5)
        parts = layer.memory_bytes()
        assert parts["masks"] > 0
        key_bits = 8 * (parts["packed_keys"] + parts["key_scales_zeros"] + parts["masks"]) / parts["quantized_elements"]
        mask_bits = D if config.selection_unit == "channel" else D // 2
        assert key_bits >= codes + 32 / G + mask_bits / (G * D) - 1e-9
        assert key_bits < codes + 32 / G + 0.1


@pytest.mark.parametrize("name", ["kitty", "pnmix-1-per-group"])
def test_left_padded_batch_generates_like_each_sequence_alone(name):
    config = PRESETS["kitty"] if name == "kitty" else PER_GROUP_PNMIX
    assert_left_padded_batch_generates_alone(tiny_model("llama"), config)
