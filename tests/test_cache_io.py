"""Saved PN-Mix caches: continuing exactly after a load, sharing a prefix, and refusing bad files."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CACHE_KWARG, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from test_cache import SMALL

from pnmix_patch import (
    PRESETS,
    CacheFileError,
    cache_argument,
    cache_info,
    continuation_inputs,
    load_cache,
    new_cache,
    patch_model,
    prefill,
    save_cache,
)
from pnmix_patch.cache import _STATE
from pnmix_patch.cache_io import FORMAT_VERSION, _check_free_memory

PROMPT, STEPS = 300, 140  # 300 prompt tokens flush one group of 128 (pnmix-1); 140 steps flush another


def prompt_batch(seed=0, batch=2, length=PROMPT, padding=(0, 41)):
    """Random token ids of a left-padded batch (ragged lengths) and its attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(padding[:batch]):
        mask[row, :pad] = 0
    return ids, mask


def greedy(model, cache, first, steps=STEPS, forward=None):
    """Greedy decoding from ``first`` [B, 1] through the cache; returns the tokens [B, steps + 1]."""
    forward = forward or model
    tokens = [first]
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(forward(input_ids=tokens[-1], **{CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1)


def state(layer) -> dict:
    """A layer's state tensors cut to the used groups (what a file holds)."""
    groups = int(layer.num_groups.max())
    group_size = layer.pnmix_config.key_group_size
    cut = {}
    for field in _STATE:
        tensor = getattr(layer, field)
        if field in ("key_codes_high", "key_codes_low", "key_scale", "key_zero", "group_mask_bits"):
            tensor = tensor[:, :, :groups]
        elif field.startswith("value_"):
            tensor = tensor[:, :, : groups * group_size]
        elif field in ("residual_keys", "residual_values") and not layer.pnmix_config.quantize:
            tensor = tensor[:, :, : int(layer.residual_len.max())]
        cut[field] = tensor
    return cut


def assert_same_state(loaded, saved):
    for index, (a, b) in enumerate(zip(loaded.layers, saved.layers)):
        for field, tensor in state(b).items():
            assert torch.equal(state(a)[field], tensor), f"layer {index} {field}"
        assert int(a.get_seq_length()) == int(b.get_seq_length())


# ---------------------------------------------------------------------------------------- continue exactly
SAVED_PRESETS = [name for name in sorted(PRESETS) if PRESETS[name].key_format == "channel"]
"""The presets cache files hold (the polar and channel-class formats are refused: tests/test_key_formats.py)."""


@pytest.mark.parametrize("preset", SAVED_PRESETS)
def test_a_loaded_cache_continues_exactly_as_the_cache_in_memory(preset, tmp_path):
    """Every preset: a left-padded batch of two is prefilled, saved and loaded into another model object
    built from the same seed; the loaded cache holds the same bits and decodes the same greedy tokens."""
    model = patch_model(tiny_model("llama"), preset)
    ids, mask = prompt_batch()
    cache = prefill(model, ids, mask, progress=False)
    path = tmp_path / "prompt.safetensors"
    info = save_cache(cache, path, model=model, prompt_token_ids=ids)
    assert info.batch_size == 2 and info.seen_tokens == [PROMPT, PROMPT] and torch.equal(info.prompt_token_ids, ids)
    fresh = patch_model(tiny_model("llama"), preset)
    loaded = load_cache(path, fresh)
    assert_same_state(loaded, cache)
    first = torch.randint(3, 96, (2, 1), generator=torch.Generator().manual_seed(1))
    expected = greedy(model, cache, first)
    assert torch.equal(greedy(fresh, loaded, first), expected)
    if PRESETS[preset].quantize:
        assert int(cache.layers[0].num_groups.min()) >= 1  # the steps read packed groups


def test_a_fresh_process_continues_exactly(tmp_path):
    """Prefill and save here, load and decode in another Python process: the same greedy tokens."""
    model = patch_model(tiny_model("qwen3"), "pnmix-2")
    ids, mask = prompt_batch(seed=2)
    cache = prefill(model, ids, mask, progress=False)
    path = tmp_path / "prompt.safetensors"
    save_cache(cache, path, model=model, prompt_token_ids=ids)
    first = torch.tensor([[7], [11]])
    expected = greedy(model, cache, first, steps=60)
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import tiny_model, CACHE_KWARG
        from pnmix_patch import load_cache, patch_model
        model = patch_model(tiny_model("qwen3"), "pnmix-2")
        cache = load_cache({str(path)!r}, model)
        tokens = [torch.tensor([[7], [11]])]
        with torch.no_grad():
            for _ in range(60):
                tokens.append(model(input_ids=tokens[-1], **{{CACHE_KWARG: cache}}).logits[:, -1].argmax(-1, keepdim=True))
        print(torch.cat(tokens, 1).tolist())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected.tolist()


@pytest.mark.parametrize("preset", [name for name in SAVED_PRESETS if PRESETS[name].reselection == "prefill"])
def test_a_static_cache_loads_into_its_preallocated_storage(preset, tmp_path):
    """A static cache's file loads straight into a static cache's storage (its addresses kept), and the
    decode steps continue as the saved static cache does in memory; a dynamic cache's file loads into
    a static cache and a static cache's file into a dynamic cache alike."""
    model = patch_model(tiny_model("llama"), preset)
    ids, mask = prompt_batch(seed=3)
    static = prefill(model, ids, mask, cache=new_cache(model, 460, static=True), progress=False)
    path = tmp_path / "static.safetensors"
    info = save_cache(static, path, model=model)
    assert info.kind == "static" and info.file_bytes < static.memory_report()["total_bytes"]  # the empty storage is not written
    fresh = patch_model(tiny_model("llama"), preset)
    target = new_cache(fresh, 460, static=True)
    prefill(fresh, ids[:, :10], cache=target, progress=False)  # allocated, holding something else
    addresses = {name: tensor.data_ptr() for name, tensor in target.layers[0]._storage.items()}
    loaded = load_cache(path, fresh, cache=target)
    assert loaded is target and {name: t.data_ptr() for name, t in target.layers[0]._storage.items()} == addresses
    assert_same_state(loaded, static)
    first = torch.tensor([[5], [9]])
    expected = greedy(model, static, first)
    assert torch.equal(greedy(fresh, loaded, first), expected)
    dynamic = load_cache(path, fresh)  # the same file into a dynamic cache: the same tokens again
    assert not hasattr(dynamic.layers[0], "_storage")
    assert torch.equal(greedy(fresh, dynamic, first), expected)


def test_the_compiled_decode_step_runs_on_a_loaded_static_cache(tmp_path):
    """A dynamic cache's file loaded into a static cache: ``torch.compile(fullgraph=True)`` decodes it
    in one graph, with the dynamic cache's greedy tokens."""
    from torch._dynamo.utils import counters

    model = patch_model(tiny_model("llama"), SMALL)
    ids, mask = prompt_batch(seed=4, length=90, padding=(0, 7))
    cache = prefill(model, ids, mask, progress=False)
    path = tmp_path / "prompt.safetensors"
    save_cache(cache, path, model=model)
    loaded = load_cache(path, model, static=True, max_cache_len=400)
    first = torch.tensor([[3], [4]])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, mode="default")
    tokens = greedy(model, loaded, first, steps=300, forward=compiled)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(tokens, greedy(model, cache, first, steps=300))


# ---------------------------------------------------------------------------------------- sharing a prefix
def test_one_saved_prefix_serves_a_batch_of_requests_each_as_alone(tmp_path):
    """One saved prompt expanded to three requests (ragged questions of 5, 17 and 1 tokens) generates, row
    by row, what each request generates from its own prefix prefilled alone with its question as a second
    chunk; the loaded rows are bit copies of the saved one, and the prefix's selection is kept."""
    model = patch_model(tiny_model("qwen2"), "pnmix-1")
    prefix = torch.randint(3, 96, (1, 290), generator=torch.Generator().manual_seed(5))
    cache = prefill(model, prefix, progress=False)
    path = tmp_path / "prefix.safetensors"
    save_cache(cache, path, model=model, prompt_token_ids=prefix)
    generator = torch.Generator().manual_seed(6)
    questions = [torch.randint(3, 96, (n,), generator=generator) for n in (5, 17, 1)]
    settings = dict(max_new_tokens=150, min_new_tokens=150, do_sample=False, pad_token_id=0)
    alone = []
    for question in questions:
        own = prefill(model, prefix, progress=False)
        alone.append(model.generate(**continuation_inputs(prefix, [question]), **{cache_argument(model): own}, **settings)[0, -150:])
    shared = load_cache(path, model, batch_size=3)
    for layer, saved in zip(shared.layers, cache.layers):
        for field in ("key_codes_high", "key_codes_low", "value_codes", "key_scale", "sink_keys", "residual_keys", "pair_mask_bits"):
            assert all(torch.equal(row, getattr(saved, field)[0]) for row in getattr(layer, field))
    masks = [layer.pair_mask_bits.clone() for layer in shared.layers]
    inputs = continuation_inputs(prefix, questions, pad_token_id=0)
    assert inputs["input_ids"].shape == (3, 290 + 17) and inputs["attention_mask"][2].sum() == 291
    together = model.generate(**inputs, **{cache_argument(model): shared}, **settings)[:, -150:]
    for row in range(3):
        assert torch.equal(together[row], alone[row]), row
    assert all(torch.equal(layer.pair_mask_bits, mask) for layer, mask in zip(shared.layers, masks))
    assert int(shared.layers[0].num_groups.min()) >= 2  # the questions and answers were flushed with the prefix's selection
    with pytest.raises(ValueError, match="batch_size=0: allowed a positive multiple of the saved batch size 1"):
        load_cache(path, model, batch_size=0)


def test_a_static_cache_expands_a_prefix_in_place(tmp_path):
    model = patch_model(tiny_model("llama"), "kivi-2")
    prefix = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(7))
    cache = prefill(model, prefix, progress=False)
    path = tmp_path / "prefix.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path, model, batch_size=4, static=True, max_cache_len=300)
    assert loaded.layers[0].batch_size == 4
    first = torch.tensor([[1], [2], [3], [4]])
    expected = torch.cat([greedy(model, load_cache(path, model), first[i : i + 1], steps=30) for i in range(4)])
    assert torch.equal(greedy(model, loaded, first, steps=30), expected)


