"""``patch_gemv``: one-token products through ``pnmix::gemv`` (q/k/v stacked, gate/up fused), alone and with PN-Mix, eager and compiled."""

import pytest
import torch
from conftest import CACHE_KWARG, output_cache, saved_and_loaded, tiny_model
from test_cache import SMALL
from torch._dynamo.utils import counters

import pnmix_patch.linear
from pnmix_patch import GemvLinear, new_cache, patch_gemv, patch_model, unpatch_gemv
from pnmix_patch.kernels.gemv import triton_gemv, triton_gemv_stacked
from pnmix_patch.kernels.gemv_swiglu import triton_gemv_swiglu
from pnmix_patch.linear import GemvGatedMLP, stacked_products

OPS = ("gemv", "gemv_stacked", "gemv_swiglu")


def counting_ops(monkeypatch, launchers=None) -> list:
    """Record each call of the three ops (name, first weight's shape); ``launchers`` (name -> function)
    replaces an op's implementation (the Triton launchers, interpreted)."""
    calls = []
    for name in OPS:
        run = (launchers or {}).get(name, getattr(pnmix_patch.linear, name))

        def counted(x, weights, *rest, name=name, run=run):
            calls.append((name, tuple((weights[0] if name == "gemv_stacked" else weights).shape)))
            return run(x, weights, *rest)

        monkeypatch.setattr(pnmix_patch.linear, name, counted)
    return calls


@pytest.mark.parametrize("pnmix", [False, True], ids=["own-attention", "pnmix"])
def test_one_token_products_go_through_the_ops_and_give_the_same_tokens(architecture, pnmix, monkeypatch):
    model = tiny_model(architecture)
    if pnmix:
        patch_model(model, SMALL)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    mlp_class = type(model.model.layers[0].mlp)
    calls = counting_ops(monkeypatch)
    assert patch_gemv(model) is model and sum(type(m) is GemvLinear for m in model.modules()) == linears
    assert all(isinstance(layer.mlp, GemvGatedMLP) for layer in model.model.layers)
    output = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(output, expected)
    # The prefill's products (12 tokens) go to F.linear, except the LM head's (generate keeps the last
    # token's logits). Each of the 5 decode steps: per layer, gate/up/SiLU in one launch, q/k/v in one
    # under PN-Mix's attention (three under the model's own), then o and down; and the LM head.
    layers = len(model.model.layers)
    want = {"gemv": 5 * layers * (2 if pnmix else 5) + 6, "gemv_stacked": 5 * layers if pnmix else 0, "gemv_swiglu": 5 * layers}
    assert {name: sum(n == name for n, _ in calls) for name in OPS} == want
    assert calls.count(("gemv", tuple(model.lm_head.weight.shape))) == 6
    unpatch_gemv(model)
    assert not any(type(m) is GemvLinear for m in model.modules())
    assert all(type(layer.mlp) is mlp_class for layer in model.model.layers)
    calls.clear()
    model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert calls == []


