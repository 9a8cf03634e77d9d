"""GraphedDecodeStep: the same greedy tokens as eager decoding, on CPU (compiled step) and CUDA (replayed graph)."""

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from test_cache import SMALL
from test_static_cache import greedy
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

import pnmix_patch.api
from pnmix_patch import PRESETS, GraphedDecodeStep, graphed_decode, new_cache, patch_gemv, patch_model
from pnmix_patch.api import patch_state
from pnmix_patch.kernels import common

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def graphed_greedy(step, model, cache, prompt, steps):
    """Greedy tokens: prefill eagerly, then ``steps`` decode steps through ``step``; also the
    addresses of the logits it returned."""
    addresses = []
    with torch.no_grad():
        tokens = [model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)]
        for _ in range(steps):
            logits = step(tokens[-1])
            addresses.append(logits.data_ptr())
            tokens.append(logits[:, -1:].argmax(-1))
    return torch.cat(tokens, 1), addresses


def test_cpu_step_is_the_compiled_forward_and_matches_eager():
    """On CPU a call runs the compiled step (one graph, no break); 300 steps (several flushes)
    give eager's greedy tokens."""
    model = patch_model(tiny_model("llama"), SMALL)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    cache = new_cache(model, prompt.shape[1] + 300, static=True)
    tokens, _ = graphed_greedy(GraphedDecodeStep(model, cache), model, cache, prompt, 300)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
    assert torch.equal(tokens, greedy(model.forward, model, new_cache(model), prompt, 300))


def test_bad_arguments_are_named():
    model = patch_model(tiny_model("llama"), SMALL)
    cache = new_cache(model, 64, static=True)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"warmup_steps={bad!r}: allowed an int >= 1"):
            GraphedDecodeStep(model, cache, warmup_steps=bad)
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match=f"pdl={bad!r}: allowed None"):
            GraphedDecodeStep(model, cache, pdl=bad)
    with pytest.raises(ValueError, match="pdl=True: the token ids are on cpu; programmatic dependent launch needs a CUDA GPU"):
        GraphedDecodeStep(model, cache, pdl=True)(torch.zeros(2, 1, dtype=torch.long))
    step = GraphedDecodeStep(model, cache)
    with pytest.raises(TypeError, match="int64 tensor"):
        step(torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \[batch, 1\].*got \[2, 3\]"):
        step(torch.zeros(2, 3, dtype=torch.long))
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 8, dtype=torch.long), **{CACHE_KWARG: cache})
    assert step.pdl is None
    step(torch.zeros(2, 1, dtype=torch.long))
    assert step.pdl is False  # decided at the first call: not on a GPU
    with pytest.raises(ValueError, match=r"of shape \[1, 1\] on cpu: this step was built for \[2, 1\] on cpu"):
        step(torch.zeros(1, 1, dtype=torch.long))
    for batch in (1, 2):  # another batch size in between: the cache allocates its storage again
        cache.reset()
        with torch.no_grad():
            model(input_ids=torch.zeros(batch, 8, dtype=torch.long), **{CACHE_KWARG: cache})
    with pytest.raises(RuntimeError, match="allocated its storage again since this step was built"):
        step(torch.zeros(2, 1, dtype=torch.long))


def compile_options(monkeypatch) -> list:
    """The ``options`` of every ``torch.compile`` call from now on (the real compile still runs)."""
    compile_, options = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: options.append(kwargs.get("options")) or compile_(*args, **kwargs))
    return options


def test_inductor_compiles_the_step_with_its_pdl_switch_as_the_step_decided(monkeypatch):
    """The step compiles at its first call, with Inductor's ``triton.enable_pdl`` set to the step's own
    decision (off on CPU), whatever the global setting says."""
    model = patch_model(tiny_model("llama"), SMALL)
    cache = new_cache(model, 64, static=True)
    options = compile_options(monkeypatch)
    step = GraphedDecodeStep(model, cache)
    assert options == []
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), **{CACHE_KWARG: cache})
    step(torch.zeros(1, 1, dtype=torch.long))
    assert options == [{"triton.enable_pdl": False}] and step.pdl is False