def test_continuation_inputs_left_pads_between_the_prompt_and_each_continuation():
    inputs = continuation_inputs(torch.tensor([[1, 2, 3]]), [[4, 5], [6]], pad_token_id=9)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 6]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        continuation_inputs(torch.tensor([1]), [[2], []])


# ---------------------------------------------------------------------------------------- the file
def test_the_file_holds_the_cache_bytes_and_the_info_reads_them(tmp_path):
    model = patch_model(tiny_model("llama", head_dim=64), "pnmix-1")
    ids, mask = prompt_batch(seed=8, length=500)
    cache = prefill(model, ids, mask, progress=False)
    path = tmp_path / "prompt.safetensors"
    info = save_cache(cache, path, extra={"note": "a test"})
    report = cache.memory_report()
    for part in ("sinks", "residual", "packed_keys", "packed_values", "key_scales_zeros", "value_scales_zeros", "lengths"):
        assert info.parts[part] == report[part], part
    # pair masks, and the per-sequence query counts that only per-group re-selection reads
    assert info.parts["masks"] == report["masks"] + 2 * 2 * 4
    assert info.tensor_bytes == sum(info.parts.values()) and info.prompt_token_ids is None
    assert 0 < info.file_bytes - info.tensor_bytes < 20_000  # the header
    assert info.extra == {"note": "a test"} and info.pnmix_config == PRESETS["pnmix-1"]
    assert info.model["num_key_value_heads"] == 2 and info.model["head_dim"] == 64 and "k_proj_sha256" not in info.model
    with safe_open(str(path), "pt") as reader:
        assert reader.get_tensor("layers.1.key_codes_high").dtype == torch.int32  # packed words, not dequantized values