@pytest.mark.parametrize("architecture, overrides", [("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_the_triton_kernels_in_the_model_give_the_same_logits(architecture, overrides, monkeypatch):
    """The ops' CPU implementations are the model's own arithmetic: here the Triton kernels
    (interpreted) serve a PN-Mix decode step, biases on q/k/v (and on the MLP for Llama)."""
    model = patch_model(tiny_model(architecture, **overrides), SMALL)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))

    def last_logits():
        cache = output_cache(model(prompt[:, :-1], use_cache=True))
        return model(prompt[:, -1:], **{CACHE_KWARG: cache}).logits

    with torch.no_grad():
        want = last_logits()
        patch_gemv(model)
        calls = counting_ops(monkeypatch, {"gemv": triton_gemv, "gemv_stacked": triton_gemv_stacked, "gemv_swiglu": triton_gemv_swiglu})
        got = last_logits()
    assert {name for name, _ in calls} == set(OPS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_fused_ops_only_where_no_gradient_is_needed(monkeypatch):
    """The stacked and SwiGLU ops have no backward: with gradients wanted each layer keeps its own
    product (``pnmix::gemv``, which has one), and gradients reach the weights."""
    model = patch_gemv(tiny_model("llama"))
    attention = model.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    token = torch.randint(0, 96, (1, 1), generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(1, 1, model.config.hidden_size)
    calls = counting_ops(monkeypatch)
    model(token).logits.sum().backward()
    sum(y.sum() for y in stacked_products(hidden, projections)).backward()
    assert {name for name, _ in calls} == {"gemv"}
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None and attention.v_proj.weight.grad is not None
    calls.clear()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model(token)
    stacked = stacked_products(hidden, projections)
    assert {name for name, _ in calls} == set(OPS)
    for got, projection in zip(stacked, projections):
        torch.testing.assert_close(got, torch.nn.functional.linear(hidden, projection.weight, projection.bias))


def test_hooked_layers_are_called_one_by_one(monkeypatch):
    """A fused launch never calls the layers: where one has a forward hook (a user's, accelerate's),
    its layer's products are not fused, and the hooks run."""
    model = patch_gemv(patch_model(tiny_model("llama"), SMALL))
    hooked = model.model.layers[0]
    seen = []
    for projection in (hooked.self_attn.k_proj, hooked.mlp.gate_proj):
        projection.register_forward_hook(lambda module, args, output: seen.append(output.shape[-1]))
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = output_cache(model(prompt[:, :-1], use_cache=True))
        seen.clear()
        calls = counting_ops(monkeypatch)
        model(prompt[:, -1:], **{CACHE_KWARG: cache})
    assert seen == [hooked.self_attn.k_proj.out_features, hooked.mlp.gate_proj.out_features]
    layers = len(model.model.layers)
    assert sum(name == "gemv_stacked" for name, _ in calls) == sum(name == "gemv_swiglu" for name, _ in calls) == layers - 1


def test_accelerate_cpu_offload_gives_the_same_logits():
    """accelerate's CPU offload keeps the weights on the meta device until a layer's own hook moves
    them in: a fused launch would read meta tensors."""
    accelerate = pytest.importorskip("accelerate")
    model = patch_model(tiny_model("qwen3"), SMALL)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(7))

    def last_logits():
        with torch.no_grad():
            cache = output_cache(model(prompt[:, :-1], use_cache=True))
            return model(prompt[:, -1:], **{CACHE_KWARG: cache}).logits

    want = last_logits()
    accelerate.cpu_offload(patch_gemv(model), execution_device=torch.device("cpu"))
    assert model.model.layers[0].mlp.gate_proj.weight.device.type == "meta"
    torch.testing.assert_close(last_logits(), want)
    # Offloaded first, patched after: each layer's hook still moves its weights in, around the new forward.
    unpatch_gemv(model)
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    torch.testing.assert_close(last_logits(), want)
    patch_gemv(model)
    gate = model.model.layers[0].mlp.gate_proj
    assert type(gate) is GemvLinear and gate._old_forward.__func__ is GemvLinear.forward  # what the hook calls
    torch.testing.assert_close(last_logits(), want)


def test_more_layers_than_a_launch_stacks_are_called_one_by_one(monkeypatch):
    layers = [patch_gemv(torch.nn.Linear(8, rows)) for rows in (1, 2, 3, 4)]
    x = torch.randn(1, 8)
    calls = counting_ops(monkeypatch)
    with torch.no_grad():
        got = stacked_products(x, layers)
    assert [name for name, _ in calls] == ["gemv"] * 4
    for y, layer in zip(got, layers):
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_module_with_a_config_of_no_known_architecture():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.config = {"model_type": "llama"}  # not a transformers config
    assert type(patch_gemv(model)[0]) is GemvLinear


def test_an_mlp_without_silu_keeps_its_class():
    model = patch_gemv(tiny_model("llama", hidden_act="gelu"))
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)
    assert type(model.model.layers[0].mlp.gate_proj) is GemvLinear


def test_autocast_other_dtypes_and_tensor_subclasses_keep_f_linear(monkeypatch):
    calls = counting_ops(monkeypatch)
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
    assert calls == [("gemv", (4, 8))]


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


def test_a_patched_model_pickles_and_loads_patched(monkeypatch):
    """``torch.save`` of a model patched by ``patch_gemv`` (its MLP class made at run time): it loads with
    the same classes and logits, also where the ``Gemv<MLP>`` class was never made (a fresh process,
    simulated by an empty registry)."""
    model = patch_gemv(tiny_model("llama"))
    ids = torch.randint(3, 96, (1, 12))
    loaded = saved_and_loaded(model, monkeypatch)
    mlp = loaded.model.layers[0].mlp
    assert type(mlp).__name__ == "GemvLlamaMLP" and isinstance(mlp, GemvGatedMLP)
    assert type(loaded.model.layers[0].self_attn.q_proj) is GemvLinear
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


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
