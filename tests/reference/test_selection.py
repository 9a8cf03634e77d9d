"""Pair selection at prefill (pnmix_patch.reference.selection) on hand-built inputs with known answers."""

import math

import pytest
import torch

from pnmix_patch.config import PRESETS
from pnmix_patch.reference.selection import (
    group_channel_masks,
    pack_mask,
    pair_norms,
    pair_scores,
    pairs_to_channels,
    select_top_pairs,
    unpack_mask,
)

D = 16  # head dim: 8 pairs
P = D // 2


def ones_valid(batch, tokens):
    return torch.ones(batch, tokens, dtype=torch.bool)


def small_background(batch, heads, tokens, head_dim=D, seed=0):
    """Small random values, so that hand-placed large values decide the ranking."""
    return 0.01 * torch.rand(batch, heads, tokens, head_dim, generator=torch.Generator().manual_seed(seed))


def select(query, key, valid, criterion="qk_pair_norm", pairing="half", k=1):
    return select_top_pairs(pair_scores(query, key, valid, criterion, pairing), k)


def selected_indices(mask):
    return torch.nonzero(mask.flatten()).flatten().tolist()


# ---------------------------------------------------------------- pairing


def test_pair_norms_half_and_interleaved():
    x = torch.arange(8, dtype=torch.float32)
    half = pair_norms(x, "half")
    interleaved = pair_norms(x, "interleaved")
    torch.testing.assert_close(half, torch.tensor([math.hypot(i, i + 4) for i in range(4)]))
    torch.testing.assert_close(interleaved, torch.tensor([math.hypot(2 * i, 2 * i + 1) for i in range(4)]))


def test_half_pairing_pairs_channel_i_with_i_plus_half():
    key = small_background(1, 1, 6)
    query = small_background(1, 1, 6, seed=1)
    for x in (key, query):
        x[..., 3] = 2.0
        x[..., 3 + P] = 2.0
    mask = select(query, key, ones_valid(1, 6))
    assert selected_indices(mask) == [3]
    channels = pairs_to_channels(mask, "half")
    assert selected_indices(channels) == [3, 3 + P]


def test_adjacent_channels_are_one_pair_only_when_interleaved():
    # channels 4, 5: one interleaved pair (2), but two half-split pairs (4 and 5).
    # channels 0, 8: one half-split pair (0), but two interleaved pairs (0 and 4).
    key = small_background(1, 1, 4)
    query = torch.ones(1, 1, 4, D)
    key[..., 4] = key[..., 5] = 3.0
    key[..., 0] = key[..., 8] = 4.0
    valid = ones_valid(1, 4)
    # half: pair 0 norm 4*sqrt(2) = 5.66 beats pairs 4 and 5 (norm 3 each)
    assert selected_indices(select(query, key, valid, pairing="half")) == [0]
    # interleaved: pair 2 norm 3*sqrt(2) = 4.24 beats pairs 0 and 4 (norm 4 each)
    assert selected_indices(select(query, key, valid, pairing="interleaved")) == [2]
    assert selected_indices(pairs_to_channels(torch.eye(P, dtype=torch.bool)[2], "interleaved")) == [4, 5]
    assert selected_indices(pairs_to_channels(torch.eye(P, dtype=torch.bool)[2], "half")) == [2, 2 + P]


def rope(x, positions, pairing):
    """RoPE with Hugging Face rotate_half (pairing "half") or adjacent pairs ("interleaved")."""
    half = x.shape[-1] // 2
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(half).float() / half))[None]
    cos, sin = freqs.cos(), freqs.sin()
    if pairing == "half":
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack([first * cos - second * sin, second * cos + first * sin], -1).flatten(-2)