# ---------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A pnmix-1 cache of a tiny Llama saved with its weights' digest and its prompt."""
    model = patch_model(tiny_model("llama"), "pnmix-1")
    ids, _ = prompt_batch(seed=9, batch=1)
    cache = prefill(model, ids, progress=False)
    path = tmp_path_factory.mktemp("saved") / "prompt.safetensors"
    save_cache(cache, path, model=model, prompt_token_ids=ids)
    return path, model, ids


def rewritten(path, target, metadata=None, tensors=None):
    """A copy of ``path`` with some metadata entries or tensors replaced."""
    with safe_open(str(path), "pt") as reader:
        contents = {name: reader.get_tensor(name) for name in reader.keys()}
        header = dict(reader.metadata())
    header.update(metadata or {})
    contents.update(tensors or {})
    save_file(contents, str(target), metadata=header)
    return target


def test_truncated_and_damaged_files_are_refused(saved, tmp_path):
    path, model, _ = saved
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(CacheFileError, match="not a readable safetensors file"):
        load_cache(truncated, model)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(data[:-50] + bytes([data[-50] ^ 0x10]) + data[-49:])  # one bit of the last tensor's data
    with pytest.raises(CacheFileError, match="fails its checksum: the file is damaged"):
        load_cache(damaged, model)
    header = tmp_path / "header.safetensors"
    header.write_bytes(data[:8] + b"[" + data[9:])  # the JSON header no longer parses
    with pytest.raises(CacheFileError, match="not a readable safetensors file"):
        load_cache(header, model)
    with pytest.raises(FileNotFoundError, match="no such cache file"):
        load_cache(tmp_path / "missing.safetensors", model)


