"""The packed PN-Mix cache: per-sequence regions, padding, flush boundaries, edge values, accounting."""

import math

import pytest
import torch
from conftest import output_cache, tiny_model

from pnmix_patch import PNMixCache, PNMixConfig, new_cache, patch_model
from pnmix_patch.cache import PNMixLayer

SMALL = PNMixConfig(sink_tokens=4, residual_tokens=64, key_group_size=32, name="small")


def make_layer(config=SMALL, batch=2, heads=2, head_dim=32):
    layer = PNMixLayer(config)
    return layer, (batch, heads, head_dim)


def chunk(batch, heads, length, head_dim, seed, query_heads=None):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_heads or 2 * heads, length, head_dim, generator=generator)
    key = torch.randn(batch, heads, length, head_dim, generator=generator)
    value = torch.randn(batch, heads, length, head_dim, generator=generator)
    return query, key, value


def feed(layer, shape, lengths, seed=0, valid=None):
    """Prefill ``lengths[0]`` tokens, then decode the rest one at a time; return all outputs."""
    batch, heads, head_dim = shape
    query, key, value = chunk(batch, heads, sum(lengths), head_dim, seed)
    outputs, start = [], 0
    for length in lengths:
        part = slice(start, start + length)
        part_valid = None if valid is None else valid[:, part]
        outputs.append(layer.attend(query[:, :, part], key[:, :, part], value[:, :, part], part_valid, 0.2))
        start += length
    return torch.cat(outputs, 2), (query, key, value)


@pytest.mark.parametrize("prompt", [1, 3, 4, 5, 4 + 64, 4 + 65, 4 + 128, 4 + 129, 200])
def test_regions_hold_every_real_token(prompt):
    layer, shape = make_layer()
    feed(layer, shape, [prompt] + [1] * 150)
    total = prompt + 150
    sinks = min(total, 4)
    assert torch.all(layer.sink_len == sinks)
    assert torch.all(layer.sink_len + layer.num_groups * 32 + layer.residual_len == total)
    rest = total - sinks
    # the residual holds the newest 1..N tokens; everything older is quantized
    assert torch.all(layer.residual_len == (rest - 1) % 64 + 1)


def test_decode_step_sees_quantized_past_and_exact_residual():
    """One step's output equals the reference softmax over [sinks | dequantized groups | residual]."""
    layer, shape = make_layer()
    outputs, (query, key, value) = feed(layer, shape, [100] + [1] * 60)
    keys, values = layer.quantized_keys_values()
    groups = int(layer.num_groups[0]) * 32
    residual = int(layer.residual_len[0])
    last_query = query[:, :, -1:]
    cached_keys = torch.cat([layer.sink_keys, keys[:, :, :groups], layer.residual_keys[:, :, :residual]], 2)
    cached_values = torch.cat([layer.sink_values, values[:, :, :groups], layer.residual_values[:, :, :residual]], 2)
    expected = torch.nn.functional.scaled_dot_product_attention(last_query, cached_keys, cached_values, scale=0.2, enable_gqa=True)
    # the residual already holds this step's own token, exactly
    assert torch.equal(layer.residual_keys[:, :, residual - 1], key[:, :, -1])
    torch.testing.assert_close(outputs[:, :, -1:], expected, rtol=1e-4, atol=1e-5)


def test_prefill_is_exact_attention():
    layer, shape = make_layer()
    outputs, (query, key, value) = feed(layer, shape, [150])
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(outputs, expected, rtol=1e-4, atol=1e-5)
    assert int(layer.num_groups[0]) == 4  # then 128 of the 146 tokens past the sinks were quantized (G=32)


