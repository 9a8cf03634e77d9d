"""Fidelity evaluation (pnmix_patch.eval.evaluation and ``pnmix eval``): methods, metrics, sweep, plots."""

import json
import math
import types

import pytest
import torch
from conftest import tiny_model

from pnmix_patch import PRESETS, is_patched, new_cache, patch_model, unpatch_model
from pnmix_patch.cache import _STATE, PNMixLayer
from pnmix_patch.cli import main
from pnmix_patch.eval.evaluation import (
    METHOD_SETS,
    METHODS,
    SWEEP_METHODS,
    SWEEP_RATES,
    _save_owned,
    attention_kl,
    cache_from_states,
    capture_attention_inputs,
    capture_prefill,
    distinct_ngram_fraction,
    long_output_fidelity,
    make_passkey_trials,
    paired_flips,
    passkey_correct,
    passkey_retrieval,
    plot_results,
    prefill_layer_from_states,
    resolve_methods,
    run_evaluation,
    summary_table,
    sweep_config,
    sweep_rates,
    wilson_interval,
)
from pnmix_patch.eval.fidelity import reference_logits, teacher_force


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


def test_long_output_fidelity_resumes_measured_prompts():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    references = {name: {"ids": torch.randint(0, 96, (200,), generator=gen).tolist(), "prompt_length": 40} for name in "ab"}
    full = long_output_fidelity(model, references, PRESETS["kivi-2"], progress=False)
    resumed = long_output_fidelity(model, references, PRESETS["kivi-2"], progress=False, done={"a": full["per_prompt"]["a"]})
    assert resumed == full
    # a prompt found in ``done`` is taken as measured, not run again
    fake = {"mean_kl": 1.0, "top1_agreement": 0.0, "steps": 160, "key_bits": 2.25}
    mixed = long_output_fidelity(model, references, PRESETS["kivi-2"], progress=False, done={"a": fake, "z": fake})
    assert mixed["per_prompt"] == {"a": fake, "b": full["per_prompt"]["b"]}
    assert mixed["mean_kl"] == pytest.approx((1.0 + full["per_prompt"]["b"]["mean_kl"]) / 2)


def test_run_evaluation_adds_prompts_without_measuring_the_old_ones_again(tmp_path, monkeypatch):
    from pnmix_patch.eval import evaluation

    model = tiny_model("llama")
    generated, forced = [], []

    def fake_reference(model, tokenizer, prompts, tokens, progress=True):
        generated.extend(prompts)
        gen = torch.Generator().manual_seed(len(generated))
        return {name: {"ids": torch.randint(0, 96, (40 + tokens,), generator=gen).tolist(), "prompt_length": 40} for name in prompts}

    def counting_teacher_force(model, ids, config, prompt_length, *args, **kwargs):
        forced.append(ids.shape[1])
        return teacher_force(model, ids, config, prompt_length, *args, **kwargs)

    monkeypatch.setattr(evaluation, "generate_reference", fake_reference)
    monkeypatch.setattr(evaluation, "teacher_force", counting_teacher_force)
    output = tmp_path / "eval_tiny.json"
    first_two = list(evaluation.PROMPTS)[:2]
    run_evaluation(model, None, "tiny", ["long_output"], ["kivi-2"], output, long_tokens=160, prompts=1, progress=False)
    assert generated == first_two[:1] and len(forced) == 1
    results = run_evaluation(
        model, None, "tiny", ["long_output"], ["kivi-2", "pnmix-1"], output, long_tokens=160, prompts=2, progress=False
    )
    assert generated == first_two and len(forced) == 1 + 1 + 2  # kivi-2: the new prompt only; pnmix-1: both
    assert results["settings"]["prompts"] == 2 and list(results["long_output_references"]) == first_two
    for name in ("kivi-2", "pnmix-1"):
        record = json.loads(output.read_text())["long_output"][name]
        assert list(record["per_prompt"]) == first_two and record["steps"] == 320
    # back to one prompt: the records are re-aggregated from what was measured, nothing is run
    results = run_evaluation(model, None, "tiny", ["long_output"], ["kivi-2"], output, long_tokens=160, prompts=1, progress=False)
    assert len(forced) == 4 and results["long_output"]["kivi-2"]["steps"] == 160
    assert list(results["long_output"]["pnmix-1"]["per_prompt"]) == first_two  # not run: kept as measured


