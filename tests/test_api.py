"""patch_model / unpatch_model: one line, reversible, idempotent, clear errors."""

import copy
import functools
import inspect
import json
from unittest import mock

import pytest
import torch
from conftest import CACHE_KWARG, output_cache, saved_and_loaded, tiny_model
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaModel

from pnmix_patch import PNMixCache, PNMixConfig, PNMixStaticCache, cache_argument, is_patched, new_cache, patch_model, unpatch_model

FLUSHING = PNMixConfig(sink_tokens=4, residual_tokens=32, key_group_size=32, name="flushing")


def padded(lengths, seed=0, vocab=96):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def test_left_padded_batch_matches_each_sequence_alone(architecture):
    model = tiny_model(architecture)
    patch_model(model, FLUSHING)
    lengths = (41, 7, 26)
    ids, mask = padded(lengths)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=120, do_sample=False, pad_token_id=0)
    for row, length in enumerate(lengths):
        alone = model.generate(ids[row : row + 1, -length:], max_new_tokens=120, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[row, -120:], alone[0, -120:]), f"sequence {row} differs in the batch"


def test_patch_twice_is_harmless_and_unpatch_restores_exactly():
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    original_forward = type(attention).forward
    ids, mask = padded((20, 12))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    patch_model(model)
    patch_model(model, "kivi-2")  # only the config changes
    assert type(attention).__name__ == "PNMixLlamaAttention" and type(model.model).__bases__[1] is LlamaModel
    assert {type(layer.self_attn) for layer in model.model.layers} == {type(attention)}
    assert is_patched(model) and model.config._attn_implementation == "pnmix"
    assert isinstance(new_cache(model), PNMixCache) and new_cache(model).pnmix_config.name == "kivi-2"
    unpatch_model(model)
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"
    assert type(attention) is LlamaAttention and type(model.model) is LlamaModel
    assert "forward" not in vars(attention) and type(attention).forward is original_forward
    assert "forward" not in vars(model.model)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0), expected)
    unpatch_model(model)  # unpatching an unpatched model is a no-op


def halved(model):
    """``model`` with every weight halved, in place."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    return model


def test_a_deep_copy_runs_its_own_modules():
    """``copy.deepcopy`` of a patched model: the copy's forward runs the copy's modules (a forward bound to
    the original decoder at patch time would run the original's layers under the copy's LM head)."""
    model = patch_model(tiny_model("llama"), FLUSHING)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        copied = halved(copy.deepcopy(model))
        want = patch_model(halved(tiny_model("llama")), FLUSHING)(ids).logits
        assert torch.equal(copied(ids).logits, want)
        assert torch.equal(model(ids).logits, before)
    assert is_patched(copied) and isinstance(output_cache(copied(ids[:, :5], use_cache=True)), PNMixCache)
    assert unpatch_model(copied).config._attn_implementation == "sdpa" and is_patched(model)


def test_a_patched_model_pickles_and_loads_patched(monkeypatch):
    """``torch.save`` of a patched model (its classes made at run time) loads patched, with the same config
    and the same greedy tokens through a static cache, also where those classes were never made (a fresh
    process, simulated by empty registries). The decoder's forward shows the decoder's own signature."""
    model = patch_model(tiny_model("qwen3"), FLUSHING)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    want = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert isinstance(model.model._pnmix_state.static_cache, PNMixStaticCache)
    loaded = saved_and_loaded(model, monkeypatch)
    assert is_patched(loaded) and new_cache(loaded).pnmix_config == FLUSHING
    assert loaded.model._pnmix_state.static_cache is None  # the cache stays behind
    assert type(loaded.model.layers[0].self_attn) is not type(model.model.layers[0].self_attn)  # made again
    assert inspect.signature(loaded.model.forward) == inspect.signature(type(loaded.model).__bases__[1].forward.__get__(loaded.model))
    got = loaded.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(got, want)


def test_hidden_states_are_returned_as_unpatched():
    """``output_hidden_states`` through a patched model: transformers >= 5.24 looks up what a model can
    record by the name of its class, so the patched decoder's class passes for its own."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
        got = patch_model(model, FLUSHING)(ids, output_hidden_states=True).hidden_states
    assert got is not None and len(got) == len(want) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(got[0], want[0])


