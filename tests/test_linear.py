"""``patch_gemv``: one-token linear products through ``pnmix::gemv``, alone and with PN-Mix, eager and compiled."""

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from test_cache import SMALL
from torch._dynamo.utils import counters

import pnmix_patch.linear
from pnmix_patch import GemvLinear, new_cache, patch_gemv, patch_model, unpatch_gemv
from pnmix_patch.kernels.gemv import triton_gemv


def counting_gemv(monkeypatch) -> list:
    """Record the shapes of the weights that go through the op."""
    calls, op = [], pnmix_patch.linear.gemv

    def counted(x, weight, bias):
        calls.append(tuple(weight.shape))
        return op(x, weight, bias)

    monkeypatch.setattr(pnmix_patch.linear, "gemv", counted)
    return calls


def test_one_token_products_go_through_the_op_and_give_the_same_tokens(architecture, monkeypatch):
    model = tiny_model(architecture)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    calls = counting_gemv(monkeypatch)
    assert patch_gemv(model) is model and sum(type(m) is GemvLinear for m in model.modules()) == linears
    output = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    # The prefill's products (12 tokens) go to F.linear, except the LM head's (generate keeps the last
    # token's logits); each of the 5 decode steps sends every linear layer through the op.
    lm_head = tuple(model.lm_head.weight.shape)
    assert len(calls) == 5 * linears + 1 and calls.count(lm_head) == 6
    unpatch_gemv(model)
    assert not any(type(m) is GemvLinear for m in model.modules())
    calls.clear()
    model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert calls == []


def test_the_triton_kernel_in_the_model_gives_the_same_logits(monkeypatch):
    """The op's CPU implementation is ``F.linear`` itself: here the Triton kernel (interpreted) serves
    the one-token products of a Qwen2 model (biases) for a decode step."""
    model = tiny_model("qwen2")
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model(prompt[:, :-1], use_cache=True).past_key_values
        want = model(prompt[:, -1:], **{CACHE_KWARG: cache}).logits
        cache.crop(-1)
        patch_gemv(model)
        monkeypatch.setattr(pnmix_patch.linear, "gemv", triton_gemv)
        got = model(prompt[:, -1:], **{CACHE_KWARG: cache}).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_autocast_other_dtypes_and_tensor_subclasses_keep_f_linear(monkeypatch):
    calls = counting_gemv(monkeypatch)
    linear = patch_gemv(torch.nn.Linear(8, 4))
    with torch.autocast("cpu", torch.bfloat16):
        assert linear(torch.randn(1, 8)).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="same dtype"):  # F.linear's own error, as unpatched
        linear(torch.randn(8, dtype=torch.float64))
    linear.weight = torch.nn.Parameter(torch.randn(4, 8).as_subclass(Subclass))
    linear(torch.randn(8))
    assert calls == []
    linear.weight = torch.nn.Parameter(torch.randn(4, 8))
    linear(torch.randn(1, 1, 8))
    assert calls == [(4, 8)]


class Subclass(torch.Tensor):
    pass


def test_gradients_equal_f_linear_and_frozen_weights_get_none():
    linear = torch.nn.Linear(6, 3)
    x = torch.randn(1, 6, requires_grad=True)
    linear(x).square().sum().backward()
    want = x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone()
    x.grad = linear.weight.grad = linear.bias.grad = None
    patch_gemv(linear)(x).square().sum().backward()
    for got, expected in zip((x.grad, linear.weight.grad, linear.bias.grad), want):
        torch.testing.assert_close(got, expected)
    linear.weight.requires_grad_(False)
    x.grad = linear.weight.grad = linear.bias.grad = None
    linear(x).sum().backward()
    assert linear.weight.grad is None and x.grad is not None


def test_patching_twice_changes_nothing_and_a_model_without_linears_is_refused():
    model = patch_gemv(tiny_model("llama"))
    classes = [type(m) for m in model.modules()]
    assert [type(m) for m in patch_gemv(model).modules()] == classes
    with pytest.raises(ValueError, match="Embedding has no layer of the exact class torch.nn.Linear"):
        patch_gemv(torch.nn.Embedding(4, 4))


def test_subclasses_of_linear_keep_their_class():
    class Quantized(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Quantized(4, 4), torch.nn.Linear(4, 4))
    patch_gemv(model)
    assert type(model[0]) is Quantized and type(model[1]) is GemvLinear


def test_with_pnmix_the_compiled_decode_step_has_no_graph_break():
    """PN-Mix and the GEMV together: a static cache, ``torch.compile(fullgraph=True)`` over decode
    steps crossing a flush, the same greedy tokens as eager."""
    model = patch_gemv(patch_model(tiny_model("qwen2"), SMALL))
    prompt = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    steps = 80

    def greedy(forward, cache):
        with torch.no_grad():
            tokens = [prompt, model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)]
            for _ in range(steps):
                tokens.append(forward(input_ids=tokens[-1], **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1))
        return torch.cat(tokens, 1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    tokens = greedy(compiled, new_cache(model, prompt.shape[1] + steps + 1, static=True))
    assert dict(counters["graph_break"]) == {} and sum(counters["recompiles"].values()) == 0
    assert torch.equal(tokens, greedy(model.forward, new_cache(model, prompt.shape[1] + steps + 1, static=True)))
