"""ChanMix's key format: channel classification, class storage and per-class quantization."""

import torch

from pnmix_patch import PRESETS
from pnmix_patch.reference.chanmix import (
    NORMAL,
    OUTLIER,
    RETRIEVAL,
    SUBNORMAL,
    classify_channels,
    dequantize_class_keys,
    pack_classes,
    quantize_class_keys,
    unpack_classes,
)

D, T = 32, 64
ONE_EACH = (1, 1, D - 3, 1)


def constructed_channels(seed=0):
    """Queries and keys with one retrieval-like, one outlier and one subnormal channel among normal ones."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(1, 1, T, D, generator=gen)
    query = torch.randn(1, 2, T, D, generator=gen)
    # retrieval-like: the queries lean on channel 3 and its keys are steady, so it carries the logit
    query[..., 3] = 8.0
    key[..., 3] = 2.0 + 0.1 * torch.randn(T, generator=gen)
    # outlier: channel 7's keys are mostly small with a few huge spikes (the widest range), queries ignore it
    key[..., 7] = 0.05 * torch.randn(T, generator=gen)
    key[..., ::16, 7] = 40.0
    query[..., 7] = 0.01
    # subnormal: channel 11's keys are tiny
    key[..., 11] *= 1e-3
    return query, key


def test_constructed_channels_fall_in_their_classes():
    query, key = constructed_channels()
    classes = classify_channels(query, key, None, ONE_EACH)[0, 0]
    assert int(classes[3]) == RETRIEVAL and int(classes[7]) == OUTLIER and int(classes[11]) == SUBNORMAL
    assert classes.eq(NORMAL).sum() == D - 3


def test_class_counts_are_exact_and_the_preset_averages_two_code_bits():
    query, key = constructed_channels(seed=1)
    counts = PRESETS["chanmix"].class_counts(D)
    assert counts == (2, 4, 18, 8)
    key[0, 0, 5, :6] = float("nan")  # non-finite scores still leave every class its count
    classes = classify_channels(query, key, None, counts)
    assert [int(classes.eq(label).sum()) for label in range(4)] == list(counts)
    code_bits = sum(c * b for c, b in zip(counts, PRESETS["chanmix"].class_bits)) / D
    assert code_bits == 2.0 and PRESETS["chanmix"].nominal_key_bits(D) == 2.25


def test_padding_does_not_change_the_classes():
    query, key = constructed_channels(seed=2)
    padded_key = torch.cat([torch.full((1, 1, 9, D), 1e4), key], 2)  # huge padding would make every channel an outlier
    padded_query = torch.cat([torch.zeros(1, 2, 9, D), query], 2)
    valid = torch.cat([torch.zeros(1, 9, dtype=torch.bool), torch.ones(1, T, dtype=torch.bool)], 1)
    counts = PRESETS["chanmix"].class_counts(D)
    assert torch.equal(classify_channels(padded_query, padded_key, valid, counts), classify_channels(query, key, None, counts))


def test_classes_pack_into_two_bit_planes():
    classes = torch.randint(0, 4, (2, 3, 70), generator=torch.Generator().manual_seed(3))
    words = pack_classes(classes)
    assert words.shape == (2, 3, 2, 3) and words.dtype == torch.int32
    assert torch.equal(unpack_classes(words, 70), classes)


def test_every_class_is_quantized_at_its_width():
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 2, 2 * T, D, generator=gen)
    classes = torch.stack([torch.randperm(D, generator=gen) for _ in range(2)]).unsqueeze(0)
    counts, bits = (2, 4, 18, 8), (4, 3, 2, 1)
    classes = torch.bucketize(classes, torch.tensor([2, 6, 24]), right=True)  # channel ranks -> classes of those counts
    stored = quantize_class_keys(keys, classes, counts, bits, T, midpoint_correction=False)
    assert [tuple(t.shape) for t in stored[:4]] == [(1, 2, 2, b, T // 32, c) for b, c in zip(bits, counts)]
    restored = dequantize_class_keys(stored[:4], stored[4], stored[5], classes)
    grouped = keys.reshape(1, 2, 2, T, D)
    value_range = grouped.amax(3) - grouped.amin(3)
    error = (restored.reshape(1, 2, 2, T, D) - grouped).abs().amax(3)
    width = torch.tensor(bits)[classes].unsqueeze(2)
    # min-max: at most half a step, step = range / (2**b - 1) (plus the 16-bit rounding)
    assert error.le(value_range / (2**width - 1) / 2 + 2e-3 * grouped.abs().amax(3)).all()
    # 1-bit channels without the midpoint correction read back only their end points
    one_bit = (classes == SUBNORMAL).unsqueeze(2).expand(-1, -1, 2, -1)
    ends = torch.stack([grouped.amin(3), grouped.amax(3)], -1)
    values = restored.reshape(1, 2, 2, T, D).transpose(3, 4)[one_bit]
    assert torch.isclose(values.unsqueeze(-1), ends[one_bit].unsqueeze(1), atol=5e-3, rtol=0).any(-1).all()
