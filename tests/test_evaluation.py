"""Fidelity evaluation (pnmix_patch.evaluation and ``pnmix eval``): methods, metrics, sweep, plots."""

import json
import math

import pytest
import torch

from conftest import tiny_model
from pnmix_patch import PRESETS, is_patched
from pnmix_patch.cli import main
from pnmix_patch.evaluation import (
    METHOD_SETS,
    METHODS,
    SWEEP_METHODS,
    SWEEP_RATES,
    attention_kl,
    capture_attention_inputs,
    distinct_ngram_fraction,
    long_output_fidelity,
    plot_results,
    resolve_methods,
    summary_table,
    sweep_config,
)


@pytest.fixture(scope="module")
def tiny_capture():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 420), generator=torch.Generator().manual_seed(0))
    return model, capture_attention_inputs(model, ids)


def test_capture_records_every_layer_and_unpatches(tiny_capture):
    model, captured = tiny_capture
    assert not is_patched(model)
    assert len(captured["key"]) == 2 and captured["pairing"] == "half"
    assert captured["query"][0].shape == (1, 4, 420, 32)
    assert captured["key"][1].shape == captured["value"][1].shape == (1, 2, 420, 32)
    assert captured["scaling"] == pytest.approx(32**-0.5)


def test_attention_kl_is_zero_unquantized_and_grows_with_fewer_bits(tiny_capture):
    _, captured = tiny_capture
    exact = attention_kl(captured, PRESETS["fp16"], 400, progress=False)
    assert exact["mean_kl"] == pytest.approx(0.0, abs=1e-6) and exact["key_bits"] == 16.0
    assert exact["queries"] == 20 and len(exact["per_layer_kl"]) == 2
    results = {bits: attention_kl(captured, sweep_config("pnmix", bits), 400, progress=False) for bits in (3.0, 1.5)}
    assert 0 < results[3.0]["mean_kl"] < results[1.5]["mean_kl"]
    assert results[3.0]["key_bits"] == pytest.approx(3.0, abs=0.01)  # masks add ~0.004 bits
    assert results[1.5]["key_bits"] == pytest.approx(1.5, abs=0.01)


def test_attention_kl_rejects_a_context_without_queries(tiny_capture):
    _, captured = tiny_capture
    with pytest.raises(ValueError, match="context=420 is invalid: allowed 1 .. 419"):
        attention_kl(captured, PRESETS["pnmix-1"], 420, progress=False)