@requires_cuda
@pytest.mark.parametrize("kind", ["pnmix", "bf16-static"])
def test_cuda_graph_replays_match_the_compiled_step(kind):
    """On CUDA the graph is captured after the warm-up and replayed (the logits stay at one
    address from the capture on); 300 steps (crossing residual flushes for PN-Mix) give the same
    greedy tokens as the same compiled step called directly (the same kernels, so the same
    floats; eager code would round differently). PN-Mix: after ``reset()`` and a new prefill the
    same graph decodes the new prompt as a fresh compiled step does."""
    model = tiny_model("llama").to("cuda")
    if kind == "pnmix":
        patch_model(model, SMALL)
    prompts = [torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(s)).to("cuda") for s in (0, 1)]
    positions = prompts[0].shape[1] + 300

    def fresh_cache():
        return new_cache(model, positions, static=True) if kind == "pnmix" else StaticCache(config=model.config, max_cache_len=positions)

    torch._dynamo.reset()
    cache = fresh_cache()
    step = GraphedDecodeStep(model, cache, warmup_steps=2)
    tokens, addresses = graphed_greedy(step, model, cache, prompts[0], 300)
    assert step.captured and len(set(addresses[2:])) == 1 and addresses[1] != addresses[2]
    compiled = torch.compile(model.forward, fullgraph=True)
    assert torch.equal(tokens, greedy(compiled, model, fresh_cache(), prompts[0], 300))
    if kind == "pnmix":
        cache.reset()
        again, _ = graphed_greedy(step, model, cache, prompts[1], 100)
        assert torch.equal(again, greedy(compiled, model, fresh_cache(), prompts[1], 100))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a GPU of compute capability 9.0 or newer",
)
@pytest.mark.parametrize("config", [SMALL, PRESETS["pnmix-1"]], ids=["triton-split-kernel", "gluon-split-kernel"])
def test_graphs_with_programmatic_dependent_launch_give_the_floats_of_graphs_without(monkeypatch, config):
    """A PN-Mix model with the fused one-token products, its graph captured with the step's kernels (the
    library's and Inductor's) launched with PDL (``GraphedDecodeStep``'s default on this GPU) and without:
    300 steps (flushes included) give the same logits bit for bit. ``SMALL``'s 32-token groups take the
    Triton split kernel, ``pnmix-1``'s the Gluon one. A kernel reading before the previous one's writes are
    visible would (likely) change them."""
    model = tiny_model(
        "llama",
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ).to("cuda", torch.bfloat16)
    patch_gemv(patch_model(model, config))
    prompt = torch.randint(0, 2048, (1, 200), generator=torch.Generator().manual_seed(0)).to("cuda")
    has_pdl, pdl_launches = common.has_pdl, []
    monkeypatch.setattr(common, "has_pdl", lambda index: pdl_launches.append(index) or has_pdl(index))
    options = compile_options(monkeypatch)
    logits, library_default = {}, common.PDL
    for pdl in (False, None):
        torch._dynamo.reset()
        cache = new_cache(model, prompt.shape[1] + 300, static=True)
        step = GraphedDecodeStep(model, cache, warmup_steps=2, pdl=pdl)
        with torch.no_grad():
            token = model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
            steps = [step(token).clone()]  # compiles, having asked has_pdl
            assert step.pdl == (pdl is None) and options[-1] == {"triton.enable_pdl": step.pdl}  # Inductor's switch too
            pdl_launches.clear()
            token = steps[-1][:, -1:].argmax(-1)
            for _ in range(299):
                steps.append(step(token).clone())
                token = steps[-1][:, -1:].argmax(-1)
        assert step.captured and bool(pdl_launches) == step.pdl  # with PDL, the library's launches asked for it
        assert common.PDL == library_default  # the step's switch holds only around its own launches
        logits[step.pdl] = torch.cat(steps, 1)
    assert torch.equal(logits[True], logits[False])