def test_files_that_are_not_pnmix_caches_are_refused(saved, tmp_path):
    path, model, _ = saved
    text = tmp_path / "notes.safetensors"
    text.write_text("a text file, not safetensors")
    with pytest.raises(CacheFileError, match="not a readable safetensors file"):
        cache_info(text)
    weights = tmp_path / "weights.safetensors"
    save_file({"weight": torch.zeros(3)}, str(weights))
    with pytest.raises(CacheFileError, match="not a PN-Mix cache \\(no 'format' metadata"):
        load_cache(weights, model)
    other = rewritten(path, tmp_path / "other.safetensors", {"format": "gguf-kv"})
    with pytest.raises(CacheFileError, match="'format' is 'gguf-kv'"):
        load_cache(other, model)
    version = rewritten(path, tmp_path / "version.safetensors", {"format_version": str(FORMAT_VERSION + 1)})
    with pytest.raises(CacheFileError, match=f"format_version '{FORMAT_VERSION + 1}'.*reads format_version {FORMAT_VERSION}"):
        load_cache(version, model)


def test_another_model_or_config_is_named(saved):
    path, _, _ = saved
    with pytest.raises(CacheFileError, match="key_group_size: file 128, model 64.*pair_ratio: file 0.5, model 0.4"):
        load_cache(path, patch_model(tiny_model("llama"), "pnmix-2"))
    with pytest.raises(CacheFileError, match="model_type: file 'llama', model 'qwen3'"):
        load_cache(path, patch_model(tiny_model("qwen3"), "pnmix-1"))
    with pytest.raises(CacheFileError, match="num_key_value_heads: file 2, model 4"):
        load_cache(path, patch_model(tiny_model("llama", num_key_value_heads=4), "pnmix-1"))
    with pytest.raises(CacheFileError, match="rope"):
        load_cache(path, patch_model(tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0}), "pnmix-1"))
    with pytest.raises(CacheFileError, match="k_proj_sha256: file '[0-9a-f]+', model '[0-9a-f]+'"):
        load_cache(path, patch_model(tiny_model("llama", seed=1), "pnmix-1"))  # same shape, other weights
    with pytest.raises(ValueError, match="not patched"):
        load_cache(path, tiny_model("llama"))


def test_a_dtype_or_device_that_does_not_fit_is_named(saved, monkeypatch):
    path, _, _ = saved
    with pytest.raises(CacheFileError, match="holds a float32 cache; the model computes in bfloat16"):
        load_cache(path, patch_model(tiny_model("llama").to(torch.bfloat16), "pnmix-1"))
    info = cache_info(path)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 10**9))
    shapes = [{"sink_keys": (1, 2, 32, 32), "_dtypes": {"sink_keys": torch.float32}}]
    with pytest.raises(CacheFileError, match="needs 16,384 bytes on cuda:0, which has 1,000 free"):
        _check_free_memory(path, shapes, [torch.device("cuda:0")], 2)
    _check_free_memory(path, shapes, [torch.device("cpu")], 2)  # no check on the host
    assert info.dtype == torch.float32


