"""Capacity planning: KV-cache bytes, peak GPU memory, the largest batch, the longest generation.

For a model config, a preset, a batch, a prompt and a generation length:

- **KV-cache bytes** are what the static caches allocate for ``prompt + generated``
  positions. bf16: ``2 (K, V) x layers x batch x kv_heads x positions x head_dim x 2``
  bytes (transformers' ``StaticCache``). PN-Mix: one :class:`~pnmix_patch.static_cache.PNMixStaticLayer`
  is allocated on the ``meta`` device (no memory) and its ``memory_bytes()`` summed,
  times the layers: sinks, residual, packed groups, scales, masks and channel order,
  exactly what a real run allocates, never a restated formula.
- **Weights** are counted from the model built on the ``meta`` device.
- **Working memory** of the largest step is an estimate (the one part not read from
  the code): the prefill of ``batch x prompt`` tokens (hidden states, q/k/v and the
  repeated keys/values of exact attention, the MLP's three intermediate tensors, pair
  scores; for PN-Mix also one layer's cache, which the static cache's first layer holds beside
  the stacked storage of all layers while it copies its tensors in), a decode step's float32
  logits, and for bf16 with ``bf16_attention="stock"``
  one layer's keys and values expanded to the query heads over the whole static cache:
  transformers' SDPA path repeats the KV heads (``repeat_kv``) whenever it passes a mask,
  as a compiled decode step over a ``StaticCache`` does. With ``"gqa"`` (SDPA reading the
  KV heads directly, ``enable_gqa=True``, as ``benchmarks/bench_decode.py``'s fair
  baseline) nothing is expanded. An eager prefill into an empty cache needs no mask
  (SDPA's causal path), so the prefill term has no expansion either way. Compiling the
  decode step needs room for a copy of the largest weight matrix (inductor's matmul
  padding pass benchmarks on a random copy of it: a bf16 run planned without this term
  ran out of memory while compiling, allocating 1.16 GiB, the output embedding of the
  Qwen3-8B shape), counted instead of the prefill's activations when larger.
  Measured peaks assume ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (little
  fragmentation); without it the allocator can hold a GiB or more of unusable blocks.
- **Peak** = weights + cache + working memory. The largest batch for a length and the
  longest generation for a batch are the largest values whose peak fits the budget.

``benchmarks/bench_throughput.py`` compares these plans with measured peaks on a GPU.
Command line: ``python -m pnmix_patch.planner --model qwen3-8b --batch 32 --prompt 141
--generate 8192 --budget 40GB`` (also ``pnmix plan``).
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

from .config import PNMixConfig, resolve_config

MODEL_SHAPES = {
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # llama3 RoPE scaling is left out: it changes the rotation frequencies, not sizes or cost.
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
"""Configs of real model shapes (random weights time and size the same as real ones)."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def model_config(model) -> object:
    """A transformers config from a config object, a shape name of :data:`MODEL_SHAPES`,
    ``"smollm2"``, a ``.gguf`` file, a local folder or a hub id."""
    from transformers import AutoConfig

    if not isinstance(model, str):
        return model
    if model in MODEL_SHAPES:
        fields = dict(MODEL_SHAPES[model])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if model == "smollm2":
        from .eval.models import smollm2_path

        model = str(smollm2_path())
    known = f"a shape ({', '.join(MODEL_SHAPES)}), 'smollm2', a .gguf file, a model folder or a hub id (org/name)"
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model={model!r}: no such .gguf file; allowed {known}")
        folder, file = os.path.split(os.path.abspath(model))
        return AutoConfig.from_pretrained(folder, gguf_file=file)
    if not os.path.isdir(model) and "/" not in model:
        raise ValueError(f"model={model!r} is unknown: allowed {known}")
    try:
        return AutoConfig.from_pretrained(model)
    except OSError as error:
        raise ValueError(f"model={model!r}: no config found ({error.__class__.__name__}); allowed {known}") from None