def left_padded_prompt():
    prompt = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :7] = 0
    return prompt, mask


def test_generate_decode_steps_replay_one_graphed_step(monkeypatch):
    """``generate``'s compiled call (``mode="reduce-overhead"``) sends every decode step on a static PN-Mix
    cache through one GraphedDecodeStep (its capture stubbed on CPU: the compiled step runs instead), fed
    generate's positions: a left-padded batch gives eager generate's tokens. The step is reused by the next
    generate of the same batch and built again for another batch size."""
    monkeypatch.setattr(graphed_decode, "_captures_on", lambda device: True)
    calls = []
    own_call = GraphedDecodeStep.__call__
    monkeypatch.setattr(GraphedDecodeStep, "__call__", lambda self, *args: calls.append(self) or own_call(self, *args))
    model = patch_model(tiny_model("llama"), SMALL)
    model.generation_config.pad_token_id = 0
    prompt, mask = left_padded_prompt()
    settings = dict(max_new_tokens=40, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = model.generate(prompt, attention_mask=mask, **settings)
    compile_config = CompileConfig()  # mode="reduce-overhead": CUDA graphs wanted
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    for batch in (2, 2, 1):
        output = model.generate(
            prompt[:batch], attention_mask=mask[:batch], cache_implementation="static", compile_config=compile_config, **settings
        )
        assert torch.equal(output.sequences, expected.sequences[:batch])
        for logits, expected_logits in zip(output.logits, expected.logits):  # the padded row's positions count
            torch.testing.assert_close(logits, expected_logits[:batch], rtol=0, atol=1e-4)
    assert len(calls) == 3 * 39  # every decode step; the prefill runs eagerly
    assert len(set(calls[:78])) == 1 and calls[78] is not calls[0]
    assert patch_state(model).generate_call.failure is None


def test_generate_replays_write_one_logits_tensor_and_give_eager_tokens(monkeypatch):
    """Once the step is captured, generate's calls go straight to its replay, which writes the same logits
    tensor every time, and get one output object back. Simulated on CPU: "capture" at the first call, then a
    replay runs the step and copies its logits into the captured tensor. A left-padded batch still gives
    eager generate's tokens and logits, so no step reads a stale output."""
    monkeypatch.setattr(graphed_decode, "_captures_on", lambda device: True)
    replays, outputs = [], []

    def capture_at_first_call(self, input_ids, position_ids=None):
        self._compile(input_ids.device)
        self._input_ids, self._storage = input_ids.clone(), graphed_decode._storage_of(self.cache)
        self._position_ids = None if position_ids is None else position_ids.clone()
        self._logits = torch.full((input_ids.shape[0], 1, self.model.config.vocab_size), float("nan"))
        self._graph = True  # counts as captured
        return self._replay(input_ids, position_ids)

    def replay(self, input_ids, position_ids=None):
        replays.append(self)
        self._input_ids.copy_(input_ids)
        if position_ids is not None:
            self._position_ids.copy_(position_ids)
        self._logits.copy_(self._step(self._input_ids, self._position_ids))
        return self._logits

    monkeypatch.setattr(GraphedDecodeStep, "__call__", capture_at_first_call)
    monkeypatch.setattr(GraphedDecodeStep, "_replay", replay)
    own_call = graphed_decode.GraphedGenerateCall.__call__
    monkeypatch.setattr(
        graphed_decode.GraphedGenerateCall, "__call__", lambda self, **inputs: outputs.append(own_call(self, **inputs)) or outputs[-1]
    )
    model = patch_model(tiny_model("llama"), SMALL)
    model.generation_config.pad_token_id = 0
    prompt, mask = left_padded_prompt()
    settings = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = model.generate(prompt, **settings)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    output = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **settings)
    assert torch.equal(output.sequences, expected.sequences)
    for logits, expected_logits in zip(output.logits, expected.logits):
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-4)
    assert len(replays) == 29 and len(set(replays)) == 1
    assert len(outputs) == 29 and all(out is outputs[0] for out in outputs)


