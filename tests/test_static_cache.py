"""The static PN-Mix cache: same results as the dynamic cache, compiled whole without breaks or recompiles."""

import re

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from test_cache import SMALL, chunk
from torch._dynamo.utils import counters
from transformers import CompileConfig

from pnmix_patch import PNMixLayer, PNMixStaticCache, PNMixStaticLayer, new_cache, patch_model
from pnmix_patch.static_cache import _DECODE_STATE

CONFIGS = {
    "small": SMALL,
    "no-sinks": SMALL.replace(sink_tokens=0, name="no-sinks"),
    "kivi-2": "kivi-2",
    "fp16": "fp16",
}


def run_layer(layer, prompt, steps, seed=3):
    """Prefill a left-padded prompt, then decode ``steps`` tokens one at a time."""
    query, key, value = chunk(2, 2, prompt + steps, 32, seed)
    valid = torch.ones(2, prompt, dtype=torch.bool)
    valid[1, :7] = False
    outputs = [layer.attend(query[:, :, :prompt], key[:, :, :prompt], value[:, :, :prompt], valid, 0.2)]
    for t in range(prompt, prompt + steps):
        outputs.append(layer.attend(query[:, :, t : t + 1], key[:, :, t : t + 1], value[:, :, t : t + 1], None, 0.2))
    return torch.cat(outputs, 2)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_layer_matches_dynamic_layer(name):
    """Same outputs and the same packed codes over prefill and decode steps crossing flushes."""
    from pnmix_patch.config import resolve_config

    config = resolve_config(CONFIGS[name])
    dynamic, static = PNMixLayer(config), PNMixStaticLayer(config, max_cache_len=400)
    torch.testing.assert_close(run_layer(static, 90, 300), run_layer(dynamic, 90, 300), rtol=0, atol=1e-6)
    for length in ("sink_len", "residual_len", "num_groups"):
        assert torch.equal(getattr(static, length), getattr(dynamic, length)), length
    used = int(dynamic.num_groups.max())
    group = config.key_group_size
    for part in ("key_codes_high", "key_codes_low", "key_scale", "key_zero"):
        assert torch.equal(getattr(static, part)[:, :, :used], getattr(dynamic, part)[:, :, :used]), part
    assert torch.equal(static.value_codes[:, :, : used * group], dynamic.value_codes[:, :, : used * group])
    assert static.get_seq_length().item() == dynamic.get_seq_length() == 390


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
)
def test_decode_steps_norm_and_rotate_in_the_append_and_match_the_dynamic_cache(architecture, device, monkeypatch):
    """Every architecture: a static cache's decode steps hand the query and key to
    ``pnmix::decode_rotate_append`` before the q/k norms (Qwen3) and RoPE, and give the logits of the
    dynamic cache, whose path runs the modules' own norms (random weights) and RoPE, over 300 steps with
    flushes (float32). On CUDA the append and attention kernels against the dynamic cache's PyTorch code,
    with the cache unquantized (``fp16`` preset): a key one rounding apart there may flip a quantized code.
    On CPU the op runs the reference, which repeats the modules' operations."""
    from pnmix_patch import static_cache

    calls = []

    def counting(*args):
        calls.append(args[5] is not None)  # the q/k norm weights, given for Qwen3 only
        return fused(*args)

    fused = static_cache.decode_rotate_append
    monkeypatch.setattr(static_cache, "decode_rotate_append", counting)
    model = patch_model(tiny_model(architecture).to(device), SMALL if device == "cpu" else "fp16")
    randomize_qk_norms(model)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0)).to(device)
    steps = 300
    logits, tokens = {}, []  # the dynamic cache's greedy tokens, fed to both (a near tie cannot fork them)
    for kind, cache in (("dynamic", new_cache(model)), ("static", new_cache(model, prompt.shape[1] + steps, static=True))):
        with torch.no_grad():
            token, rows = model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1), []
            for step in range(steps):
                rows.append(model(input_ids=tokens[step] if kind == "static" else token, **{CACHE_KWARG: cache}).logits[:, -1])
                if kind == "dynamic":
                    tokens.append(token)
                    token = rows[-1].argmax(-1, keepdim=True)
        logits[kind] = torch.stack(rows)
    torch.testing.assert_close(logits["static"], logits["dynamic"], rtol=0, atol=1e-5 if device == "cpu" else 1e-4)
    assert len(calls) == steps * model.config.num_hidden_layers and set(calls) == {architecture == "qwen3"}