def parse_bytes(text: str | int | float) -> int:
    """``"40GB"``, ``"39.5GiB"``, ``"1e9"`` or a number of bytes -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r}: allowed e.g. '40GB', '39.5GiB', '4e10'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class CapacityPlanner:
    """Memory plans of one model in one dtype.

    Args:
        model: a config or anything :func:`model_config` accepts.
        dtype: the model's dtype (weights, activations, bf16 cache), default bfloat16.
        bf16_attention: how the bf16 baseline's decode steps read the cache: ``"stock"``
            (transformers' SDPA path, KV heads expanded over the whole cache, the default)
            or ``"gqa"`` (SDPA with ``enable_gqa=True``, nothing expanded).
    """

    BF16_ATTENTION = ("stock", "gqa")

    def __init__(self, model, dtype: torch.dtype = torch.bfloat16, bf16_attention: str = "stock"):
        from transformers import AutoModelForCausalLM

        if bf16_attention not in self.BF16_ATTENTION:
            raise ValueError(f"bf16_attention={bf16_attention!r} is invalid: allowed {', '.join(self.BF16_ATTENTION)}")
        self.config = model_config(model).get_text_config(decoder=True)
        self.dtype = dtype
        self.bf16_attention = bf16_attention
        config = self.config
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
        self.largest_matrix_bytes = max(p.numel() * p.element_size() for p in meta_model.parameters())
        del meta_model

    # -------------------------------------------------------------- cache bytes
    def bf16_cache_bytes(self, batch: int, positions: int) -> int:
        """Bytes of a transformers ``StaticCache`` in the model dtype for ``positions``."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * batch * self.kv_heads * positions * self.head_dim * element

    def pnmix_cache_bytes(self, preset: PNMixConfig | str, batch: int, positions: int) -> int:
        """Bytes a :class:`~pnmix_patch.static_cache.PNMixStaticCache` allocates for ``positions``."""
        from .static_cache import PNMixStaticLayer

        layer = PNMixStaticLayer(resolve_config(preset), max_cache_len=positions)
        states = torch.empty(batch, self.kv_heads, 1, self.head_dim, dtype=self.dtype, device="meta")
        layer.lazy_initialization(states, states)
        parts = layer.memory_bytes()
        del parts["quantized_elements"]
        return self.layers * sum(parts.values())

    def cache_bytes(self, preset: PNMixConfig | str | None, batch: int, positions: int) -> int:
        """bf16 cache bytes when ``preset`` is None, else the preset's."""
        if preset is None:
            return self.bf16_cache_bytes(batch, positions)
        return self.pnmix_cache_bytes(preset, batch, positions)

    # ------------------------------------------------------------- peak memory
    def working_bytes(self, batch: int, prompt: int, quantized: bool, positions: int = 0, layer_bytes: int = 0) -> int:
        """Estimated transient memory of the largest step: prefill of ``batch x prompt`` tokens,
        or a decode step's float32 logits (see the module docstring). For the bf16 static
        cache (``quantized=False``) with ``bf16_attention="stock"`` also one layer's keys and
        values expanded to the query heads over all ``positions`` (``repeat_kv``). ``layer_bytes``:
        one layer's cache, held twice during the prefill (the PN-Mix static cache's first layer
        allocates its own tensors, then the stacked storage of all layers, then copies them in)."""
        config, element = self.config, torch.empty((), dtype=self.dtype).element_size()
        tokens = batch * prompt
        q_heads = config.num_attention_heads
        per_token = (
            4 * config.hidden_size  # residual stream, normed input, attention output, MLP output
            + (q_heads + 2 * self.kv_heads) * self.head_dim  # q, k, v
            + 3 * config.intermediate_size  # gate, up, act(gate) * up
        ) * element
        if quantized:
            per_token += 2 * q_heads * self.head_dim * element  # exact prefill: KV heads repeated for SDPA
            per_token += (q_heads + self.kv_heads) * self.head_dim // 2 * 4  # pair scores (float32 pair norms)
        logits = 2 * batch * config.vocab_size * 4  # last-token logits in float32, and their copy
        expands = not quantized and self.bf16_attention == "stock"
        expanded = 2 * batch * q_heads * positions * self.head_dim * element if expands else 0
        # torch.compile's matmul padding pass times a random copy of each weight operand while
        # compiling the decode step (after the prefill's activations are freed).
        return max(tokens * per_token + layer_bytes, self.largest_matrix_bytes) + logits + expanded

    def _working_bytes(self, preset, batch: int, prompt: int, positions: int) -> int:
        """:meth:`working_bytes` of ``preset`` (None: bf16), with a PN-Mix layer's transient copy."""
        layer_bytes = 0 if preset is None else self.cache_bytes(preset, batch, positions) // self.layers
        return self.working_bytes(batch, prompt, preset is not None, positions, layer_bytes)

    def peak_bytes(self, preset: PNMixConfig | str | None, batch: int, prompt: int, generated: int) -> int:
        """Weights + cache for ``prompt + generated`` positions + working memory."""
        positions = prompt + generated
        return self.weight_bytes + self.cache_bytes(preset, batch, positions) + self._working_bytes(preset, batch, prompt, positions)

    def largest_batch(self, preset, prompt: int, generated: int, budget: int) -> int:
        """Largest batch whose peak fits ``budget`` bytes (0 if none)."""
        return _largest(lambda batch: self.peak_bytes(preset, batch, prompt, generated) <= budget, 0)

    def longest_generation(self, preset, batch: int, prompt: int, budget: int) -> int:
        """Most tokens ``batch`` sequences can generate after ``prompt`` within ``budget`` (0 if none)."""
        return _largest(lambda generated: self.peak_bytes(preset, batch, prompt, generated) <= budget, 0)

    def plan(self, preset: PNMixConfig | str, batch: int, prompt: int, generated: int, budget: int | None = None) -> dict:
        """The plan of the module docstring for bf16 and ``preset``, as a dict of plain numbers."""
        preset = resolve_config(preset)
        positions = prompt + generated
        result = {
            "model_type": self.config.model_type,
            "dtype": str(self.dtype).replace("torch.", ""),
            "preset": preset.name,
            "batch": batch,
            "prompt": prompt,
            "generated": generated,
            "weight_bytes": self.weight_bytes,
            "bf16_attention": self.bf16_attention,
        }
        for label, method in (("bf16", None), (preset.name, preset)):
            entry = {
                "cache_bytes": self.cache_bytes(method, batch, positions),
                "working_bytes": self._working_bytes(method, batch, prompt, positions),
                "peak_bytes": self.peak_bytes(method, batch, prompt, generated),
            }
            if budget is not None:
                entry["largest_batch"] = self.largest_batch(method, prompt, generated, budget)
                entry["longest_generation"] = self.longest_generation(method, batch, prompt, budget)
            result[label] = entry
        result["cache_ratio"] = result["bf16"]["cache_bytes"] / result[preset.name]["cache_bytes"]
        if budget is not None:
            result["budget_bytes"] = budget
        return result


def _largest(fits, low: int) -> int:
    """Largest integer ``n >= low`` with ``fits(n)``, for a monotone ``fits`` (``low`` if none above)."""
    if not fits(low + 1):
        return low
    high = low + 1
    while fits(high * 2):
        high *= 2
        if high > 2**40:
            raise ValueError("the budget fits an unbounded size: is the model empty?")
    high *= 2  # fits(high // 2) and not fits(high)
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def format_plan(plan: dict) -> str:
    """A short human-readable table of :meth:`CapacityPlanner.plan`'s result."""
    gib = 2**30
    preset = plan["preset"]
    lines = [
        f"{plan['model_type']} ({plan['dtype']}), batch {plan['batch']}, prompt {plan['prompt']} + "
        f"{plan['generated']} generated tokens; weights {plan['weight_bytes'] / gib:.2f} GiB",
        f"{'':12s} {'KV cache':>12s} {'working':>10s} {'peak':>10s}"
        + ("  largest batch  longest generation" if "budget_bytes" in plan else ""),
    ]
    for label in ("bf16", preset):
        entry = plan[label]
        line = f"{label:12s} {entry['cache_bytes'] / gib:9.2f} GiB {entry['working_bytes'] / gib:6.2f} GiB {entry['peak_bytes'] / gib:6.2f} GiB"
        if "budget_bytes" in plan:
            line += f"  {entry['largest_batch']:13d}  {entry['longest_generation']:18d}"
        lines.append(line)
    lines += _unfit_reasons(plan)
    lines.append(
        f"cache compression: {plan['cache_ratio']:.2f}x"
        + (f"; budget {plan['budget_bytes'] / gib:.2f} GiB" if "budget_bytes" in plan else "")
    )
    return "\n".join(lines)


def _unfit_reasons(plan: dict) -> list[str]:
    """Why a budgeted plan found no batch or no generation that fits, one line each."""
    if "budget_bytes" not in plan:
        return []
    gib, budget, reasons = 2**30, plan["budget_bytes"], []
    for label in ("bf16", plan["preset"]):
        entry = plan[label]
        if plan["weight_bytes"] >= budget:
            reasons.append(f"{label}: the weights alone ({plan['weight_bytes'] / gib:.2f} GiB) exceed the budget")
            continue
        if entry["largest_batch"] == 0:
            reasons.append(
                f"{label}: not even batch 1 fits {plan['prompt']} + {plan['generated']} tokens in the budget: "
                "shorten the generation or raise the budget"
            )
        if entry["longest_generation"] == 0:
            reasons.append(f"{label}: batch {plan['batch']} cannot generate a token after the prompt in the budget: lower the batch")
    return reasons


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's command-line options (``pnmix plan`` and ``python -m pnmix_patch.planner``)."""
    parser.add_argument(
        "--model", required=True, help=f"a shape ({', '.join(MODEL_SHAPES)}), 'smollm2', a .gguf file, a folder or a hub id"
    )
    parser.add_argument("--preset", default="pnmix-1")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=141, help="prompt tokens (default 141)")
    parser.add_argument("--generate", type=int, default=8192, help="generated tokens (default 8192)")
    parser.add_argument("--budget", default=None, help="memory budget, e.g. 40GB or 39.5GiB: adds the largest batch and longest generation")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--bf16-attention",
        default="stock",
        choices=CapacityPlanner.BF16_ATTENTION,
        help="bf16 decode attention: 'stock' transformers SDPA (expands the KV heads) or 'gqa' (enable_gqa)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    """Print the plan of parsed :func:`add_arguments` options (``ValueError`` on bad values)."""
    for name, least in (("batch", 1), ("prompt", 1), ("generate", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: allowed an integer >= {least}")
    planner = CapacityPlanner(args.model, getattr(torch, args.dtype), args.bf16_attention)
    plan = planner.plan(args.preset, args.batch, args.prompt, args.generate, None if args.budget is None else parse_bytes(args.budget))
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pnmix_patch.planner", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        raise SystemExit(run(parser.parse_args()))
    except ValueError as error:
        parser.error(str(error))
