"""The capacity planner: cache and weight bytes equal what real caches and models allocate."""

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from transformers import StaticCache

from pnmix_patch import new_cache, patch_model
from pnmix_patch.planner import MODEL_SHAPES, CapacityPlanner, format_plan, model_config, parse_bytes


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("preset", ["pnmix-1", "pnmix-2", "kivi-2", "fp16"])
@pytest.mark.parametrize("positions", [40, 37 + 128, 700])
def test_pnmix_cache_bytes_equal_the_static_cache_allocation(model, preset, positions):
    patch_model(model, preset)
    cache = new_cache(model, max_cache_len=positions, static=True)
    with torch.no_grad():
        model(input_ids=torch.zeros(3, 20, dtype=torch.long), **{CACHE_KWARG: cache})
    planner = CapacityPlanner(model.config, dtype=torch.float32)
    assert planner.pnmix_cache_bytes(preset, 3, positions) == cache.memory_report()["total_bytes"]


def test_bf16_cache_and_weight_bytes_equal_real_allocations(model):
    model = tiny_model("llama").to(torch.bfloat16)
    cache = StaticCache(config=model.config, max_cache_len=300)
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 10, dtype=torch.long), **{CACHE_KWARG: cache})
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    planner = CapacityPlanner(model.config)
    assert planner.bf16_cache_bytes(2, 300) == allocated
    assert planner.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_largest_batch_and_longest_generation_are_the_edges_of_the_budget():
    planner = CapacityPlanner("qwen3-8b")
    budget = parse_bytes("40GiB")
    for preset in (None, "pnmix-1"):
        batch = planner.largest_batch(preset, 141, 8192, budget)
        assert planner.peak_bytes(preset, batch, 141, 8192) <= budget < planner.peak_bytes(preset, batch + 1, 141, 8192)
        longest = planner.longest_generation(preset, 32, 141, budget)
        assert planner.peak_bytes(preset, 32, 141, longest) <= budget < planner.peak_bytes(preset, 32, 141, longest + 1)
    plan = planner.plan("pnmix-1", 32, 141, 8192, budget)
    assert plan["pnmix-1"]["largest_batch"] > 5 * plan["bf16"]["largest_batch"]
    assert 6 < plan["cache_ratio"] < 7.5
    assert "largest batch" in format_plan(plan)


def test_bf16_attention_decides_the_expanded_keys_and_values():
    stock, gqa = CapacityPlanner("qwen3-8b"), CapacityPlanner("qwen3-8b", bf16_attention="gqa")
    # Stock transformers SDPA repeats one layer's keys and values to the 32 query heads over the cache.
    expanded = 2 * 19 * 32 * (141 + 8192) * 128 * 2
    assert stock.peak_bytes(None, 19, 141, 8192) - gqa.peak_bytes(None, 19, 141, 8192) == expanded
    assert stock.peak_bytes("pnmix-1", 19, 141, 8192) == gqa.peak_bytes("pnmix-1", 19, 141, 8192)
    assert gqa.plan("pnmix-1", 19, 141, 8192)["bf16_attention"] == "gqa"
    # Compiling needs room for a copy of the largest weight (the output embedding here).
    assert gqa.largest_matrix_bytes == 151936 * 4096 * 2
    assert gqa.working_bytes(1, 1, quantized=False) >= gqa.largest_matrix_bytes
    with pytest.raises(ValueError, match="bf16_attention='flash' is invalid: allowed stock, gqa"):
        CapacityPlanner("qwen3-8b", bf16_attention="flash")


def test_sizes_and_models_are_checked():
    assert parse_bytes("40GB") == 40 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="cannot read a memory size from '40 apples'"):
        parse_bytes("40 apples")
    assert set(MODEL_SHAPES) == {"qwen3-8b", "llama-3.1-8b"}
    assert CapacityPlanner("llama-3.1-8b").weight_bytes == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count


def test_command_line(capsys):
    from pnmix_patch.cli import main

    assert main(["plan", "--model", "qwen3-8b", "--batch", "32", "--generate", "8192", "--budget", "40GiB"]) == 0
    assert "largest batch" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen3-8b", "--batch", "0"])
    assert "--batch=0 is invalid: allowed an integer >= 1" in capsys.readouterr().err


def test_an_unknown_model_name_lists_the_known_ones_without_asking_a_hub():
    with pytest.raises(ValueError, match=r"model='qwen3-9b' is unknown: allowed a shape \(qwen3-8b, llama-3.1-8b\)"):
        model_config("qwen3-9b")
    with pytest.raises(ValueError, match="no such .gguf file"):
        model_config("missing.gguf")


def test_a_budget_that_fits_nothing_says_why():
    planner = CapacityPlanner("qwen3-8b")
    text = format_plan(planner.plan("pnmix-1", 1, 141, 8192, parse_bytes("1GiB")))
    assert "bf16: the weights alone (15.26 GiB) exceed the budget" in text
    text = format_plan(planner.plan("pnmix-1", 64, 141, 100_000, parse_bytes("17GiB")))
    assert "pnmix-1: not even batch 1 fits 141 + 100000 tokens" in text and "batch 64 cannot generate a token" in text