def randomize_qk_norms(model) -> None:
    """Qwen3's q/k norm weights start as ones: make them differ from each other and from ones."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.copy_(1 + torch.randn(parameter.shape, generator=generator) / 4)


def test_storage_is_preallocated_and_keeps_its_addresses():
    layer = PNMixStaticLayer(SMALL, max_cache_len=4 + 64 * 3 + 1)
    query, key, value = chunk(2, 2, 10, 32, 0)
    layer.attend(query, key, value, None, 0.2)
    addresses = {name: tensor.data_ptr() for name, tensor in layer._storage.items()}
    assert layer.group_capacity == 6  # three flushes of 64 tokens into 32-token groups
    for t in range(4 + 64 * 3 + 1 - 10):
        q, k, v = chunk(2, 2, 1, 32, t + 1)
        layer.attend(q, k, v, None, 0.2)
    assert layer.num_groups.tolist() == [6, 6] and layer.residual_len.tolist() == [1, 1]
    assert {name: getattr(layer, name).data_ptr() for name in layer._storage} == addresses
    with pytest.raises(ValueError, match="max_cache_len=197"):
        layer.attend(q, k, v, None, 0.2)
    layer.reset()
    assert layer.get_seq_length().item() == 0 and not layer.prefilled
    layer.attend(query, key, value, None, 0.2)
    assert {name: getattr(layer, name).data_ptr() for name in layer._storage} == addresses


def test_outgrowing_the_storage_in_a_compiled_step_gives_nan():
    """A compiled step cannot raise: a sequence past the storage reads NaN, the others are unaffected."""
    layer = PNMixStaticLayer(SMALL, max_cache_len=4 + 64 + 1)
    query, key, value = chunk(2, 2, 5 + 64, 32, 0)
    valid = torch.ones(2, 5 + 64, dtype=torch.bool)
    valid[1, :60] = False  # sequence 1 holds 9 tokens, sequence 0 a full storage but for 63 residual slots
    layer.attend(query, key, value, valid, 0.2)
    for seed in range(64):  # bypass the eager max_cache_len check, as a compiled step does
        output = layer._decode_step(*chunk(2, 2, 1, 32, seed), 0.2)
    assert layer.overflowed.tolist() == [True, False]
    assert output[0].isnan().all() and not output[1].isnan().any()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs max_cache_len"):
        PNMixStaticCache(tiny_model("llama").config)
    with pytest.raises(ValueError, match="max_cache_len, a positive int; got 0"):
        PNMixStaticLayer(SMALL, max_cache_len=0)
    layer = PNMixStaticLayer(SMALL, max_cache_len=100)
    layer.attend(*chunk(2, 2, 10, 32, 0), None, 0.2)
    with pytest.raises(ValueError, match="keeps its batch size 2; got 3 indices"):
        layer.batch_select_indices(torch.tensor([0, 1, 1]))


def greedy(forward, model, cache, prompt, steps):
    """Greedy tokens: prefill eagerly, then ``steps`` decode steps through ``forward``."""
    with torch.no_grad():
        logits = model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1]
        tokens = [logits.argmax(-1, keepdim=True)]
        for _ in range(steps):
            logits = forward(input_ids=tokens[-1], **{CACHE_KWARG: cache}).logits[:, -1]
            tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("architecture, steps", [("llama", 2000), ("qwen3", 300)])
def test_compiled_decode_step_has_no_graph_break_and_no_recompile(architecture, steps):
    """2,000 decode steps (31 flushes; Qwen3, whose q/k norms run in the append kernel with random
    weights: 300) through ``torch.compile(fullgraph=True)``: one graph, compiled once, the same greedy
    tokens as eager decoding with the dynamic cache."""
    model = patch_model(tiny_model(architecture), SMALL)
    randomize_qk_norms(model)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, mode="default")
    tokens = greedy(compiled, model, new_cache(model, prompt.shape[1] + steps, static=True), prompt, steps)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["stats"]["calls_captured"] > 0 and sum(counters["recompiles"].values()) == 0
    assert torch.equal(tokens, greedy(model.forward, model, new_cache(model), prompt, steps))


def test_generate_static_cache_compiles_once_and_matches_eager():
    """``generate(cache_implementation="static")`` gets a static PN-Mix cache, runs its compiled
    decode path (``compile_config``; on CPU ``_compile_all_devices``), and reuses it on the next call."""
    model = patch_model(tiny_model("llama"), SMALL)
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    expected = model.generate(prompt, attention_mask=mask, max_new_tokens=150, do_sample=False)
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        output = model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=150,
            do_sample=False,
            cache_implementation="static",
            compile_config=compile_config,
            return_dict_in_generate=True,
        )
        assert torch.equal(output.sequences, expected)
    cache = output.cache if hasattr(output, "cache") else output.past_key_values
    assert isinstance(cache, PNMixStaticCache)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}


def test_memory_report_counts_the_preallocated_storage():
    model = patch_model(tiny_model("llama"), SMALL)
    prompt = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(0))
    static, dynamic = new_cache(model, 1000, static=True), new_cache(model)
    with torch.no_grad():
        model(input_ids=prompt, **{CACHE_KWARG: static})
        model(input_ids=prompt, **{CACHE_KWARG: dynamic})
    static_report, dynamic_report = static.memory_report(), dynamic.memory_report()
    # layers x batch x heads x groups x G x head_dim: 15 flushes of 64 tokens fit in 1000 positions
    assert static_report["quantized_elements"] == 2 * 1 * 2 * 30 * 32 * 32
    assert static_report["total_bytes"] > dynamic_report["total_bytes"]
    # the same codes and scales per element; masks add the stored channel order (int64 per channel)
    assert 0 < static_report["key_bits_per_element"] - dynamic_report["key_bits_per_element"] < 0.1


def test_per_group_reselection_is_refused():
    with pytest.raises(ValueError, match="reselection='per_group'"):
        PNMixStaticLayer(SMALL.replace(reselection="per_group"), max_cache_len=100)


def test_fields_are_stacked_over_layers_and_the_compiled_step_takes_the_stacks():
    """Each field is one tensor over the layers (a layer holds views of its slot), and the compiled
    decode step's graph takes the stacked tensors of the fields it reads, not one per layer."""
    model = patch_model(tiny_model("llama"), SMALL)
    cache = new_cache(model, 96, static=True)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        token = model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
    stacks = cache.layers[0].stack.tensors
    assert len(cache.layers) > 1 and all(layer.stacked and layer._stacks is stacks for layer in cache.layers)
    for name, stacked in stacks.items():
        assert stacked.shape[0] == len(cache.layers)
        assert [getattr(layer, name).data_ptr() for layer in cache.layers] == [slot.data_ptr() for slot in stacked]
    inputs = []

    def recording_backend(graph, example_inputs):
        inputs.extend(example_inputs)
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.forward, fullgraph=True, backend=recording_backend)(input_ids=token, **{CACHE_KWARG: cache})
    by_storage = {tensor.untyped_storage().data_ptr(): name for name, tensor in stacks.items()}
    cache_inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in by_storage]
    assert sorted(by_storage[t.untyped_storage().data_ptr()] for t in cache_inputs) == sorted(_DECODE_STATE)
    assert all(t.shape == stacks[by_storage[t.untyped_storage().data_ptr()]].shape for t in cache_inputs)
    cache.reset()  # an emptied cache meets a new batch size: every layer adopts into one new stack
    with torch.no_grad():
        model(input_ids=prompt[:1], **{CACHE_KWARG: cache})
    restacked = cache.layers[0]._stacks
    assert restacked is not stacks and restacked["sink_keys"].shape[1] == 1
    assert all(layer.stacked and layer._stacks is restacked for layer in cache.layers)