def test_long_output_fidelity_aggregates_prompts_and_is_exact_unquantized():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(1)
    references = {
        name: {"ids": torch.randint(0, 96, (length,), generator=gen).tolist(), "prompt_length": 40}
        for name, length in (("a", 200), ("b", 240))
    }
    exact = long_output_fidelity(model, references, PRESETS["fp16"], progress=False)
    assert exact["steps"] == 160 + 200
    assert exact["top1_agreement"] == 1.0 and exact["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    quantized = long_output_fidelity(model, references, PRESETS["kivi-2"], progress=False)
    weighted = sum(r["mean_kl"] * r["steps"] for r in quantized["per_prompt"].values()) / 360
    assert quantized["mean_kl"] == pytest.approx(weighted) and quantized["mean_kl"] > 0
    assert quantized["key_bits"] == pytest.approx(2.25, abs=0.01)


@pytest.mark.parametrize("method", SWEEP_METHODS)
@pytest.mark.parametrize("rate", SWEEP_RATES)
def test_sweep_rates_map_to_their_key_bits(method, rate):
    config = sweep_config(method, rate)
    tolerance = 0.02 if method == "kitty" else 1e-12  # kitty rounds to whole channels at head dim 64
    assert config.nominal_key_bits(64) == pytest.approx(rate, abs=tolerance)
    assert config.name == f"sweep-{method}-{rate}" and METHODS[config.name] == config


def test_sweep_keeps_each_methods_identity():
    assert sweep_config("pnmix", 2.25).replace(name="pnmix-1") == PRESETS["pnmix-1"]
    assert sweep_config("kivi", 2.25).replace(name="kivi-2") == PRESETS["kivi-2"]
    for rate in SWEEP_RATES:
        kitty = sweep_config("kitty", rate)
        assert (kitty.selection_unit, kitty.reselection, kitty.key_bits_high) == ("channel", "per_group", 4)
    with pytest.raises(ValueError, match="rate=2.75 is invalid"):
        sweep_config("pnmix", 2.75)
    with pytest.raises(ValueError, match="method='polar' is invalid"):
        sweep_config("polar", 2.25)


def test_distinct_ngram_fraction():
    assert distinct_ngram_fraction([1, 2, 3, 4, 5], 2) == 1.0
    assert distinct_ngram_fraction([7, 8] * 4, 2) == pytest.approx(2 / 7)
    assert distinct_ngram_fraction([1], 4) == 1.0


def test_resolve_methods_expands_sets_once_in_order():
    assert resolve_methods(["criteria", "pnmix-1", "kitty"]) == [*METHOD_SETS["criteria"], "kitty"]
    with pytest.raises(ValueError, match="method 'pnmix-9' is unknown"):
        resolve_methods(["pnmix-9"])


def fake_results():
    points = {
        f"sweep-{method}-{rate}": {"key_bits": rate + 0.01, "mean_kl": 0.1 / rate + offset, "top1_agreement": 0.5 + rate / 10}
        for method, offset in (("kivi", 0.2), ("kitty", 0.1), ("pnmix", 0.0))
        for rate in SWEEP_RATES
    }
    criteria = {name: {"key_bits": 2.2504, "mean_kl": 0.1 + index / 100} for index, name in enumerate(METHOD_SETS["criteria"])}
    return {
        "settings": {"model": "tiny", "context": 400},
        "attention_kl": points | criteria | {"fp16": {"key_bits": 16.0, "mean_kl": 0.0}},
        "long_output": dict(points),
    }


def test_plot_results_writes_the_pareto_and_criteria_pngs(tmp_path):
    written = plot_results(fake_results(), tmp_path, "eval_tiny")
    assert [path.name for path in written] == ["eval_tiny_pareto_kl.png", "eval_tiny_pareto_top1.png", "eval_tiny_criteria.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_table_lists_every_method():
    table = summary_table(fake_results())
    assert "| fp16 | 16 | 0 | - | - |" in table
    assert "| sweep-pnmix-1.5 | 1.5100 |" in table


def test_eval_quick_command_on_the_real_model(tmp_path, capsys):
    output = tmp_path / "eval_quick.json"
    assert main(["eval", "--quick", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert set(results["attention_kl"]) == set(results["long_output"]) == {"fp16", "kivi-2", "pnmix-1", "kitty"}
    assert results["attention_kl"]["fp16"]["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    for name in ("kivi-2", "pnmix-1", "kitty"):
        kl = results["attention_kl"][name]
        assert kl["mean_kl"] > 0 and kl["queries"] == 4 and len(kl["per_layer_kl"]) == 30
        # the long outputs run past sinks + residual, so a decode step reads a quantized group
        assert results["long_output"][name]["key_bits"] < 3 and not math.isnan(results["long_output"][name]["key_bits"])
    assert results["long_output"]["fp16"]["top1_agreement"] == 1.0
    assert 0 < results["long_output_references"]["math-trains"]["distinct_4grams"] <= 1
    assert "| pnmix-1 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--methods", "pnmix-9"], "method 'pnmix-9' is unknown"),
        (["--context", "0"], "--context=0 is invalid: allowed a positive integer"),
        (["--long-tokens", "-5"], "--long-tokens=-5 is invalid"),
    ],
)
def test_eval_command_rejects_bad_arguments_before_loading(arguments, message, capsys):
    with pytest.raises(SystemExit):
        main(["eval", *arguments])
    assert message in capsys.readouterr().err