def test_teacher_force_per_step_diagnostics_match_the_aggregates():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(2))
    reference = reference_logits(model, ids)
    exact = teacher_force(model, ids, PRESETS["fp16"], 100, reference, progress=False, per_step=True)
    assert len(exact["step_kl"]) == len(exact["step_argmax"]) == len(exact["reference_top2"]) == exact["steps"] == 200
    assert max(exact["step_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert exact["step_argmax"] == exact["reference_argmax"] == reference[0, 100:].argmax(-1).tolist()
    assert exact["step_top2"][0][0][0] == exact["reference_top2"][0][0][0]
    assert exact["reference_top2"][0][0][1] >= exact["reference_top2"][0][1][1]
    quantized = teacher_force(model, ids, PRESETS["pnmix-1"], 100, reference, progress=False, per_step=True)
    assert sum(quantized["step_kl"]) / 200 == pytest.approx(quantized["mean_kl"]) and quantized["mean_kl"] > 0
    agree = sum(a == b for a, b in zip(quantized["step_argmax"], quantized["reference_argmax"])) / 200
    assert agree == pytest.approx(quantized["top1_agreement"])
    assert "step_kl" not in teacher_force(model, ids, PRESETS["kivi-2"], 100, reference, progress=False)


@pytest.mark.parametrize(("method", "rate"), [(method, rate) for method in SWEEP_METHODS for rate in sweep_rates(method)])
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
    polar = sweep_config("polar", 2.25)
    assert (polar.key_format, polar.radius_bits, polar.angle_bits, polar.key_group_size) == ("polar", 2, 2, 128)
    assert sweep_config("chanmix", 2.25).replace(name="chanmix") == PRESETS["chanmix"]
    assert sweep_config("chanmix", 2.0).class_bits == PRESETS["chanmix"].class_bits
    assert sweep_rates("chanmix") == (3.0, 2.5, 2.25, 2.0)
    assert set(sweep_rates("kivi")) == set(SWEEP_RATES)
    with pytest.raises(ValueError, match="method='polarquant' is invalid"):
        sweep_config("polarquant", 2.25)
    with pytest.raises(ValueError, match=r"rate=1.5 is invalid: allowed \(3.0, 2.5, 2.25, 2.0\)"):
        sweep_config("chanmix", 1.5)


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


def test_long_output_points_average_the_prompts_every_point_has():
    from pnmix_patch.eval.evaluation import PROMPTS, _sweep_points, common_prompts

    first, second = list(PROMPTS)[:2]
    prompt = {"steps": 100, "key_bits": 2.25}
    results = {
        "long_output": {
            "kivi-2": {
                "key_bits": 2.25,
                "mean_kl": 9.0,
                "per_prompt": {
                    first: prompt | {"mean_kl": 0.2, "top1_agreement": 0.9},
                    second: prompt | {"mean_kl": 0.4, "top1_agreement": 0.7},
                },
            },
            "sweep-kivi-2.0": {
                "key_bits": 2.0,
                "mean_kl": 0.5,
                "per_prompt": {first: prompt | {"mean_kl": 0.5, "top1_agreement": 0.8, "key_bits": 2.0}},
            },
        }
    }
    assert common_prompts(results) == [first]
    assert _sweep_points(results, "long_output", "mean_kl") == {"kivi": [(2.0, 0.5), (2.25, 0.2)]}


def test_summary_table_lists_every_method():
    table = summary_table(fake_results())
    assert "| fp16 | 16 | 0 | - | - | - |" in table
    assert "| sweep-pnmix-1.5 | 1.5100 |" in table


# ----------------------------------------------------------------------------- statistics
def test_wilson_interval_known_values():
    assert wilson_interval(0, 50) == pytest.approx((0.0, 0.07135), abs=1e-4)
    assert wilson_interval(50, 50) == pytest.approx((0.92865, 1.0), abs=1e-4)
    assert wilson_interval(25, 50) == pytest.approx((0.36637, 0.63363), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes=3 is invalid"):
        wilson_interval(3, 2)


def test_paired_flips_counts_each_way_and_exact_mcnemar():
    flips = paired_flips([True, True, False, False, True], [True, False, True, False, False])
    assert (flips["both_correct"], flips["lost"], flips["gained"], flips["both_wrong"]) == (1, 2, 1, 1)
    assert flips["difference"] == pytest.approx(-0.2) and flips["mcnemar_p"] == 1.0
    six_lost = paired_flips([True] * 6 + [False] * 4, [False] * 10)
    assert six_lost["lost"] == 6 and six_lost["mcnemar_p"] == pytest.approx(2 / 64)
    assert paired_flips([True], [True])["mcnemar_p"] == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        paired_flips([True], [True, False])


def test_save_writes_only_owned_entries_and_keeps_what_another_process_wrote(tmp_path):
    output = tmp_path / "eval.json"
    # another process has written 4096 (10 trials now) since this one last read the file (5 trials then)
    output.write_text(json.dumps({"settings": {"a": 1}, "passkey": {"lengths": {"4096": {"n": 10}}}}))
    ours = {"settings": {"a": 1}, "passkey": {"lengths": {"4096": {"n": 5}, "1024": {"n": 3}}}, "attention_kl": {"x": 1}}
    merged = _save_owned(output, ours, {("settings",), ("passkey", "lengths", "1024"), ("long_output", "y")})
    assert (
        merged
        == json.loads(output.read_text())
        == {
            "settings": {"a": 1},
            "passkey": {"lengths": {"4096": {"n": 10}, "1024": {"n": 3}}},
        }
    )


# ----------------------------------------------------------------------------- passkey
class CharTokenizer:
    """Printable ASCII one token per character (ids 0..94, newline 95): fits the tiny models' vocab."""

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [95 if c == "\n" else min(max(ord(c) - 32, 0), 94) for c in text]
        return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=False):
        return "".join("\n" if int(i) == 95 else chr(int(i) + 32) for i in ids)


def test_passkey_trials_hide_the_key_at_the_drawn_depth():
    tokenizer = CharTokenizer()
    built = make_passkey_trials(tokenizer, 600, 6, seed=3)
    filler = built["filler_ids"]
    for trial in built["trials"]:
        ids, position = trial["ids"], trial["needle_position"]
        assert 600 - 25 < len(ids) <= 600  # whole filler sentences up to the length
        assert ids[:position] == filler[:position]  # the prefix shared with the filler-only prompt
        assert tokenizer.decode(ids[position:]).startswith(f" The pass key is {trial['key']}. Remember it.")
        assert tokenizer.decode(ids).endswith("What is the pass key? The pass key is")
        depth_of_needle = (position - 150) / (len(filler) - 150)  # the intro is ~150 characters
        assert abs(depth_of_needle - trial["depth"]) < 0.1 and 10000 <= trial["key"] <= 99999
    assert len({t["key"] for t in built["trials"]}) == 6
    # a trial does not depend on how many trials are drawn; the seed changes them
    assert make_passkey_trials(tokenizer, 600, 2, seed=3)["trials"] == built["trials"][:2]
    assert make_passkey_trials(tokenizer, 600, 2, seed=4)["trials"] != built["trials"][:2]
    with pytest.raises(ValueError, match="length=100 is invalid"):
        make_passkey_trials(tokenizer, 100, 1)


def test_passkey_correct_needs_the_whole_number():
    assert passkey_correct(" 73156. Remember", 73156) and passkey_correct("is73156", 73156)
    assert not passkey_correct(" 7315. The pass", 73156) and not passkey_correct(" 731567", 73156)


def test_capture_prefill_with_a_shared_prefix_matches_one_pass():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(0))
    ids[1, :120] = ids[0, :120]
    whole = capture_prefill(model, ids)
    prefix = capture_prefill(model, ids[:1, :120])
    chunked = capture_prefill(model, ids, prefix=prefix, chunk_size=50)
    assert not is_patched(model) and chunked["key"][0].shape == (2, 2, 300, 32)
    for name in ("query", "key", "value"):
        for exact, reused in zip(whole[name], chunked[name]):
            torch.testing.assert_close(reused, exact, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(chunked["logits"], model(ids).logits[:, -1], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="the prefix holds 300 tokens"):
        capture_prefill(model, ids, prefix=whole)


@pytest.mark.parametrize("name", ["fp16", "kivi-2", "pnmix-1", "kitty", "pnmix-1-per-group"])
def test_cache_from_states_equals_a_prefill_through_the_cache(name):
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1))
    captured = capture_prefill(model, ids)
    config = METHODS[name]
    patch_model(model, config)
    try:
        filled = cache_from_states(model, captured, config)
        for index, layer in enumerate(filled.layers):  # the same state as attend() leaves after a prefill
            attended = PNMixLayer(config, captured["pairing"])
            attended.attend(*(captured[n][index] for n in ("query", "key", "value")), None, captured["scaling"])
            assert layer.seen_tokens == attended.seen_tokens == 300
            for field in _STATE:
                assert torch.equal(getattr(layer, field), getattr(attended, field)), field
        assert int(filled.layers[0].num_groups[0]) == (2 if config.quantize else 0)  # quantized groups were written
        # decoding through it equals decoding after the model's own prefill
        real = new_cache(model)
        with torch.no_grad():
            model(ids, cache=real, use_cache=True)
            token = torch.tensor([[5], [7]])
            torch.testing.assert_close(
                model(token, cache=filled, use_cache=True).logits,
                model(token, cache=real, use_cache=True).logits,
                atol=1e-4,
                rtol=1e-4,
            )
        layer = PNMixLayer(config)
        prefill_layer_from_states(layer, captured["query"][0], captured["key"][0], captured["value"][0])
        with pytest.raises(ValueError, match="already holds 300 tokens"):
            prefill_layer_from_states(layer, captured["query"][0], captured["key"][0], captured["value"][0])
    finally:
        unpatch_model(model)