def stacked_cache(layer_devices=None, layers=4):
    config = tiny_model("llama", num_hidden_layers=layers).config
    return PNMixStaticCache(config, SMALL, max_cache_len=96, layer_devices=layer_devices)


def test_each_device_gets_one_stack_of_its_layers_whatever_order_they_allocate_in():
    cache = stacked_cache(["cpu", "meta", "cpu", "meta"])
    first, second, third, fourth = cache.layers
    assert first.stack is third.stack and second.stack is fourth.stack and first.stack is not second.stack
    assert [layer.stack_index for layer in cache.layers] == [0, 0, 1, 1]
    query, key, value = chunk(2, 2, 10, 32, 0)
    third.attend(query, key, value, None, 0.2)  # the first to allocate need not be the first layer
    first.attend(query, key, value, None, 0.2)
    stacks = first.stack.tensors
    assert stacks["sink_keys"].shape[0] == 2 and first._stacks is stacks and third._stacks is stacks
    assert third.sink_keys.data_ptr() == stacks["sink_keys"][1].data_ptr()
    assert first.sink_keys.data_ptr() == stacks["sink_keys"][0].data_ptr()
    with pytest.raises(ValueError, match="names 3 devices; the model has 4 layers"):
        stacked_cache(["cpu"] * 3)


