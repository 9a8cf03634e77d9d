"""Every supported architecture, patched end to end on tiny random models."""

import torch
from conftest import output_cache, tiny_model

from pnmix_patch import PNMixConfig, new_cache, patch_model, unpatch_model

EIGHT_BIT = PNMixConfig(pair_ratio=1.0, key_bits_high=8, key_bits_low=8, value_bits=8, sink_tokens=4, residual_tokens=32, key_group_size=32)


def left_padded_batch(vocab=96, lengths=(23, 9), seed=1):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids, mask


def greedy(model, ids, mask, tokens):
    return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def test_fp16_preset_reproduces_unpatched_greedy_tokens(architecture):
    model = tiny_model(architecture)
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask, 40)
    patch_model(model, "fp16")
    assert torch.equal(greedy(model, ids, mask, 40), expected)
    unpatch_model(model)
    assert torch.equal(greedy(model, ids, mask, 40), expected)


def test_eight_bit_cache_keeps_logits_close(architecture):
    model = tiny_model(architecture)
    ids = torch.randint(3, 96, (2, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        patch_model(model, EIGHT_BIT)
        cache = new_cache(model)
        prefill = 20
        logits = [model(ids[:, :prefill], cache=cache).logits]
        for position in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, position : position + 1], cache=cache).logits)
    got = torch.cat(logits, 1)
    assert int(cache.layers[0].num_groups.min()) >= 3  # the comparison crosses several flushes
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 5e-3 * scale
    # the cache really quantizes: the logits are close, not bit-identical
    assert not torch.allclose(got, expected, atol=0, rtol=0)


def test_pnmix1_generates_across_three_flushes(architecture):
    model = tiny_model(architecture)
    ids, mask = left_padded_batch(lengths=(30, 17))
    patch_model(model)
    output = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=440,
        min_new_tokens=440,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = output_cache(output)
    layer = cache.layers[0]
    stored = layer.sink_len + layer.num_groups * 128 + layer.residual_len
    real = mask.sum(1) + 439  # the last generated token is never fed back
    assert torch.equal(stored, real.to(torch.int32))
    assert int(layer.num_groups.min()) >= 3
    assert torch.all((layer.residual_len >= 1) & (layer.residual_len <= 128))
    assert output.sequences.shape == (2, ids.shape[1] + 440)