def test_passkey_retrieval_decodes_what_generate_gives_and_resumes():
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    configs = {"fp16": METHODS["fp16"], "pnmix-1": METHODS["pnmix-1"]}
    answers = passkey_retrieval(model, tokenizer, configs, 400, 3, batch_size=2, chunk_size=128, progress=False)
    assert [r["index"] for r in answers["fp16"]] == [r["index"] for r in answers["pnmix-1"]] == [0, 1, 2]
    assert answers["fp16"][0]["key_bits"] == 16.0 and answers["pnmix-1"][0]["key_bits"] == pytest.approx(2.25, abs=0.02)
    # fp16 answers are the model's own greedy continuations of the prompts
    for trial, record in zip(make_passkey_trials(tokenizer, 400, 3)["trials"], answers["fp16"]):
        ids = torch.tensor([trial["ids"]])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert record["answer"] == tokenizer.decode(generated[0, ids.shape[1] :])
        assert record["correct"] == passkey_correct(record["answer"], trial["key"])
    # resumed: earlier answers are kept, only the missing trials run
    done = {"fp16": answers["fp16"], "pnmix-1": [dict(answers["pnmix-1"][0], answer="kept")]}
    resumed = passkey_retrieval(model, tokenizer, configs, 400, 4, done=done, batch_size=2, progress=False)
    assert resumed["fp16"][:3] == answers["fp16"] and len(resumed["fp16"]) == 4
    assert resumed["pnmix-1"][0]["answer"] == "kept" and resumed["pnmix-1"][1:3] == answers["pnmix-1"][1:]


