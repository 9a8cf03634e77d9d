"""The PolarQuant and ChanMix presets in the cache: storage, bits, decode routing, generation, refusals."""

import pytest
import torch
from conftest import assert_left_padded_batch_generates_alone, tiny_model

import pnmix_patch.cache
from pnmix_patch import PRESETS, PNMixConfig, PNMixLayer, PNMixStaticCache, patch_model, unpatch_model
from pnmix_patch.cache_io import save_cache
from pnmix_patch.config import SUPPORTED_BITS
from pnmix_patch.reference.chanmix import classify_channels, dequantize_class_keys, quantize_class_keys
from pnmix_patch.reference.polar import dequantize_polar_keys, quantize_polar_keys

HEADS, QUERY_HEADS, D, G, SINKS = 2, 4, 32, 128, 32
FORMATS = ["polarquant", "polarquant-3", "chanmix"]


def random_chunk(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(1, HEADS, tokens, D, generator=gen) * torch.rand(D, generator=gen).mul(3).exp()
    return torch.randn(1, QUERY_HEADS, tokens, D, generator=gen), key, torch.randn(1, HEADS, tokens, D, generator=gen)


def test_presets_and_their_nominal_bits():
    polar, polar3, chanmix = (PRESETS[name] for name in FORMATS)
    assert (polar.key_format, polar.radius_bits, polar.angle_bits) == ("polar", 4, 4)
    assert (polar3.radius_bits, polar3.angle_bits) == (3, 3)
    assert (chanmix.key_format, chanmix.class_bits, chanmix.class_counts(64)) == ("channel_classes", (4, 3, 2, 1), (4, 8, 36, 16))
    assert [PRESETS[name].nominal_key_bits(64) for name in FORMATS] == [4.25, 3.25, 2.25]
    assert not any(PRESETS[name].fused_decode for name in FORMATS)
    assert PRESETS["pnmix-1"].fused_decode and not PRESETS["kitty"].fused_decode and not PRESETS["fp16"].fused_decode
    custom = PNMixConfig(key_format="polar", radius_bits=2, angle_bits=3, key_group_size=64, residual_tokens=128)
    assert custom.nominal_key_bits(64) == 2.5 + 0.5


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(key_format="spherical"), "'spherical' is invalid: allowed one of ('channel', 'polar', 'channel_classes')"),
        (dict(key_format="polar", radius_bits=5), "radius_bits=5 is invalid: allowed one of (1, 2, 3, 4, 8)"),
        (dict(angle_bits=0), "angle_bits=0 is invalid"),
        (dict(class_bits=(1, 2, 3, 4)), "non-increasing widths"),
        (dict(class_bits=(4, 3, 2)), "4 widths"),
        (dict(class_fractions=(0.5, 0.4, 0.3)), "summing to at most 1"),
        (
            dict(key_format="polar", reselection="per_group"),
            "reselection='per_group' is invalid: allowed 'prefill' with key_format='polar'",
        ),
        (
            dict(key_format="channel_classes", selection="k_magnitude", selection_unit="channel", reselection="per_group"),
            "with key_format='channel_classes'",
        ),
    ],
)
def test_unsupported_settings_name_the_value_and_what_is_allowed(changes, named):
    with pytest.raises(ValueError, match="PNMixConfig") as error:
        PNMixConfig(**changes)
    assert named in str(error.value)
    assert str(SUPPORTED_BITS) in str(error.value) or "allowed" in str(error.value)


def test_class_fractions_that_leave_no_room_at_a_head_dim_are_refused():
    config = PNMixConfig(key_format="channel_classes", class_fractions=(0.4, 0.4, 0.2))
    assert config.class_counts(32) == (13, 13, 0, 6)
    with pytest.raises(ValueError, match="leave no channels at head_dim=10"):
        PNMixConfig(key_format="channel_classes", class_fractions=(0.35, 0.35, 0.3)).class_counts(10)


