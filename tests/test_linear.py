"""``patch_gemv``: one-token linear products through ``pnmix::gemv``, alone and with PN-Mix, eager and compiled."""

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from test_cache import SMALL
from torch._dynamo.utils import counters

import pnmix_patch.linear
from pnmix_patch import GemvLinear, new_cache, patch_gemv, patch_model, unpatch_gemv


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


def test_patching_twice_changes_nothing_and_a_model_without_linears_is_refused():
    model = patch_gemv(tiny_model("llama"))
    classes = [type(m) for m in model.modules()]
    assert [type(m) for m in patch_gemv(model).modules()] == classes
    with pytest.raises(ValueError, match="Embedding has no torch.nn.Linear layer"):
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