def test_a_layer_unlike_its_stack_keeps_its_own_tensors_with_a_warning():
    cache = stacked_cache(layers=2)
    cache.layers[0].attend(*chunk(2, 2, 10, 32, 0), None, 0.2)
    with pytest.warns(UserWarning, match="keeps tensors of its own"):
        cache.layers[1].attend(*chunk(1, 2, 10, 32, 0), None, 0.2)
    assert cache.layers[0].stacked and not cache.layers[1].stacked and cache.layers[1].sink_keys.shape[0] == 1


def test_a_new_batch_size_frees_the_old_stacks_and_needs_every_layer_empty():
    import weakref

    cache = stacked_cache(layers=2)
    for layer in cache.layers:
        layer.attend(*chunk(2, 2, 10, 32, 0), None, 0.2)
    old = weakref.ref(cache.layers[0].stack.tensors["value_codes"])
    cache.layers[0].reset()  # layer 1 still holds tokens
    with pytest.raises(ValueError, match="only when every layer is empty"):
        cache.layers[0].attend(*chunk(1, 2, 10, 32, 0), None, 0.2)
    cache.reset()
    cache.layers[0].attend(*chunk(1, 2, 10, 32, 0), None, 0.2)
    assert old() is None  # freed before layer 1 allocates again
    cache.layers[1].attend(*chunk(1, 2, 10, 32, 0), None, 0.2)
    assert all(layer.stacked and layer.batch_size == 1 for layer in cache.layers)


def test_a_dropped_cache_frees_its_storage_without_the_cyclic_garbage_collector():
    """The layers and their stack reference each other only weakly one way: deleting the cache frees
    the stacked storage at once, as for any tensor (a serving loop that drops one cache and makes a
    larger one must not hold both)."""
    import gc
    import weakref

    cache = stacked_cache(layers=2)
    for layer in cache.layers:
        layer.attend(*chunk(2, 2, 10, 32, 0), None, 0.2)
    stacks, layer = weakref.ref(cache.layers[0].stack.tensors["value_codes"]), weakref.ref(cache.layers[1])
    gc.disable()
    try:
        del cache
        assert stacks() is None and layer() is None
    finally:
        gc.enable()


def test_the_static_storage_refuses_to_grow():
    layer = stacked_cache(layers=1).layers[0]
    layer.attend(*chunk(2, 2, 10, 32, 0), None, 0.2)
    with pytest.raises(ValueError, match="cannot grow in place"):
        layer._reserve_groups(layer.group_capacity + 1)


def test_new_cache_groups_the_layers_by_the_device_of_their_weights():
    model = patch_model(tiny_model("llama", num_hidden_layers=3), SMALL)
    cache = new_cache(model, 96, static=True)
    assert cache.layer_devices == [torch.device("cpu")] * 3 and cache.layers[0].stack.layers == cache.layers
    model.model.layers[1].to("meta")
    cache = new_cache(model, 96, static=True)
    assert cache.layer_devices == [torch.device("cpu"), torch.device("meta"), torch.device("cpu")]
    assert cache.layers[0].stack.layers == [cache.layers[0], cache.layers[2]] and cache.layers[1].stack.layers == [cache.layers[1]]
    assert [layer.stack_index for layer in cache.layers] == [0, 0, 1]
    copied = PNMixStaticCache(model.config, SMALL, max_cache_len=96, layer_devices=stacked_cache(layers=3).layer_devices)
    assert copied.layer_devices == [None] * 3  # the default's devices round-trip


def aliasing_tests(model, cache, token) -> int:
    """How many object-identity tests (``a is b``, evaluated in Python on every call) Dynamo's guards
    of the compiled decode step make on its arguments."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.forward, fullgraph=True, backend="eager")(input_ids=token, **{CACHE_KWARG: cache})
    function = model.forward.__func__
    while not _debug_get_cache_entry_list(function.__code__):
        function = function.__wrapped__
    guards = str(_debug_get_cache_entry_list(function.__code__)[0].guard_manager)
    return len(re.findall(r"LAMBDA_GUARD: L\[.*? is L\[", guards))


def test_the_compiled_step_checks_few_shared_objects_per_layer():
    """Every object that two layers share costs one Python ``is`` test per layer and call: per layer,
    the decode step makes one, for the shared stacks, as bf16's StaticCache step makes one, for the model
    config (a ``forward`` bound on each attention module made a second: patching changes classes)."""
    counts = []
    for layers in (2, 3):
        model = patch_model(tiny_model("llama", num_hidden_layers=layers), SMALL)
        cache = new_cache(model, 96, static=True)
        prompt = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            token = model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        counts.append(aliasing_tests(model, cache, token))
    assert counts[1] - counts[0] == 1, counts  # the stacks
