"""transformers' QuantizedCache as comparison methods (pnmix_patch.eval.hf_quantized): wiring, bits, missing extra."""

import importlib.util
import math

import pytest
import torch
from conftest import tiny_model

from pnmix_patch.eval import hf_quantized
from pnmix_patch.eval.evaluation import (
    METHOD_SETS,
    METHODS,
    PNMIX_HIGH_RATES,
    attention_kl,
    builtin_points,
    capture_attention_inputs,
    check_methods,
    long_output_fidelity,
    plot_results,
    sweep_config,
)
from pnmix_patch.eval.fidelity import reference_logits, teacher_force
from pnmix_patch.eval.hf_quantized import HF_METHODS, MissingExtraError, quantized_cache_memory

HAVE_EXTRA = all(importlib.util.find_spec(name) is not None for name in ("hqq",)) and hf_quantized._installed("optimum.quanto")
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason='needs the hf-quantized extra (pip install -e ".[hf-quantized]")')
INTEGER_METHODS = ["hf-quanto-2", "hf-quanto-4", "hf-hqq-2", "hf-hqq-4"]


def run_cache(model, method, tokens: int, prefill: int, batch: int = 1, seed: int = 0):
    """Prefill ``prefill`` random tokens through ``method``'s cache, then feed the rest one at a time."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=generator)
    cache = method.new_cache(model)
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for position in range(prefill, tokens):
            model(ids[:, position : position + 1], cache=cache, use_cache=True)
    return cache


def expected_bytes(method, batch, kv_heads, quantized, residual, head_dim, dtype_bytes):
    """Bytes of one layer's keys (or values): codes of ``nbits`` packed into bytes, a scale and a zero
    in the model's dtype per group of 64, and the unquantized residual."""
    elements = batch * kv_heads * quantized * head_dim
    codes = elements * method.nbits // 8
    scales = 2 * (elements // method.q_group_size) * dtype_bytes
    return codes, scales, batch * kv_heads * residual * head_dim * dtype_bytes


@needs_extra
@pytest.mark.parametrize("name", INTEGER_METHODS)
@pytest.mark.parametrize(("tokens", "prefill", "batch"), [(200, 64, 1), (64 + 128, 64, 2), (64 + 128 + 3, 64, 1)])
def test_bits_are_read_from_the_stored_tensors(name, tokens, prefill, batch):
    """Known answers: the quantized region holds every token up to the last flush; codes are nbits per
    element, scale and zero float32 per 64 elements (a float32 model); the rest is the residual."""
    method = HF_METHODS[name]
    model = tiny_model("llama", num_key_value_heads=2, head_dim=32)
    cache = run_cache(model, method, tokens, prefill, batch)
    decoded = tokens - prefill
    flushed = prefill + (decoded // 128) * 128  # the prefill is quantized at once; every 128 decoded tokens flush
    residual = tokens - flushed
    codes, scales, residual_bytes = expected_bytes(method, batch, 2, flushed, residual, 32, 4)
    memory = quantized_cache_memory(cache)
    layers = model.config.num_hidden_layers
    assert cache.get_seq_length() == tokens
    assert memory["packed_keys"] == memory["packed_values"] == layers * codes
    assert memory["key_scales_zeros"] == memory["value_scales_zeros"] == layers * scales
    assert memory["residual"] == layers * 2 * residual_bytes
    assert memory["quantized_elements"] == layers * batch * 2 * flushed * 32
    assert memory["key_bits_per_element"] == pytest.approx(method.nbits + 2 * 32 / 64)
    stored = 2 * layers * (codes + scales + residual_bytes)
    assert memory["total_bytes"] == stored
    assert memory["bits_per_element"] == pytest.approx(8 * stored / (2 * layers * batch * 2 * tokens * 32))


@needs_extra
@pytest.mark.parametrize("name", INTEGER_METHODS + ["hf-fp8"])
def test_bits_in_bfloat16_halve_the_scales_share(name):
    """In a bf16 model scales and zeros are 16-bit: 2.5 bits at 2-bit codes, 4.5 at 4-bit; fp8 stays 8."""
    if name not in METHOD_SETS["hf-quantized"]:
        pytest.skip("this transformers has no fp8 QuantizedCache")
    model = tiny_model("qwen3").to(torch.bfloat16)
    memory = quantized_cache_memory(run_cache(model, HF_METHODS[name], 100, 96))
    expected = 8 + 32 / (2 * 100 * 32) if name == "hf-fp8" else HF_METHODS[name].nbits + 2 * 16 / 64
    assert memory["key_bits_per_element"] == pytest.approx(expected)
    assert memory["value_bits_per_element"] == pytest.approx(expected)


@pytest.mark.skipif("hf-fp8" not in METHOD_SETS["hf-quantized"], reason="this transformers has no fp8 QuantizedCache")
def test_fp8_stores_one_byte_per_element_and_one_scale_per_tensor():
    model = tiny_model("mistral")
    cache = run_cache(model, HF_METHODS["hf-fp8"], 70, 50)
    memory = quantized_cache_memory(cache)
    elements = 2 * 70 * 32  # kv heads x tokens x head dim, per layer
    assert memory["packed_keys"] == memory["packed_values"] == 2 * elements
    assert memory["key_scales_zeros"] == 2 * 4 and memory["residual"] == 0
    assert memory["key_bits_per_element"] == pytest.approx(8 + 32 / elements)


@needs_extra
@pytest.mark.parametrize("name", ["hf-quanto-4", "hf-hqq-4"])
def test_teacher_forcing_runs_transformers_cache_on_the_unpatched_model(name):
    """The same logits as the model decoding by hand through a QuantizedCache of the same settings,
    and closer to full precision at 4 bits than at 2 (fresh random weights)."""
    model = tiny_model("qwen2", seed=3)
    ids = torch.randint(0, 96, (1, 230), generator=torch.Generator().manual_seed(1))
    reference = reference_logits(model, ids)
    result = teacher_force(model, ids, HF_METHODS[name], 90, reference, progress=False, per_step=True)
    from transformers import QuantizedCache

    options = HF_METHODS[name].cache_config()
    cache = QuantizedCache(options.pop("backend"), model.config, **options)
    with torch.no_grad():
        model(ids[:, :90], cache=cache, use_cache=True)
        by_hand = [model(ids[:, p : p + 1], cache=cache, use_cache=True).logits[0, -1].argmax().item() for p in range(90, 230)]
    assert result["step_argmax"] == by_hand
    assert result["steps"] == 140 and result["memory"]["key_bits_per_element"] == pytest.approx(HF_METHODS[name].nbits + 1)
    assert 0 < result["mean_kl"] and not any(type(m).__name__.startswith("PNMix") for m in model.modules())


@needs_extra
def test_hqq_prefills_a_prompt_it_cannot_pack_in_two_chunks():
    """HQQ packs 2-bit rows four at a time: 3 KV heads x 61 tokens (one 64-element row per head and token)
    do not pack; the evaluation prefills 60 tokens, then 1, where a plain forward raises."""
    model = tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=64)
    method = HF_METHODS["hf-hqq-2"]
    assert method.prefill_chunks(61, 1, 3, 64) == [60, 1]
    assert method.prefill_chunks(60, 1, 3, 64) == [60]
    assert method.prefill_chunks(61, 1, 3, 32) == [56, 5]  # half rows: the prefix must fill whole 64-element groups too
    assert HF_METHODS["hf-quanto-2"].prefill_chunks(61, 1, 3, 64) == [61]
    ids = torch.randint(0, 96, (1, 61 + 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            model(ids[:, :61], cache=method.new_cache(model), use_cache=True)
    result = teacher_force(model, ids, method, 61, reference_logits(model, ids), progress=False)
    assert result["steps"] == 20


@needs_extra
def test_attention_kl_and_long_outputs_take_the_builtin_caches():
    model = tiny_model("llama", seed=1)
    captured = capture_attention_inputs(model, torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(2)))
    two, four = (attention_kl(captured, HF_METHODS[name], 280, progress=False) for name in ("hf-quanto-2", "hf-quanto-4"))
    assert 0 < four["mean_kl"] < two["mean_kl"] and two["queries"] == 20
    assert two["key_bits"] == pytest.approx(3.0) and four["key_bits"] == pytest.approx(5.0)
    ids = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(4)).tolist()[0]
    record = long_output_fidelity(model, {"p": {"ids": ids, "prompt_length": 40}}, HF_METHODS["hf-hqq-4"], progress=False)
    assert record["steps"] == 110 and record["key_bits"] == pytest.approx(5.0) and record["value_bits"] == pytest.approx(5.0)
    assert record["stored_bits"] > record["key_bits"]  # the float32 residual counts


def test_missing_extra_is_a_clear_error_naming_it(monkeypatch):
    monkeypatch.setattr(hf_quantized, "_installed", lambda module: False)
    with pytest.raises(MissingExtraError, match=r"hf-hqq-2 run transformers' QuantizedCache through hqq.*'hf-quantized' extra"):
        check_methods(["pnmix-1", "hf-hqq-2"], ["long_output"])
    with pytest.raises(MissingExtraError, match="optimum-quanto"):
        HF_METHODS["hf-quanto-4"].new_cache(tiny_model("llama"))
    check_methods(["pnmix-1", "kivi-2"], ["long_output"])  # PN-Mix configs need no extra


def test_missing_extra_stops_pnmix_eval_before_the_model_loads(monkeypatch, tmp_path, capsys):
    from pnmix_patch import cli

    monkeypatch.setattr(hf_quantized, "_installed", lambda module: False)
    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        cli.main(["eval", "--methods", "hf-quanto-2", "--metrics", "long_output", "--output", str(tmp_path / "e.json")])
    assert 'pip install -c constraints.txt -e ".[hf-quantized]"' in capsys.readouterr().err


def test_gsm8k_refuses_the_builtin_caches():
    with pytest.raises(ValueError, match="gsm8k runs PN-Mix configs only"):
        check_methods(["hf-fp8"], ["gsm8k"])


def test_methods_are_transformers_documented_settings():
    assert HF_METHODS["hf-quanto-2"].cache_config() == {
        "backend": "quanto", "nbits": 2, "axis_key": 0, "axis_value": 0, "q_group_size": 64, "residual_length": 128,
    }  # fmt: skip
    assert HF_METHODS["hf-hqq-4"].cache_config()["axis_key"] == 1 and HF_METHODS["hf-fp8"].cache_config() == {"backend": "fp8"}
    assert set(METHOD_SETS["hf-quantized"]) <= set(HF_METHODS) and all(name in METHODS for name in HF_METHODS)


@pytest.mark.parametrize("rate", PNMIX_HIGH_RATES)
def test_pnmix_sweep_above_three_bits(rate):
    config = sweep_config("pnmix", rate)
    assert (config.key_bits_high, config.key_bits_low) == (4, 3)
    assert config.nominal_key_bits(64) == pytest.approx(rate) and METHODS[f"sweep-pnmix-{rate}"] == config


def test_pareto_plot_draws_the_builtin_points(tmp_path):
    results = {
        "settings": {"model": "tiny"},
        "long_output": {
            "pnmix-1": {"key_bits": 2.25, "mean_kl": 0.03, "top1_agreement": 0.9},
            "sweep-pnmix-4.0": {"key_bits": 4.0, "mean_kl": 0.01, "top1_agreement": 0.95},
            "hf-quanto-2": {"key_bits": 3.0, "mean_kl": 2.0, "top1_agreement": 0.4},
        },
    }
    assert builtin_points(results, "long_output", "mean_kl") == {"hf-quanto-2": (3.0, 2.0)}
    written = plot_results(results, tmp_path, "eval_tiny")
    assert [path.name for path in written] == ["eval_tiny_pareto_kl.png", "eval_tiny_pareto_top1.png"]
    assert not math.isnan(builtin_points(results, "long_output", "top1_agreement")["hf-quanto-2"][1])
