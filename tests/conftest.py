"""Shared test set-up: the Triton interpreter on CPU, tiny random models of every architecture."""

import os

# Must precede any import of triton or of the kernels: Triton then runs on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect
import io

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import pnmix_patch.mixins

CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
"""The forward argument naming a cache in this transformers version (renamed in 5.24)."""

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
}


def tiny_model(architecture: str, seed: int = 0, **overrides):
    """A randomly initialized float32 model of ``architecture`` with tiny shapes."""
    config_class, model_class, extra = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    config = config_class(**(TINY | extra | overrides))
    model = model_class(config).eval()
    if architecture == "qwen2":  # q/k/v biases are zero at init: make them matter
        with torch.no_grad():
            for module in model.modules():
                for name in ("q_proj", "k_proj", "v_proj"):
                    if hasattr(module, name):
                        getattr(module, name).bias.normal_(0, 0.5)
    return model


def saved_and_loaded(model, monkeypatch):
    """``torch.save`` then ``torch.load`` of ``model``, loaded where the classes patching makes at run time
    were never made (a fresh process, simulated by emptying their registries for the test)."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    monkeypatch.setattr(pnmix_patch.mixins, "_MIXED", {})
    monkeypatch.setattr(pnmix_patch.mixins, "_PARTS", {})
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def output_cache(output):
    """The cache of a model or generate output (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def assert_left_padded_batch_generates_alone(model, pnmix_config, new_tokens: int = 12):
    """Patch ``model`` with ``pnmix_config``, generate greedily for a left-padded batch of a 300- and a
    230-token prompt (70 tokens of padding), and check each row against the prompt generated alone."""
    from pnmix_patch import patch_model, unpatch_model

    torch.manual_seed(0)
    long, short = torch.randint(0, 96, (1, 300)), torch.randint(0, 96, (1, 230))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 70, dtype=torch.long), short], 1)])
    mask = torch.cat([torch.ones(1, 300), torch.cat([torch.zeros(1, 70), torch.ones(1, 230)], 1)]).long()
    patch_model(model, pnmix_config)
    try:
        together = model.generate(batch, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        for row, ids in enumerate((long, short)):
            alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            assert torch.equal(together[row, -new_tokens:], alone[0, -new_tokens:])
    finally:
        unpatch_model(model)


@pytest.fixture(params=sorted(ARCHITECTURES))
def architecture(request):
    return request.param
