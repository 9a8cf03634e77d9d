"""GraphedDecodeStep: the same greedy tokens as eager decoding, on CPU (compiled step) and CUDA (replayed graph)."""

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from test_cache import SMALL
from test_static_cache import greedy
from transformers import StaticCache

from pnmix_patch import GraphedDecodeStep, new_cache, patch_model

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def graphed_greedy(model, cache, prompt, steps, warmup_steps=2):
    """Greedy tokens: prefill eagerly, then ``steps`` decode steps through a GraphedDecodeStep."""
    step = GraphedDecodeStep(model, cache, warmup_steps=warmup_steps)
    with torch.no_grad():
        tokens = [model(input_ids=prompt, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)]
        for _ in range(steps):
            tokens.append(step(tokens[-1])[:, -1:].argmax(-1))
    return torch.cat(tokens, 1), step


def test_cpu_step_runs_the_compiled_forward_and_matches_eager():
    """On CPU no graph is captured; 300 steps (several flushes) give eager's greedy tokens."""
    model = patch_model(tiny_model("llama"), SMALL)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    tokens, step = graphed_greedy(model, new_cache(model, prompt.shape[1] + 300, static=True), prompt, 300)
    assert not step.captured
    assert torch.equal(tokens, greedy(model.forward, model, new_cache(model), prompt, 300))


def test_bad_arguments_are_named():
    model = patch_model(tiny_model("llama"), SMALL)
    cache = new_cache(model, 64, static=True)
    with pytest.raises(ValueError, match="warmup_steps=0: allowed an int >= 1"):
        GraphedDecodeStep(model, cache, warmup_steps=0)
    step = GraphedDecodeStep(model, cache, compile=False)
    with pytest.raises(TypeError, match="int64 tensor"):
        step(torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \[batch, 1\].*got \[2, 3\]"):
        step(torch.zeros(2, 3, dtype=torch.long))
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 8, dtype=torch.long), **{CACHE_KWARG: cache})
    step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"of shape \[1, 1\]: this step was built for \[2, 1\]"):
        step(torch.zeros(1, 1, dtype=torch.long))


@requires_cuda
@pytest.mark.parametrize("kind", ["pnmix", "bf16-static"])
def test_cuda_graph_replays_match_the_compiled_step(kind):
    """On CUDA the graph is captured after the warm-up and replayed; 300 steps (crossing residual
    flushes for PN-Mix) give the same greedy tokens as the same compiled step called directly
    (the same kernels, so the same floats; eager code would round differently)."""
    model = tiny_model("llama").to("cuda")
    if kind == "pnmix":
        patch_model(model, SMALL)
    prompt = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0)).to("cuda")
    positions = prompt.shape[1] + 300

    def cache():
        return new_cache(model, positions, static=True) if kind == "pnmix" else StaticCache(config=model.config, max_cache_len=positions)

    torch._dynamo.reset()
    tokens, step = graphed_greedy(model, cache(), prompt, 300)
    assert step.captured
    compiled = torch.compile(model.forward, fullgraph=True)
    assert torch.equal(tokens, greedy(compiled, model, cache(), prompt, 300))