def test_run_evaluation_passkey_writes_accuracy_intervals_and_paired_flips(tmp_path):
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    output = tmp_path / "eval_tiny.json"
    settings = {"model": "tiny", "context": 2048, "queries": 64, "long_tokens": 1024, "prompts": 2}
    output.write_text(json.dumps({"settings": settings, "attention_kl": {"kivi-2": {"key_bits": 2.25, "mean_kl": 0.3}}}))
    results = run_evaluation(
        model,
        tokenizer,
        "tiny",
        ["passkey"],
        ["fp16", "pnmix-1"],
        output,
        passkey_lengths=(300, 400),
        passkey_trials=2,
        progress=False,
    )
    assert json.loads(output.read_text()) == json.loads(json.dumps(results, default=str))
    assert results["attention_kl"]["kivi-2"]["mean_kl"] == 0.3  # other metrics are kept
    entry = results["passkey"]["lengths"]["400"]
    assert len(entry["trials"]) == 2 and entry["prompt_tokens"][0] <= 400
    record = entry["methods"]["pnmix-1"]
    assert record["trials"] == 2 and record["correct"] == sum(r["correct"] for r in record["answers"])
    low, high = record["wilson_95"]
    assert 0 <= low <= record["accuracy"] <= high <= 1
    assert record["paired_vs_fp16"]["items"] == 2 and "paired_vs_fp16" not in entry["methods"]["fp16"]
    table = summary_table(results)
    assert "400 tokens: accuracy [95% CI]" in table and "| pnmix-1 | 2.25" in table
    plots = {p.name: p for p in plot_results(results, tmp_path, "eval_tiny")}
    assert plots["eval_tiny_passkey.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_evaluation_keeps_the_sections_of_metrics_it_does_not_run(tmp_path):
    output = tmp_path / "eval_tiny.json"
    settings = {"model": "tiny", "context": 2048, "queries": 64, "long_tokens": 1024, "prompts": 2}
    gsm8k = {"settings": {"task": "gsm8k_local_8shot", "limit": 30, "max_gen_toks": 256, "batch_size": 8}, "methods": {"fp16": {}}}
    passkey = {"settings": {"seed": 1}, "lengths": {"400": {}}}
    output.write_text(
        json.dumps(
            {
                "settings": settings,
                "gsm8k": gsm8k,
                "passkey": passkey,
                "long_output": {"kivi-2": {"mean_kl": 0.1}},
                "long_output_references": {"a": {"ids": [1, 2, 3, 4, 5], "prompt_length": 1}},
            }
        )
    )
    # default GSM8K limit (50), passkey seed (0), another long-output size: none of those metrics runs
    results = run_evaluation(None, None, "tiny", ["attention_kl"], [], output, context=300, long_tokens=64, progress=False)
    on_disk = json.loads(output.read_text())
    for data in (results, on_disk):
        assert data["gsm8k"] == gsm8k and data["passkey"] == passkey
        assert data["long_output"] == {"kivi-2": {"mean_kl": 0.1}} and "long_output_references" in data
        assert data["settings"]["long_tokens"] == 1024 and data["settings"]["context"] == 300


@pytest.mark.parametrize(
    "metrics, changes, message",
    [
        (["attention_kl"], {"context": 300}, "attention_kl at context 2048 / queries 64"),
        (["long_output"], {"long_tokens": 64}, "long_output at 1024 tokens"),
        (["passkey"], {"passkey_trials": 5}, "passkey with trials=50"),
        (["gsm8k"], {"gsm8k_limit": 5}, "gsm8k with limit=30"),
    ],
)
def test_run_evaluation_refuses_to_mix_runs_of_other_settings(tmp_path, metrics, changes, message):
    """A metric whose results in the file were measured with other settings is refused, naming them,
    and the file is left as it was: one table never mixes runs (a 5-trial passkey run must not land
    beside 50-trial figures)."""
    from pnmix_patch.eval.evaluation import gsm8k_run_settings, passkey_run_settings

    output = tmp_path / "eval_tiny.json"
    content = {
        "settings": {"model": "tiny", "context": 2048, "queries": 64, "long_tokens": 1024, "prompts": 2},
        "attention_kl": {"kivi-2": {"mean_kl": 0.3}},
        "long_output": {"kivi-2": {"mean_kl": 0.1}},
        "passkey": {"settings": passkey_run_settings(0, 50), "lengths": {"1024": {}}},
        "gsm8k": {"settings": gsm8k_run_settings("gsm8k_local_8shot", 30, 256, 8), "methods": {"fp16": {}}},
    }
    output.write_text(json.dumps(content))
    arguments = dict(context=2048, long_tokens=1024, passkey_trials=50, gsm8k_limit=30) | changes
    with pytest.raises(ValueError, match=message):
        run_evaluation(None, None, "tiny", metrics, [], output, progress=False, **arguments)
    assert json.loads(output.read_text()) == content
    with pytest.raises(ValueError, match="holds results of model 'tiny', not 'other'"):
        run_evaluation(None, None, "other", ["attention_kl"], [], output, progress=False)


def test_eval_writes_to_the_working_directory_and_checks_the_file_before_loading(tmp_path, monkeypatch, capsys):
    """``pnmix eval`` never writes into the repository's own results: its default file is in the working
    directory; a file of other settings is refused before the model loads."""
    from pnmix_patch import cli

    monkeypatch.chdir(tmp_path)
    assert cli.EVAL_OUTPUT.format(model="smollm2") == "eval_smollm2.json"
    (tmp_path / "eval_smollm2.json").write_text(
        json.dumps({"settings": {"model": "smollm2", "context": 2048, "queries": 64, "long_tokens": 1024}, "attention_kl": {"x": {}}})
    )
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(SystemExit):
        main(["eval", "--metrics", "attention_kl", "--context", "512"])
    assert "attention_kl at context 2048 / queries 64" in capsys.readouterr().err


def test_eval_without_the_eval_extra_says_what_to_install(tmp_path, monkeypatch, capsys):
    """Without lm-eval, ``--metrics gsm8k`` is refused at the start; without matplotlib the tables are
    still printed and the plots skipped."""
    import importlib.util

    from pnmix_patch import cli

    real = importlib.util.find_spec
    missing = set()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    missing.add("lm_eval")
    with pytest.raises(SystemExit):
        main(["eval", "--metrics", "gsm8k", "--output", str(tmp_path / "a.json")])
    assert 'pip install "pnmix-patch[eval]"' in capsys.readouterr().err
    missing.add("matplotlib")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(
        "pnmix_patch.eval.evaluation.run_evaluation",
        lambda *a, **k: {"settings": {}, "attention_kl": {"kivi-2": {"mean_kl": 0.25, "key_bits": 2.25}}},
    )
    monkeypatch.setattr("pnmix_patch.eval.evaluation.plot_results", lambda *a, **k: pytest.fail("plotted without matplotlib"))
    assert main(["eval", "--metrics", "attention_kl", "--methods", "kivi-2", "--output", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "| kivi-2 | 2.2500 | 0.25 |" in out


def test_eval_quick_command_on_the_real_model(tmp_path, capsys):
    output = tmp_path / "eval_quick.json"
    assert main(["eval", "--quick", "--metrics", "attention_kl", "long_output", "passkey", "gsm8k", "--output", str(output)]) == 0
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
    # passkey: 2 trials at 400 tokens, fp16 reads the exact cache
    passkey = results["passkey"]["lengths"]["400"]["methods"]
    assert set(passkey) == {"fp16", "kivi-2", "pnmix-1", "kitty"} and passkey["fp16"]["trials"] == 2
    assert passkey["pnmix-1"]["key_bits"] < 3 and passkey["pnmix-1"]["paired_vs_fp16"]["items"] == 2
    # GSM8K through lm-eval: the tiny task's first 2 problems, per-problem results, paired flips
    gsm8k = results["gsm8k"]["methods"]
    assert set(gsm8k) == {"fp16", "kivi-2", "pnmix-1", "kitty"}
    for record in gsm8k.values():
        assert [p["doc_id"] for p in record["problems"]] == [0, 1]
        matches = [p["exact_match"]["flexible-extract"] for p in record["problems"]]
        assert record["filters"]["flexible-extract"]["correct"] == sum(matches)
        assert all(0 < tokens <= 17 for tokens in record["generated_tokens"])
    assert gsm8k["pnmix-1"]["paired_vs_fp16"]["flexible-extract"]["items"] == 2
    out = capsys.readouterr().out
    assert "| pnmix-1 |" in out and "flexible-extract: exact match" in out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--methods", "pnmix-9"], "method 'pnmix-9' is unknown"),
        (["--context", "0"], "--context=0 is invalid: allowed a positive integer"),
        (["--long-tokens", "-5"], "--long-tokens=-5 is invalid"),
        (["--passkey-trials", "0"], "--passkey-trials=0 is invalid"),
        (["--passkey-lengths", "1024", "0"], "--passkey-lengths=[1024, 0] is invalid"),
        (["--gsm8k-limit", "0"], "--gsm8k-limit=0 is invalid"),
        (["--metrics", "bleu"], "invalid choice: 'bleu'"),
    ],
)
def test_eval_command_rejects_bad_arguments_before_loading(arguments, message, capsys):
    with pytest.raises(SystemExit):
        main(["eval", *arguments])
    assert message in capsys.readouterr().err