def test_a_later_change_to_the_decoder_class_forward_is_seen():
    """The patched decoder calls its class's forward as that class has it at the call (another library may
    wrap it after a first model was patched in the process)."""
    unpatch_model(patch_model(tiny_model("llama")))
    calls = []
    own = LlamaModel.forward

    @functools.wraps(own)
    def counting(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    with mock.patch.object(LlamaModel, "forward", counting), torch.no_grad():
        patch_model(tiny_model("llama"), FLUSHING)(torch.randint(3, 96, (1, 12)))
    assert len(calls) == 1


def test_a_patched_bare_decoder_saves_under_its_own_class_name(tmp_path):
    decoder = patch_model(tiny_model("llama").model, FLUSHING)
    assert type(decoder) is not LlamaModel and isinstance(decoder, LlamaModel)
    decoder.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaModel"]


def test_accelerate_hooks_keep_running_around_the_patched_forwards():
    """A module hooked by accelerate before patching (``add_hook_to_module`` sets the instance's forward to
    run the hook around the forward it found): the hook runs around PN-Mix's forward, and around the own
    forward again after unpatching; with the hooks removed, patching and unpatching still work. Any other
    instance forward is refused, naming the module."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Counting(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    for module in (model.model, attention):
        hooks.add_hook_to_module(module, Counting())
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    patch_model(model, FLUSHING)
    with torch.no_grad():
        output = model(ids, use_cache=True)
    assert Counting.calls == 2 and isinstance(output_cache(output), PNMixCache)
    unpatch_model(model)
    with torch.no_grad():
        assert not isinstance(output_cache(model(ids, use_cache=True)), PNMixCache)
    assert Counting.calls == 4 and type(attention) is LlamaAttention

    # accelerate's remove_hook_from_module leaves the forward it had wrapped bound on the instance: patching
    # and unpatching go on (the leftover is dropped), before and after the hooks come off.
    patch_model(model, FLUSHING)
    for module in (model.model, attention):
        hooks.remove_hook_from_module(module)
    assert "forward" in vars(attention)
    unpatch_model(patch_model(unpatch_model(model), FLUSHING))
    assert "forward" not in vars(attention) and type(attention) is LlamaAttention and not is_patched(model)

    other = tiny_model("llama")
    other.model.layers[0].self_attn.forward = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match="LlamaAttention module has a forward set on the instance"):
        patch_model(other)
    assert not is_patched(other) and type(other.model) is LlamaModel  # nothing was changed


def test_sampling_generation_runs_through_the_pnmix_cache():
    model = tiny_model("qwen3")
    patch_model(model, FLUSHING)
    ids, mask = padded((30, 18))
    torch.manual_seed(0)
    output = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=60,
        do_sample=True,
        top_k=20,
        top_p=0.95,
        temperature=0.6,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = output_cache(output)
    assert isinstance(cache, PNMixCache) and int(cache.layers[0].num_groups.max()) >= 2
    assert output[cache_argument(model)] is cache  # the README's way on any transformers version


def test_forward_with_user_cache_and_without_cache():
    model = tiny_model("mistral")
    ids = torch.randint(3, 96, (1, 50))
    with torch.no_grad():
        expected = model(ids).logits
        patch_model(model, "fp16")
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, rtol=1e-4, atol=1e-5)
        cache = new_cache(model)
        first = model(ids[:, :30], cache=cache).logits
        second = model(ids[:, 30:], cache=cache).logits  # a second multi-token chunk continues the cache
        torch.testing.assert_close(torch.cat([first, second], 1), expected, rtol=1e-4, atol=1e-5)
        assert isinstance(output_cache(model(ids, use_cache=True)), PNMixCache)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_under_autocast_a_float32_model_decodes_in_float32_with_bf16_projections(architecture):
    """Under CPU autocast (bf16) a float32 model's projections come out in bf16, and RoPE's float32 cos/sin
    promote q and k back to float32: the patched attention runs the cache in float32. Prefill and 40 decode
    steps (unquantized preset) give the unpatched model's logits under the same autocast within bf16's
    rounding (that model's SDPA computes in bf16); with quantization and a flush, the static cache gives
    the dynamic cache's logits exactly."""
    stock = tiny_model(architecture)
    ids = torch.randint(3, 96, (2, 80), generator=torch.Generator().manual_seed(0))

    def logits(model, cache):
        first = model(input_ids=ids[:, :40], **{CACHE_KWARG: cache}).logits[:, -1:]
        steps = [model(input_ids=ids[:, t : t + 1], **{CACHE_KWARG: cache}).logits for t in range(40, 80)]
        return torch.cat([first, *steps], 1)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = logits(stock, DynamicCache(config=stock.config))
        patched = patch_model(tiny_model(architecture), "fp16")  # the same seed: the same weights
        for static in (False, True):
            got = logits(patched, new_cache(patched, 80, static=True) if static else new_cache(patched))
            assert got.dtype == torch.bfloat16  # lm_head under autocast
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=2e-2)
        patch_model(patched, FLUSHING)
        dynamic = logits(patched, new_cache(patched))
        assert torch.equal(logits(patched, new_cache(patched, 80, static=True)), dynamic)


def test_a_filled_foreign_cache_is_refused():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 10))
    filled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE_KWARG: filled})  # unpatched transformers knows only its own name
        patch_model(model)
        with pytest.raises(TypeError, match="DynamicCache"):
            model(ids, cache=filled)


def test_unsupported_models_and_configs_are_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama.*mistral.*qwen2.*qwen3"):
        patch_model(gpt2)
    with pytest.raises(ValueError, match="sliding_window=16"):
        patch_model(tiny_model("mistral", sliding_window=16))
    with pytest.raises(ValueError, match="sliding"):
        patch_model(tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0))
    with pytest.raises(ValueError, match="head_dim=48"):
        patch_model(tiny_model("qwen3", head_dim=48))
    with pytest.raises(TypeError, match="torch.float64"):
        patch_model(tiny_model("llama").double())
    with pytest.raises(ValueError, match="config='pnmix-9'"):
        patch_model(tiny_model("llama"), "pnmix-9")


def test_patch_model_refuses_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="needs a transformers model.*got Linear"):
        patch_model(torch.nn.Linear(4, 4))


def test_output_attentions_is_refused_not_silently_empty():
    """Unpatched (eager attention), ``output_attentions=True`` returns the weights; patched, PN-Mix cannot, so it says so."""
    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(3, 96, (1, 8))
    assert model(ids, output_attentions=True).attentions[0] is not None
    patch_model(model)
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(ids, output_attentions=True)
    assert model(ids).logits.shape == (1, 8, 96)  # the default stays allowed