def test_tampered_tensors_prompts_and_sizes_are_named(saved, tmp_path):
    path, model, ids = saved
    with safe_open(str(path), "pt") as reader:
        codes = reader.get_tensor("layers.0.key_codes_high")
        lengths = reader.get_tensor("layers.1.num_groups")
        checksums = json.loads(reader.metadata()["checksums"])
    reshaped = rewritten(path, tmp_path / "shape.safetensors", tensors={"layers.0.key_codes_high": codes[..., :-1].contiguous()})
    with pytest.raises(CacheFileError, match="layers.0.key_codes_high is \\[1, 2, 2, 2, 4, 15\\].*imply \\[1, 2, 2, 2, 4, 16\\]"):
        load_cache(reshaped, model)
    import zlib

    from pnmix_patch.cache_io import _tensor_bytes

    assert lengths.tolist() == [2]  # 268 tokens past the sinks: two groups of 128 flushed, 12 in the residual
    bad = lengths + 5
    checksums["layers.1.num_groups"] = zlib.crc32(_tensor_bytes(bad))
    out_of_bounds = rewritten(path, tmp_path / "lengths.safetensors", {"checksums": json.dumps(checksums)}, {"layers.1.num_groups": bad})
    with pytest.raises(CacheFileError, match="layers.1.num_groups = \\[7\\] is out of bounds \\[0, 2\\]"):
        load_cache(out_of_bounds, model)
    with pytest.raises(CacheFileError, match="holds another prompt"):
        load_cache(path, model, prompt_token_ids=ids + 1)
    assert load_cache(path, model, prompt_token_ids=ids[0]) is not None
    with pytest.raises(CacheFileError, match="max_cache_len=300 leaves no room"):
        load_cache(path, model, static=True, max_cache_len=300)
    with pytest.raises(ValueError, match="static=True needs max_cache_len"):
        load_cache(path, model, static=True)


def test_saving_needs_a_filled_cache_and_a_matching_model(saved, tmp_path):
    _, model, _ = saved
    with pytest.raises(ValueError, match="holds no tokens"):
        save_cache(new_cache(model), tmp_path / "empty.safetensors")
    cache = prefill(model, torch.randint(3, 96, (1, 40)), progress=False)
    with pytest.raises(CacheFileError, match="num_key_value_heads: model 4, cache 2"):
        save_cache(cache, tmp_path / "other.safetensors", model=patch_model(tiny_model("llama", num_key_value_heads=4), "pnmix-1"))
    with pytest.raises(ValueError, match="prompt_token_ids of shape \\[2, 40\\]"):
        save_cache(cache, tmp_path / "ids.safetensors", prompt_token_ids=torch.zeros(2, 40, dtype=torch.long))
    assert not list(tmp_path.glob("*.partial"))


# ---------------------------------------------------------------------------------------- the real model and the command line
@pytest.fixture(scope="module")
def smollm2():
    from pnmix_patch.eval.models import load_model

    return load_model()


def test_the_command_line_saves_describes_and_answers_from_a_cache_of_smollm2(smollm2, tmp_path, capsys, monkeypatch):
    """``pnmix cache save``, ``pnmix cache info`` and ``pnmix generate --cache`` with two questions sharing
    the saved document, on the real SmolLM2: each answer is the one the model gives from the document
    prefilled in memory, its question following alone."""
    import pnmix_patch.cli as cli
    from pnmix_patch import unpatch_model
    from pnmix_patch.eval.models import hamlet_text

    model, tokenizer = smollm2
    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: (model, tokenizer))
    document, path = tmp_path / "document.txt", tmp_path / "document.safetensors"
    document.write_text(hamlet_text()[:1600], encoding="utf-8")
    questions = ["Who speaks first?", "Where are they?"]
    try:
        assert cli.main(["cache", "save", "--prompt-file", str(document), "--out", str(path), "--chat"]) == 0
        assert cli.main(["cache", "info", str(path)]) == 0
        printed = capsys.readouterr().out
        info = cache_info(path)
        tokens = info.prompt_token_ids.shape[1]
        assert tokens > 32 + 128 + 128  # the prompt filled packed groups
        assert f"{tokens} positions, 30 layers" in printed and "config: pnmix-1" in printed and "num_key_value_heads=3" in printed
        assert f"prompt: {tokens} token ids" in printed and "packed_keys" in printed
        assert cli.main(["generate", "--cache", str(path), "--tokens", "12", *(f"--prompt={q}" for q in questions)]) == 0
        printed = capsys.readouterr().out
        suffix = info.extra["question_suffix"]
        for question in questions:
            ids = tokenizer(question + suffix, add_special_tokens=False).input_ids
            own = prefill(model, info.prompt_token_ids, progress=False)
            inputs = continuation_inputs(info.prompt_token_ids, [ids])
            output = model.generate(**inputs, **{cache_argument(model): own}, max_new_tokens=12, do_sample=False)
            answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            assert f"===== {question} =====\n{answer}\n" in printed
    finally:
        unpatch_model(model)