@pytest.mark.parametrize("pairing, other", [("half", "interleaved"), ("interleaved", "half")])
@pytest.mark.parametrize("criterion", ["qk_pair_norm", "k_pair_norm"])
def test_pair_scores_invariant_under_matching_rope(pairing, other, criterion):
    gen = torch.Generator().manual_seed(2)
    query, key = torch.randn(2, 4, 10, 32, generator=gen), torch.randn(2, 2, 10, 32, generator=gen)
    positions = torch.arange(10) * 37 + 5
    valid = ones_valid(2, 10)
    before = pair_scores(query, key, valid, criterion, pairing)
    after = pair_scores(rope(query, positions, pairing), rope(key, positions, pairing), valid, criterion, pairing)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    # with the wrong pairing, the scores move
    wrong = pair_scores(rope(query, positions, other), rope(key, positions, other), valid, criterion, pairing)
    assert (wrong - before).abs().max() > 1e-2


# ---------------------------------------------------------------- scores


def test_gqa_uses_mean_of_query_heads():
    # 1 KV head, 2 query heads; keys: pair norm 1 on every pair.
    key = torch.zeros(1, 1, 3, D)
    key[..., :P] = 1.0
    query = torch.zeros(1, 2, 3, D)
    query[0, 0, :, 0] = 10.0  # head 0: pair 0
    query[0, 1, :, 1] = 4.0  # head 1: pair 1
    query[0, :, :, 2] = 6.0  # both heads: pair 2
    scores = pair_scores(query, key, ones_valid(1, 3), "qk_pair_norm", "half")
    expected = torch.zeros(1, 1, P)
    expected[0, 0, :3] = torch.tensor([5.0, 2.0, 6.0])  # mean over the two query heads
    torch.testing.assert_close(scores, expected)
    assert selected_indices(select_top_pairs(scores, 1)) == [2]  # max-over-heads would pick pair 0


def test_gqa_groups_consecutive_query_heads():
    # 4 query heads, 2 KV heads: heads 0, 1 share KV head 0; heads 2, 3 share KV head 1 (HF repeat_kv)
    key = torch.zeros(1, 2, 2, D)
    key[..., :P] = 1.0
    query = torch.zeros(1, 4, 2, D)
    for head, pair in enumerate([0, 1, 5, 6]):
        query[0, head, :, pair] = 2.0 * (head + 1)
    scores = pair_scores(query, key, ones_valid(1, 2), "qk_pair_norm", "half")
    expected = torch.zeros(1, 2, P)
    expected[0, 0, 0], expected[0, 0, 1] = 1.0, 2.0
    expected[0, 1, 5], expected[0, 1, 6] = 3.0, 4.0
    torch.testing.assert_close(scores, expected)


def test_query_key_product_differs_from_key_only():
    key = torch.zeros(1, 1, 4, D)
    query = torch.zeros(1, 1, 4, D)
    key[..., 0], key[..., 1] = 3.0, 2.0  # key pair norms: pair 0 = 3, pair 1 = 2
    query[..., 0], query[..., 1] = 1.0, 2.0  # query pair norms: 1 and 2 -> products 3 and 4
    valid = ones_valid(1, 4)
    assert selected_indices(select(query, key, valid, "k_pair_norm")) == [0]
    assert selected_indices(select(query, key, valid, "qk_pair_norm")) == [1]
    scores = pair_scores(query, key, valid, "qk_pair_norm", "half")
    torch.testing.assert_close(scores[0, 0, :2], torch.tensor([3.0, 4.0]))


def test_mean_over_tokens_not_sum_or_max():
    key = torch.zeros(1, 1, 4, D)
    key[0, 0, :, 2] = torch.tensor([1.0, 2.0, 3.0, 6.0])
    query = torch.zeros(1, 1, 4, D)
    query[0, 0, :, 2] = torch.tensor([-1.0, 1.0, -1.0, 5.0])  # |q| mean = 2
    scores = pair_scores(query, key, ones_valid(1, 4), "qk_pair_norm", "half")
    assert scores[0, 0, 2].item() == pytest.approx(3.0 * 2.0)