def test_polar_layer_stores_what_the_reference_quantizer_stores():
    query, key, value = random_chunk(SINKS + 2 * G + 20, seed=1)
    layer = PNMixLayer(PRESETS["polarquant"])
    layer.attend(query, key, value, None, D**-0.5)
    assert int(layer.num_groups[0]) == 2 and int(layer.residual_len[0]) == 20
    assert layer.key_codes_radius.shape == (1, HEADS, 2, 4, G // 32, D // 2) and not hasattr(layer, "key_codes_high")
    expected = dequantize_polar_keys(*quantize_polar_keys(key[:, :, SINKS : SINKS + 2 * G], G, 4, 4, "half"), "half")
    torch.testing.assert_close(layer.quantized_keys(), expected, rtol=0, atol=0)


def test_chanmix_layer_classifies_at_prefill_and_keeps_the_classes():
    query, key, value = random_chunk(SINKS + G + 10, seed=2)
    layer = PNMixLayer(PRESETS["chanmix"])
    layer.attend(query, key, value, None, D**-0.5)
    counts = PRESETS["chanmix"].class_counts(D)
    classes = classify_channels(query, key, None, counts)
    assert torch.equal(layer.channel_classes, classes)
    for _ in range(G - 10 + 1):  # decode past the next flush: the prefill's classes stay
        step = torch.randn(1, QUERY_HEADS, 1, D) * 50, torch.randn(1, HEADS, 1, D) * 50, torch.randn(1, HEADS, 1, D)
        layer.attend(*step, None, D**-0.5)
    assert int(layer.num_groups[0]) == 2 and torch.equal(layer.channel_classes, classes)
    first = quantize_class_keys(key[:, :, SINKS : SINKS + G], classes, counts, (4, 3, 2, 1), G, False)
    torch.testing.assert_close(
        layer.quantized_keys()[:, :, :G], dequantize_class_keys(first[:4], first[4], first[5], classes), rtol=0, atol=0
    )


@pytest.mark.parametrize("name", FORMATS)
def test_memory_report_bits_match_a_hand_count(name):
    config = PRESETS[name]
    model = tiny_model("llama")
    patch_model(model, config)
    try:
        ids = torch.randint(0, 96, (1, SINKS + 3 * G + 5), generator=torch.Generator().manual_seed(3))
        output = model(ids, use_cache=True)
        cache = output.cache if hasattr(output, "cache") else output.past_key_values
        report = cache.memory_report()
    finally:
        unpatch_model(model)
    layers, groups, words = 2, 3, G // 32
    elements = layers * HEADS * groups * G * D
    if config.key_format == "polar":
        code_bytes = layers * HEADS * groups * (config.radius_bits + config.angle_bits) * words * (D // 2) * 4
        masks = 0
    else:
        code_bytes = layers * HEADS * groups * sum(c * b for c, b in zip(config.class_counts(D), config.class_bits)) * words * 4
        masks = layers * HEADS * 2 * 4  # two int32 bit planes of the 32 channel classes per (layer, head)
    scales_zeros = layers * HEADS * groups * D * 2 * 2
    assert (report["packed_keys"], report["key_scales_zeros"], report["masks"]) == (code_bytes, scales_zeros, masks)
    assert report["key_bits_per_element"] == 8 * (code_bytes + scales_zeros + masks) / elements
    assert report["key_bits_per_element"] == pytest.approx(config.nominal_key_bits(D) + 8 * masks / elements, abs=1e-12)
    assert report["value_bits_per_element"] == 2 + 32 / D


@pytest.mark.parametrize("name", [*FORMATS, "pnmix-1"])
def test_decode_steps_route_by_layout(name, monkeypatch):
    """The routing a CUDA run takes, checked on CPU: only the per-channel layout reaches the fused decode op."""
    calls = []
    fused = pnmix_patch.cache.decode_attention

    def recording(*args):
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(pnmix_patch.cache, "decode_attention", recording)
    query, key, value = random_chunk(SINKS + G + 3, seed=4)
    layer = PNMixLayer(PRESETS[name])
    layer.attend(query[:, :, :-2], key[:, :, :-2], value[:, :, :-2], None, D**-0.5)
    assert not layer.fused_decode_step(5)
    for position in (-2, -1):
        step = slice(position, None if position == -1 else position + 1)
        output = layer.attend(query[:, :, step], key[:, :, step], value[:, :, step], None, D**-0.5)
        assert torch.isfinite(output).all()
    fused_expected = name == "pnmix-1"
    assert layer.fused_decode_step(1) == fused_expected
    assert len(calls) == (2 if fused_expected else 0)


@pytest.mark.parametrize("name", FORMATS)
def test_left_padded_batch_generates_like_each_sequence_alone(name, architecture):
    assert_left_padded_batch_generates_alone(tiny_model(architecture), name)


@pytest.mark.parametrize("name", FORMATS)
def test_static_cache_and_cache_files_refuse_the_other_formats(name, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"key_format='{PRESETS[name].key_format}' \\(allowed 'channel'\\)"):
        PNMixStaticCache(model.config, name, max_cache_len=512)
    patch_model(model, name)
    try:
        output = model(torch.randint(0, 96, (1, 200)), use_cache=True)
        cache = output.cache if hasattr(output, "cache") else output.past_key_values
        with pytest.raises(ValueError, match="save_cache writes the per-channel key layout only"):
            save_cache(cache, tmp_path / "cache.safetensors")
    finally:
        unpatch_model(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", FORMATS)
def test_cuda_generation_gives_the_cpu_tokens(name):
    """On CUDA these formats decode through the PyTorch reference (never the kernels): a float32 model
    generates the CPU's greedy tokens, over several flushes."""
    model = patch_model(tiny_model("qwen3"), name)
    prompt = torch.randint(1, 96, (2, 150), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=300, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **settings)
    assert torch.equal(model.cuda().generate(prompt.cuda(), **settings).cpu(), expected)