def test_generate_call_falls_back_with_a_warning_where_capture_fails(monkeypatch):
    monkeypatch.setattr(graphed_decode, "_captures_on", lambda device: True)

    def fail(self, *args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedDecodeStep, "__call__", fail)
    model = patch_model(tiny_model("llama"), SMALL)
    cache = new_cache(model, 64, static=True)
    with torch.no_grad():
        model(input_ids=torch.ones(2, 8, dtype=torch.long), **{CACHE_KWARG: cache})
    fallback_inputs = []
    call = graphed_decode.GraphedGenerateCall(model, lambda **inputs: fallback_inputs.append(inputs) or "fallback")
    inputs = {"input_ids": torch.ones(2, 1, dtype=torch.long), CACHE_KWARG: cache, "use_cache": True}
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph .RuntimeError: operation not permitted"):
        assert call(**inputs) == "fallback"
    assert call(**inputs) == "fallback" and len(fallback_inputs) == 2  # no second try
    other = graphed_decode.GraphedGenerateCall(model, lambda **inputs: "fallback")
    for unserved in ({"inputs_embeds": torch.ones(2, 1, 64)}, {"output_attentions": True}, {"logits_to_keep": 5}):
        assert other(**inputs, **unserved) == "fallback" and other.failure is None


def test_generate_refuses_a_too_small_static_cache_before_any_work():
    """A static PN-Mix cache passed to generate must hold the prompt and every generated token but the last."""
    model = patch_model(tiny_model("llama"), SMALL)
    model.generation_config.pad_token_id = 0
    prompt, mask = left_padded_prompt()
    small = new_cache(model, 40 + 25 - 2, static=True)
    with pytest.raises(ValueError, match=r"max_cache_len=63 positions; this generate call feeds it up to 64 .a prompt of 40 tokens"):
        model.generate(prompt, attention_mask=mask, max_new_tokens=25, do_sample=False, **{CACHE_KWARG: small})
    assert not small.layers[0].is_initialized  # refused before the prefill
    with pytest.raises(ValueError, match=r"max_cache_len=63 positions; this generate call feeds it up to 69 .max_length=70"):
        model.generate(prompt, attention_mask=mask, max_length=70, do_sample=False, **{CACHE_KWARG: small})
    enough = new_cache(model, 40 + 25 - 1, static=True)
    output = model.generate(prompt, attention_mask=mask, max_new_tokens=25, do_sample=False, **{CACHE_KWARG: enough})
    assert torch.equal(output, model.generate(prompt, attention_mask=mask, max_new_tokens=25, do_sample=False))


def test_generate_builds_no_mask_for_the_decode_steps_of_a_static_pnmix_cache(monkeypatch):
    """``generate`` on a static cache turns the 2-D mask into a 4-D one ahead of every step; the patched model
    passes none to the decode steps of a static PN-Mix cache (they read no mask: padding is recorded at
    prefill) and builds transformers' mask for the prefill only. A left-padded batch still gives the dynamic
    cache's tokens, eager and compiled."""
    built = []
    own = pnmix_patch.api.create_masks_for_generate
    monkeypatch.setattr(pnmix_patch.api, "create_masks_for_generate", lambda *args, **kwargs: built.append(1) or own(*args, **kwargs))
    model = patch_model(tiny_model("llama"), SMALL)
    model.generation_config.pad_token_id = 0
    prompt, mask = left_padded_prompt()
    settings = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    expected = model.generate(prompt, **settings)
    assert built == []  # a dynamic cache is not compilable: generate builds no mask ahead
    assert torch.equal(model.generate(prompt, cache_implementation="static", disable_compile=True, **settings), expected)
    assert built == [1]
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    assert torch.equal(model.generate(prompt, cache_implementation="static", compile_config=compile_config, **settings), expected)
    assert built == [1, 1]