@pytest.mark.parametrize("criterion", ["qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range"])
def test_no_validity_mask_means_every_token(criterion):
    key = small_background(2, 1, 8)
    query = small_background(2, 1, 8, seed=1)
    torch.testing.assert_close(
        pair_scores(query, key, None, criterion, "half"), pair_scores(query, key, ones_valid(2, 8), criterion, "half")
    )


@pytest.mark.parametrize("criterion", ["qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range"])
def test_padding_excluded(criterion):
    # sequence 0: left padding in positions 0..2 holding huge values on pair 5;
    # real tokens put pair 1 first. Sequence 1 has no padding and the same real tokens.
    tokens = 8
    key = small_background(2, 1, tokens)
    query = small_background(2, 1, tokens, seed=1)
    key[..., 1] = torch.tensor([1.0, -1.0] * (tokens // 2))
    query[..., 1] = 1.0
    key[0, 0, :3, 5] = torch.tensor([1e4, -1e4, 3e4])
    query[0, 0, :3, 5] = 1e4
    valid = ones_valid(2, tokens)
    valid[0, :3] = False
    mask = select(query, key, valid, criterion)
    assert selected_indices(mask[0]) == [1]
    assert selected_indices(mask[1]) == [1]
    # and the scores of the padded sequence equal those of its real tokens alone
    alone = pair_scores(query[:1, :, 3:], key[:1, :, 3:], valid[:1, 3:], criterion, "half")
    torch.testing.assert_close(pair_scores(query, key, valid, criterion, "half")[:1], alone)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("criterion", ["qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range"])
def test_non_finite_padding_excluded(criterion, bad):
    # E_t excludes padding: even non-finite padded keys/queries must not reach the scores.
    key = small_background(1, 1, 6)
    query = small_background(1, 1, 6, seed=1)
    key[..., 1] = torch.tensor([1.0, -1.0] * 3)
    query[..., 1] = 1.0
    key[0, 0, 0, :] = bad
    query[0, 0, 0, :] = bad
    valid = ones_valid(1, 6)
    valid[0, 0] = False
    scores = pair_scores(query, key, valid, criterion, "half")
    assert torch.isfinite(scores).all()
    assert selected_indices(select_top_pairs(scores, 1)) == [1]


def test_per_sequence_selection():
    key = small_background(2, 2, 4)
    query = torch.ones(2, 4, 4, D)
    key[0, 0, :, 2] = 5.0
    key[0, 1, :, 6] = 5.0
    key[1, 0, :, 7] = 5.0
    key[1, 1, :, 0 + P] = 5.0
    mask = select(query, key, ones_valid(2, 4))
    assert [selected_indices(mask[b, h]) for b in range(2) for h in range(2)] == [[2], [6], [7], [0]]


def test_k_magnitude_and_k_range():
    tokens = 8
    key = torch.zeros(1, 1, tokens, D)
    key[..., 1] = 5.0  # magnitude 5, range 0
    key[..., 2] = torch.tensor([2.0, -2.0] * 4)  # magnitude 2, range 4
    key[..., 2 + P] = torch.tensor([0.5, -0.5] * 4)  # pair 2 second channel: magnitude 0.5, range 1
    key[..., 3] = torch.tensor([-3.0, -2.0] * 4)  # magnitude 2.5, range 1
    query = torch.ones(1, 1, tokens, D)
    valid = ones_valid(1, tokens)
    magnitude = pair_scores(query, key, valid, "k_magnitude", "half")
    value_range = pair_scores(query, key, valid, "k_range", "half")
    torch.testing.assert_close(magnitude[0, 0, :4], torch.tensor([0.0, 5.0, 2.5, 2.5]))
    torch.testing.assert_close(value_range[0, 0, :4], torch.tensor([0.0, 0.0, 5.0, 1.0]))
    assert selected_indices(select_top_pairs(magnitude, 1)) == [1]
    assert selected_indices(select_top_pairs(value_range, 1)) == [2]


def test_unknown_criterion_and_pairing_raise():
    x = torch.ones(1, 1, 2, D)
    with pytest.raises(ValueError, match="k_range"):
        pair_scores(x, x, ones_valid(1, 2), "q_norm", "half")
    with pytest.raises(ValueError, match="interleaved"):
        pair_scores(x, x, ones_valid(1, 2), "qk_pair_norm", "rotate")


# ---------------------------------------------------------------- top-r


@pytest.mark.parametrize("num_selected", [0, 1, 13, 16, 31, 32])
def test_top_r_count_exact_with_ties(num_selected):
    gen = torch.Generator().manual_seed(num_selected)
    scores = torch.randint(0, 4, (3, 4, 32), generator=gen).float()  # many ties
    mask = select_top_pairs(scores, num_selected)
    assert mask.dtype == torch.bool and mask.shape == scores.shape
    assert (mask.sum(-1) == num_selected).all()
    if 0 < num_selected < 32:
        chosen_min = torch.where(mask, scores, math.inf).amin(-1)
        rest_max = torch.where(mask, -math.inf, scores).amax(-1)
        assert (chosen_min >= rest_max).all()


def test_top_r_of_presets_on_real_scores():
    gen = torch.Generator().manual_seed(9)
    query, key = torch.randn(2, 8, 12, 64, generator=gen), torch.randn(2, 4, 12, 64, generator=gen)
    scores = pair_scores(query, key, ones_valid(2, 12), "qk_pair_norm", "half")
    for name, expected in [("pnmix-1", 16), ("pnmix-2", 13)]:
        mask = select_top_pairs(scores, PRESETS[name].num_selected_pairs(64))
        assert (mask.sum(-1) == expected).all()
        assert torch.equal(mask, scores >= scores.topk(expected, -1).values[..., -1:])


def test_non_finite_keys_do_not_crash():
    gen = torch.Generator().manual_seed(10)
    query, key = torch.randn(2, 2, 6, D, generator=gen), torch.randn(2, 2, 6, D, generator=gen)
    key[0, 0, 2, 3] = math.nan
    key[0, 1, 4, 5] = math.inf
    query[1, 0, 1, 0] = -math.inf
    for criterion in ("qk_pair_norm", "k_pair_norm", "k_magnitude", "k_range"):
        mask = select(query, key, ones_valid(2, 6), criterion, k=3)
        assert (mask.sum(-1) == 3).all()


def test_nan_scores_rank_lowest():
    scores = torch.tensor([[1.0, math.nan, 3.0, 2.0, math.nan]])
    assert selected_indices(select_top_pairs(scores, 3)) == [0, 2, 3]
    assert (select_top_pairs(scores, 4).sum() == 4).all()


def test_non_finite_scores_rank_lowest():
    # documented in select_top_pairs: "Non-finite scores (from non-finite keys) rank lowest"
    scores = torch.tensor([[1.0, math.inf, 3.0, 2.0, math.nan, -math.inf]])
    assert selected_indices(select_top_pairs(scores, 3)) == [0, 2, 3]


# ---------------------------------------------------------------- mask packing


@pytest.mark.parametrize("size", [16, 32, 64, 33])
def test_pack_mask_round_trip(size):
    gen = torch.Generator().manual_seed(size)
    mask = torch.rand(2, 3, size, generator=gen) < 0.5
    mask[0, 0] = True  # every bit set, including the int32 sign bit
    mask[0, 1] = False
    packed = pack_mask(mask)
    assert packed.dtype == torch.int32
    assert packed.shape == (2, 3, -(-size // 32))
    assert torch.equal(unpack_mask(packed, size), mask)


def test_pack_mask_layout():
    mask = torch.zeros(33, dtype=torch.bool)
    mask[[0, 31, 32]] = True
    assert pack_mask(mask).tolist() == [1 - 2**31, 1]
    assert pack_mask(torch.ones(32, dtype=torch.bool)).tolist() == [-1]


# ---------------------------------------------------------------- per-group re-selection


def test_group_channel_masks_kitty_ranks_single_channels_per_group_by_magnitude():
    keys = small_background(1, 2, 256, seed=3).view(1, 2, 2, 128, D)
    keys[0, 0, 0, :, 3] = 5.0  # group 0: channel 3, then 10
    keys[0, 0, 0, :, 10] = -4.0
    keys[0, 0, 1, :, 7] = 6.0  # group 1: channels 7 and 0
    keys[0, 0, 1, :, 0] = 2.0
    masks = group_channel_masks(keys, "k_magnitude", "channel", "half", 2)
    assert masks.shape == (1, 2, 2, D) and masks.dtype == torch.bool
    assert selected_indices(masks[0, 0, 0]) == [3, 10]
    assert selected_indices(masks[0, 0, 1]) == [0, 7]
    assert masks.sum(-1).eq(2).all()  # exactly the requested count everywhere, not whole pairs


def test_group_channel_masks_k_range_channel():
    keys = small_background(1, 1, 128, seed=4).view(1, 1, 1, 128, D)
    keys[0, 0, 0, ::2, 5] = 3.0  # range 3 on channel 5, magnitude only ~1.5
    keys[0, 0, 0, :, 6] = 2.0  # constant: magnitude 2, range ~0
    assert selected_indices(group_channel_masks(keys, "k_range", "channel", "half", 1)[0, 0, 0]) == [5]
    assert selected_indices(group_channel_masks(keys, "k_magnitude", "channel", "half", 1)[0, 0, 0]) == [6]


@pytest.mark.parametrize("pairing, partner", [("half", 3 + P), ("interleaved", 2)])
def test_group_channel_masks_pair_unit_selects_both_channels(pairing, partner):
    keys = small_background(1, 1, 128, seed=5).view(1, 1, 1, 128, D)
    keys[..., 3] = 4.0
    for criterion in ("k_pair_norm", "k_magnitude", "k_range"):
        if criterion == "k_range":
            keys[..., ::2, 3] = -4.0
        mask = group_channel_masks(keys, criterion, "pair", pairing, 2)
        assert selected_indices(mask[0, 0, 0]) == sorted([3, partner]), criterion


def test_group_channel_masks_qk_uses_the_query_statistic():
    keys = small_background(1, 1, 128, seed=6).view(1, 1, 1, 128, D)
    keys[..., 1] = 2.0  # key pair 1 is larger than pair 4 ...
    keys[..., 4] = 1.0
    query_mean = torch.full((1, 1, P), 0.01)
    query_mean[..., 4] = 10.0  # ... but the query weighs pair 4
    qk = group_channel_masks(keys, "qk_pair_norm", "pair", "half", 2, query_mean)
    k_only = group_channel_masks(keys, "k_pair_norm", "pair", "half", 2)
    assert selected_indices(qk[0, 0, 0]) == [4, 4 + P]
    assert selected_indices(k_only[0, 0, 0]) == [1, 1 + P]


def test_group_channel_masks_invalid_arguments():
    keys = torch.zeros(1, 1, 1, 32, D)
    with pytest.raises(ValueError, match="query_pair_mean"):
        group_channel_masks(keys, "qk_pair_norm", "pair", "half", 2)
    with pytest.raises(ValueError, match="allowed unit='pair'"):
        group_channel_masks(keys, "k_pair_norm", "channel", "half", 2)
    with pytest.raises(ValueError, match="allowed 'pair', 'channel'"):
        group_channel_masks(keys, "k_range", "block", "half", 2)
    with pytest.raises(ValueError, match="criterion='random'"):
        group_channel_masks(keys, "random", "pair", "half", 2)