def test_left_padding_is_never_stored_or_quantized():
    """A padded row holds exactly what the same sequence alone holds; padding values never reach min/max."""
    batch, heads, head_dim = 2, 2, 32
    lengths = (130, 97)
    query, key, value = chunk(batch, heads, 130, head_dim, seed=3)
    valid = torch.ones(batch, 130, dtype=torch.bool)
    valid[1, : 130 - lengths[1]] = False
    key[1, :, : 130 - lengths[1]] = 1e4  # huge padding would dominate any group that saw it
    value[1, :, : 130 - lengths[1]] = float("nan")
    together, _ = make_layer()
    out = together.attend(query, key, value, valid, 0.2)
    alone, _ = make_layer()
    pad = 130 - lengths[1]
    out_alone = alone.attend(query[1:, :, pad:], key[1:, :, pad:], value[1:, :, pad:], None, 0.2)
    torch.testing.assert_close(out[1:, :, pad:], out_alone, rtol=1e-5, atol=1e-6)
    assert torch.all(out[1:, :, :pad] == 0)  # padding queries attend nothing
    for name in ("sink_len", "num_groups", "residual_len"):
        assert getattr(together, name)[1] == getattr(alone, name)[0]
    groups = int(alone.num_groups[0])
    assert groups == 2
    for name in ("key_codes_high", "key_codes_low", "key_scale", "key_zero"):
        assert torch.equal(getattr(together, name)[1, :, :groups], getattr(alone, name)[0, :, :groups])
    assert torch.equal(together.pair_mask_bits[1], alone.pair_mask_bits[0])


