"""What the benchmarks share: timing and reporting, the decode-attention shapes and presets they time, and the
decode-step helpers (filling a cache to a context, timing synchronized steps, the fair bf16 attention).

Every benchmark writes one JSON report through :func:`report_writer` (date, commit, GPU, torch, host and the
command as run, rewritten after every row so that a run cut short keeps what it timed).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from triton.testing import do_bench, do_bench_cudagraph

from pnmix_patch import GraphedDecodeStep, PNMixConfig
from pnmix_patch.kernels.decode_append import decode_append, decode_append_reference
from pnmix_patch.kernels.pack_keys import pack_keys
from pnmix_patch.kernels.pack_values import pack_values
from pnmix_patch.reference.quantize import channel_order, key_code_shape, quantize_keys

# ---------------------------------------------------------------------------- timing and reports
PRESETS = {
    name: PNMixConfig(**params, name=name)
    for name, params in {
        "pnmix-1": {},
        "pnmix-2": {"pair_ratio": 0.4, "key_group_size": 64},
        "kivi-2": {"pair_ratio": 1.0, "key_bits_high": 2, "key_bits_low": 2},
    }.items()
}

PNMIX2_FACTORS = {
    "pnmix-1": PNMixConfig(),
    "pnmix-1, G=64": PNMixConfig(key_group_size=64),
    "pnmix-2, G=128": PNMixConfig(pair_ratio=0.4),
    "pnmix-2": PNMixConfig(pair_ratio=0.4, key_group_size=64),
    "kivi-2": PNMixConfig(pair_ratio=1.0, key_bits_high=2, key_bits_low=2),
}
"""pnmix-2's two differences from pnmix-1 apart: its 64-token groups, and its 52 selected channels (a
high codes tensor whose last 32-channel chunk holds 20: stored compacted, ``reference.quantize.compact_key_fields``)."""


Q_HEADS, KV_HEADS, HEAD_DIM, SINKS, RESIDUAL = 32, 8, 128, 32, 128


def median_ms(function) -> float:
    """Median GPU milliseconds of CUDA-graph replays (plain launches if capture fails)."""
    try:
        return do_bench_cudagraph(function, rep=200, return_mode="median")
    except Exception as error:  # e.g. an op that cannot be captured
        print(f"    (CUDA graph capture failed: {type(error).__name__}; timing eager launches)")
        return do_bench(function, rep=200, return_mode="median")


def sdpa_ms_and_bytes(device, batch: int, tokens: int) -> tuple[float, int]:
    """Median ms of bf16 SDPA for one decode query over an uncompressed cache of ``tokens`` (GQA
    without copies), and the bytes it must read."""
    keys = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True))
    nbytes = 2 * keys.numel() * 2 + query.numel() * 2
    del keys, values
    torch.cuda.empty_cache()
    return ms, nbytes


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + write) by a 2 GiB device-to-device copy: median of 20 plain
    launches timed by CUDA events. Not by :func:`median_ms` (CUDA-graph replays): timed that way the
    copy gave 2,776-2,777 GB/s on the H200 in this script's runs, against 4,164-4,256 GB/s timed
    like this in ``bench_decode.py``'s, while bf16 SDPA here read 4.5 TB/s."""
    source = torch.empty(2**30, dtype=torch.int16, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * source.numel() * 2 / (statistics.median(times) * 1e-3)


def random_order(batch, num_high, device, heads=KV_HEADS):
    mask = torch.rand(batch, heads, HEAD_DIM, device=device).argsort(-1) < num_high
    return channel_order(mask)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and elements (NaNs compared equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def key_packing_matches(config: PNMixConfig, keys: torch.Tensor, order: torch.Tensor) -> bool:
    """Whether the key packer (``pack_keys``) writes exactly the PyTorch reference's words, scales and
    zeros (``quantize_keys``, on the same device) for ``config`` and the channel ``order`` (selected
    channels first)."""
    num_high = config.num_high_channels(keys.shape[-1])
    bits = (config.key_bits_high, config.key_bits_low)
    mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
    got = pack_keys(keys, order, num_high, config.key_group_size, *bits, True)
    want = quantize_keys(keys, mask, num_high, config.key_group_size, *bits, True)
    return all(identical(g, w) for g, w in zip(got, want))


def build_cache(config: PNMixConfig, batch: int, tokens: int, dtype, device, ragged=False):
    """Arguments of decode_attention for ``tokens`` cached tokens per sequence (kernels pack them)."""
    group = config.key_group_size
    num_high = config.num_high_channels(HEAD_DIM)
    groups = max((tokens - SINKS - RESIDUAL) // group, 0)
    residual = tokens - SINKS - groups * group
    order = random_order(batch, num_high, device)
    keys = torch.randn(batch, KV_HEADS, groups * group, HEAD_DIM, device=device, dtype=dtype)
    key_parts = pack_keys(keys, order, num_high, group, config.key_bits_high, config.key_bits_low, True)
    value_parts = pack_values(torch.randn_like(keys), config.value_bits, HEAD_DIM, True, group)
    del keys
    if ragged:
        lengths = (torch.randint(0, SINKS + 1, (batch,)), torch.randint(0, groups + 1, (batch,)), torch.randint(1, RESIDUAL + 1, (batch,)))
    else:
        lengths = (torch.full((batch,), SINKS), torch.full((batch,), groups), torch.full((batch,), residual))
    sink_len, num_groups, residual_len = (x.to(device=device, dtype=torch.int32) for x in lengths)

    def dense(n):
        return torch.randn(batch, KV_HEADS, n, HEAD_DIM, device=device, dtype=dtype)

    query = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    return (
        query,
        order,
        dense(SINKS),
        dense(SINKS),
        sink_len,
        *key_parts,
        *value_parts,
        num_groups,
        dense(RESIDUAL),
        dense(RESIDUAL),
        residual_len,
        HEAD_DIM**-0.5,
    )


def code_commit() -> str:
    """The commit of the code that runs: ``$PNMIX_COMMIT`` where set (a copy of the working tree whose git
    metadata is not its own), else git's ``HEAD``."""
    return (
        os.environ.get("PNMIX_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )


def report_writer(out: str, name: str, script: str) -> callable:
    """A function ``write(complete=False, **sections)`` that (re)writes ``out/name``: the date, commit,
    GPU, torch, host, the seconds since this call, the command (``script`` and this process's arguments),
    ``complete`` and ``sections``. Call it after every row, so that a run cut short (a device call's
    time limit) leaves the rows it timed, with ``"complete": false``. The commit: :func:`code_commit`."""
    started = time.time()
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": code_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "host": platform.node(),
        "command": " ".join([f"python {script}"] + sys.argv[1:]),
    }
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool = False, **sections) -> None:
        report = dict(header, seconds=round(time.time() - started, 1), complete=complete, **sections)
        path.write_text(json.dumps(report, indent=2))

    return write


# ---------------------------------------------------------------------------- decode steps
PROMPT, WARMUP, STEPS = 64, 8, 40


def gqa_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Decode steps: SDPA with ``enable_gqa=True``, the KV heads read once, never expanded
    (``repeat_kv``). Prefill chunks take transformers' stock SDPA path."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2), None


AttentionInterface.register("sdpa_gqa", gqa_sdpa)


AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)


def cache_arg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def check_decode_append(device) -> dict:
    """The CUDA op (Triton) against the reference on every append/flush/overflow case (pnmix-1's layout)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    config = PRESETS["pnmix-1"]
    batch, heads, dim, sinks, residual, group_cap = 5, 8, 128, 32, 128, 4
    group = config.key_group_size
    order = channel_order(torch.rand(batch, heads, dim, generator=generator).argsort(-1) < config.num_high_channels(dim))
    results = {}
    for dtype in (torch.bfloat16, torch.float16):

        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=generator).to(dtype)

        def codes(*shape):
            return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32)

        scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        args = [
            randn(batch, heads, dim),
            randn(batch, heads, dim),
            order,
            randn(batch, heads, sinks, dim),
            randn(batch, heads, sinks, dim),
            torch.tensor([3, 32, 32, 32, 32], dtype=torch.int32),
            randn(batch, heads, residual, dim) * 3,
            randn(batch, heads, residual, dim),
            torch.tensor([0, 17, 128, 128, 128], dtype=torch.int32),
            *(codes(batch, heads, *key_code_shape(group_cap, planes, group, channels)) for planes, channels in config.key_code_widths(dim)),
            randn(batch, heads, group_cap, dim, dtype=scale_dtype),
            randn(batch, heads, group_cap, dim, dtype=scale_dtype),
            codes(batch, heads, group_cap * group, config.value_bits, dim // 32),
            randn(batch, heads, group_cap * group, dim // config.value_group(dim), dtype=scale_dtype),
            randn(batch, heads, group_cap * group, dim // config.value_group(dim), dtype=scale_dtype),
            torch.tensor([0, 1, 0, 3, 4], dtype=torch.int32),
            torch.zeros(batch, dtype=torch.bool),
            torch.zeros(batch, dtype=torch.int32),
            True,
        ]
        expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        decode_append_reference(*expected)
        on_device = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        decode_append(*on_device)
        same = all(torch.equal(a.cpu(), b) for a, b in zip(on_device, expected) if isinstance(a, torch.Tensor))
        results[str(dtype)] = same
        print(f"  decode_append {dtype}: bit-exact vs reference = {same}", flush=True)
    return results


def fill_pnmix(cache, context: int) -> int:
    """Bring every layer of a prefilled PN-Mix cache to ``context`` tokens: random codes, lengths set.
    Returns the bytes a decode step reads (sinks, groups, residual, scales, order)."""
    nbytes = 0
    for layer in cache.layers:
        cfg = layer.pnmix_config
        groups = (context - cfg.sink_tokens - 1) // cfg.key_group_size  # the residual keeps 1..G tokens
        residual = context - cfg.sink_tokens - groups * cfg.key_group_size
        if groups > layer.group_capacity:
            layer._reserve_groups(groups)
        tokens = groups * cfg.key_group_size
        for name in ("key_codes_high", "key_codes_low", "value_codes"):
            part = getattr(layer, name)[:, :, : tokens if name == "value_codes" else groups]
            part.copy_(torch.randint_like(part, -(2**31), 2**31 - 1))
        for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
            part = getattr(layer, name)[:, :, : tokens if name.startswith("value") else groups]
            part.copy_(torch.rand_like(part) * 0.1)
        layer.residual_keys.normal_()
        layer.residual_values.normal_()
        layer.num_groups.fill_(groups)
        layer.residual_len.fill_(residual)
        layer.seen_tokens = context
        read = [layer.sink_keys, layer.sink_values, layer.order if hasattr(layer, "order") else layer.pair_mask_bits]
        read += [getattr(layer, n)[:, :, :groups] for n in ("key_codes_high", "key_codes_low", "key_scale", "key_zero")]
        read += [getattr(layer, n)[:, :, :tokens] for n in ("value_codes", "value_scale", "value_zero")]
        read += [layer.residual_keys[:, :, :residual], layer.residual_values[:, :, :residual]]
        nbytes += sum(t.numel() * t.element_size() for t in read)
    return nbytes


def fill_bf16(cache, context: int) -> int:
    """Bring a prefilled transformers cache to ``context`` tokens; returns bytes a step reads."""
    nbytes = 0
    for layer in cache.layers:
        if isinstance(cache, StaticCache):
            layer.keys.normal_()
            layer.values.normal_()
            layer.cumulative_length.fill_(context)
            nbytes += 2 * layer.keys.numel() * layer.keys.element_size()  # SDPA reads the whole static buffer
        else:
            shape = (*layer.keys.shape[:2], context, layer.keys.shape[-1])
            layer.keys = torch.randn(shape, dtype=layer.keys.dtype, device=layer.keys.device)
            layer.values = torch.randn_like(layer.keys)
            nbytes += 2 * layer.keys.numel() * layer.keys.element_size()
    return nbytes


def graphed_forward(model, cache, reset=True, pdl=None):
    """A :class:`~pnmix_patch.GraphedDecodeStep` of ``model`` on ``cache`` (fresh Dynamo state unless
    not ``reset``; ``pdl`` as the class takes it) behind ``model.forward``'s call shape, as
    :func:`time_steps` and :func:`profile_steps` call it."""
    if reset:
        torch._dynamo.reset()
    step = GraphedDecodeStep(model, cache, pdl=pdl)
    return lambda input_ids, **_: types.SimpleNamespace(logits=step(input_ids))


def time_steps(runs, name, warmup=WARMUP, steps=STEPS, turn=1, untimed=0, batch=1) -> list[dict]:
    """Synchronized decode steps of each ``(forward, model, cache)`` in ``runs``. With several runs
    they take turns of ``turn`` consecutive steps each, the order reversed every other round (A B,
    B A, ...), so that a drift of the process's host time falls on all of them alike.

    For each run: ``ms``, the per-step milliseconds (CUDA events) of ``steps`` steps, and
    ``host_us``, the time until each of those calls returned (the GPU idle when it began), after
    ``warmup`` steps. The first ``untimed`` steps of each turn are run but not timed: a call right
    after a switch finds the CPU caches holding the other model's objects and takes longer on the
    host, which a model decoding alone does not pay. ``host_us_by_position[k]`` holds the host times of every turn's step ``k``, untimed
    ones included (how many calls the host needs to recover), and ``turns`` the timed steps'
    indices of each turn (for per-turn ratios)."""
    if not 0 <= untimed < turn:
        raise ValueError(f"untimed={untimed}: allowed 0 to turn - 1 = {turn - 1}")
    rounds = steps_taken(steps, warmup, turn, untimed) // turn
    tokens = [torch.zeros(batch, 1, dtype=torch.long, device=model.device) for _, model, _ in runs]
    timed = [{"ms": [], "host_us": [], "host_us_by_position": [[] for _ in range(turn)], "turns": []} for _ in runs]
    with torch.no_grad():
        for round_ in range(rounds):
            for index in range(len(runs)) if round_ % 2 == 0 else reversed(range(len(runs))):
                forward, _, cache = runs[index]
                record, indices = timed[index], []
                for step in range(turn):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    called = time.perf_counter()
                    logits = forward(input_ids=tokens[index], **{name: cache}).logits
                    returned = time.perf_counter()
                    end.record()
                    end.synchronize()
                    tokens[index] = logits[:, -1:].argmax(-1)
                    if round_ * turn + step < warmup or len(record["ms"]) == steps:
                        continue
                    record["host_us_by_position"][step].append((returned - called) * 1e6)
                    if step >= untimed:
                        indices.append(len(record["ms"]))
                        record["ms"].append(start.elapsed_time(end))
                        record["host_us"].append((returned - called) * 1e6)
                if indices:
                    record["turns"].append(indices)
    return timed


def steps_taken(steps, warmup=WARMUP, turn=1, untimed=0) -> int:
    """Decode steps :func:`time_steps` runs per run (for sizing a static cache)."""
    return (math.ceil(warmup / turn) + math.ceil(steps / (turn - untimed))) * turn


def prefill(model, cache, name, batch=1, tokens=PROMPT):
    prompt = torch.randint(0, 1000, (batch, tokens), device=model.device)
    with torch.no_grad():
        model(input_ids=prompt, logits_to_keep=1, **{name: cache})  # last-token logits only, as generate