def test_selection_is_per_sequence_and_fixed_after_prefill():
    layer, shape = make_layer()
    batch, heads, head_dim = shape
    query, key, value = chunk(batch, heads, 40, head_dim, seed=4)
    key[0, :, :, 0] *= 50  # sequence 0 has a dominant pair 0, sequence 1 does not
    key[0, :, :, 16] *= 50
    layer.attend(query, key, value, None, 0.2)
    selected = layer.selected_pairs
    assert selected.shape == (batch, heads, head_dim // 2)
    assert torch.all(selected[0, :, 0]) and not torch.equal(selected[0], selected[1])
    assert torch.all(selected.sum(-1) == SMALL.num_selected_pairs(head_dim))
    assert layer.all_selected
    feed(layer, shape, [1] * 100, seed=5)
    assert torch.equal(layer.selected_pairs, selected)


def test_pairs_are_scored_until_every_sequence_has_selected(monkeypatch):
    """A sequence with no real token yet selects from its first real chunk; after that no step scores."""
    import pnmix_patch.cache as cache_module

    layer, (batch, heads, head_dim) = make_layer()
    calls = []
    scoring = cache_module.pair_scores
    monkeypatch.setattr(cache_module, "pair_scores", lambda *args: calls.append(1) or scoring(*args))
    query, key, value = chunk(batch, heads, 6, head_dim, seed=6)
    valid = torch.tensor([[True] * 3, [False] * 3])  # sequence 1 is all padding so far
    layer.attend(query[:, :, :3], key[:, :, :3], value[:, :, :3], valid, 0.2)
    assert layer.selected.tolist() == [True, False] and not layer.all_selected
    first = layer.selected_pairs[0].clone()
    layer.attend(query[:, :, 3:4], key[:, :, 3:4], value[:, :, 3:4], None, 0.2)
    assert layer.all_selected and len(calls) == 2
    assert torch.equal(layer.selected_pairs[0], first)  # kept, not re-scored from the new token
    for step in range(4, 6):
        layer.attend(query[:, :, step : step + 1], key[:, :, step : step + 1], value[:, :, step : step + 1], None, 0.2)
    assert len(calls) == 2


def test_constant_channels_read_back_exactly():
    layer, shape = make_layer(batch=1)
    batch, heads, head_dim = shape
    query, key, value = chunk(batch, heads, 200, head_dim, seed=6)
    key[..., 5] = 0.75
    value[..., 7] = -2.0
    layer.attend(query, key, value, None, 0.2)
    keys, values = layer.quantized_keys_values()
    quantized = int(layer.num_groups[0]) * 32
    assert torch.all(keys[..., :quantized, 5] == 0.75)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def test_non_finite_key_poisons_its_group_not_silently():
    layer, shape = make_layer(batch=1)
    batch, heads, head_dim = shape
    query, key, value = chunk(batch, heads, 200, head_dim, seed=7)
    key[0, 0, 10, 3] = float("inf")  # token 10 lands in the first quantized group (after 4 sinks)
    layer.attend(query, key, value, None, 0.2)
    keys, _ = layer.quantized_keys_values()
    assert torch.isnan(keys[0, 0, :32, 3]).all()  # that channel's group reads back NaN
    assert torch.isfinite(keys[0, 0, 32:]).all() and torch.isfinite(keys[0, 1]).all()
    out = layer.attend(query[:, :, -1:], key[:, :, -1:], value[:, :, -1:], None, 0.2)
    assert torch.isnan(out[0, :2]).all()  # query heads of KV head 0 see the NaN, like FP16 attention
    assert torch.isfinite(out[0, 2:]).all()


def test_exceeding_max_cache_len_is_a_clear_error():
    layer = PNMixLayer(SMALL, max_cache_len=50)
    query, key, value = chunk(1, 2, 50, 32, seed=8)
    layer.attend(query, key, value, None, 0.2)
    with pytest.raises(ValueError, match="max_cache_len=50"):
        layer.attend(query[:, :, :1], key[:, :, :1], value[:, :, :1], None, 0.2)


def test_the_default_cache_grows_past_max_position_embeddings_like_the_unpatched_model():
    """``generate`` past ``max_position_embeddings`` carries on as the unpatched model does: the default
    dynamic cache has no length limit. The ``fp16`` preset (same cache and attention, nothing quantized)
    gives the unpatched model's greedy tokens."""
    model = tiny_model("llama", max_position_embeddings=64)
    ids = torch.randint(3, 96, (1, 60))
    settings = dict(max_new_tokens=200, min_new_tokens=200, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **settings)
    patch_model(model, "fp16")
    assert torch.equal(model.generate(ids, **settings), expected)
    patch_model(model, "pnmix-1")  # quantized: groups keep being flushed past the 64 positions
    output = model.generate(ids, **settings, return_dict_in_generate=True)
    assert output.sequences.shape[1] == 260
    assert output_cache(output).layers[0].num_groups.max() >= 1


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("pnmix-1", 2.25, 2.27), ("pnmix-2", 2.29, 2.31), ("kivi-2", 2.25, 2.25)],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_memory_report_bits_per_element(preset, low, high, head_dim):
    model = tiny_model("llama", head_dim=head_dim, num_hidden_layers=1)
    patch_model(model, preset)
    cache = new_cache(model)
    with torch.no_grad():
        model(torch.randint(3, 96, (2, 32 + 128 * 8 + 5)), cache=cache)
    report = cache.memory_report()
    # pnmix-2 keeps 13 of 32 pairs (40.6%): 2.3125 bits + mask, i.e. 2.31 to two decimals as in the spec
    assert low <= round(report["key_bits_per_element"], 2) <= high
    layer = cache.layers[0]
    codes = layer.key_codes_high.numel() + layer.key_codes_low.numel()
    elements = 2 * 2 * layer.group_capacity * layer.pnmix_config.key_group_size * head_dim
    # the packed key codes take exactly the nominal code bits: nothing dequantized is held
    assert codes * 32 == pytest.approx(elements * (layer.pnmix_config.nominal_key_bits(head_dim) - 32 / layer.pnmix_config.key_group_size))
    value_bits = 2 + 32 / min(128, head_dim)
    assert report["value_bits_per_element"] == pytest.approx(value_bits)
    parts = ("sinks", "residual", "packed_keys", "packed_values", "key_scales_zeros", "value_scales_zeros", "masks", "lengths")
    assert report["total_bytes"] == sum(report[p] for p in parts)
    assert report["sinks"] == 2 * 2 * 2 * 32 * head_dim * 4  # k and v, batch 2, 2 heads, 32 sinks, float32


def test_fp16_preset_reports_no_quantized_region():
    model = tiny_model("llama", num_hidden_layers=1)
    patch_model(model, "fp16")
    cache = new_cache(model)
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 300)), cache=cache)
    report = cache.memory_report()
    assert report["packed_keys"] == 0 and math.isnan(report["key_bits_per_element"])
    assert cache.layers[0].residual_len.item() == 300 - 32


def test_cache_refuses_unpatched_update():
    cache = PNMixCache(tiny_model("llama").config)
    with pytest.raises(NotImplementedError, match="patch_model"):
        cache.update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), 0)


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="torch.int64"):
        PNMixLayer(SMALL).attend(*(t.long() for t in chunk(1, 2, 3, 32, 0)), None, 0.2)
    with pytest.raises(ValueError, match="head_dim=48"):
        PNMixLayer(SMALL).attend(*chunk(1, 2, 3, 48, 0), None, 0.2)
