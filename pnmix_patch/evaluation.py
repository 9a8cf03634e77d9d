"""Fidelity evaluation on real models: methods, metrics, bit-rate sweep and plots (``pnmix eval``).

Every method is a :class:`~pnmix_patch.config.PNMixConfig` run through this library's
own cache and attention code, so baselines, criteria and ablations differ only in
their config (``kivi-2`` and ``kitty`` included).

Metrics:

- **Attention KL** (:func:`attention_kl`): the paper's criterion comparison. One
  full-precision forward over ``context + queries`` tokens records every layer's
  post-RoPE queries, keys and values; each layer's :class:`~pnmix_patch.cache.PNMixLayer`
  is then prefilled with the first ``context`` tokens and fed the next ``queries``
  tokens one at a time (the library's own ``attend``). At every decode step the
  full-precision query of that step attends (a) the exact keys and (b) the keys the
  cache holds (sinks, dequantized groups, residual); the KL divergence
  ``KL(exact || cached)`` of the two attention distributions is averaged over
  decode steps, query heads and layers. The same query feeds both, so this isolates
  key quantization (values do not enter an attention distribution).
- **Long-output fidelity** (:func:`long_output_fidelity`): greedy full-precision
  continuations of prompts written here (math word problems, code), then each
  method's cache is teacher-forced along them token by token
  (:func:`pnmix_patch.fidelity.teacher_force`): mean next-token KL and top-1
  agreement against one full-precision forward pass.

"Full precision" is the model's dtype: float32 on CPU (the paper's FP16 baseline).
Key bits are measured from the cache's storage (``memory_report``), masks included.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .api import new_cache, patch_model, unpatch_model
from .cache import PNMixLayer, summarize_memory
from .config import PRESETS, SELECTION_CRITERIA, PNMixConfig
from .fidelity import reference_logits, teacher_force

SWEEP_RATES = (3.0, 2.5, 2.25, 2.0, 1.5)
"""Average key bits of the bit-rate sweep (codes + 16-bit scale and zero per channel per group)."""

SWEEP_METHODS = ("kivi", "kitty", "pnmix")

_SWEEP_FIELDS = {
    # uniform b bits, every channel; the rate is set by the group size G (scale+zero = 32/G bits)
    "kivi": {
        3.0: dict(key_bits_high=2, key_bits_low=2, key_group_size=32),
        2.5: dict(key_bits_high=2, key_bits_low=2, key_group_size=64),
        2.25: dict(key_bits_high=2, key_bits_low=2, key_group_size=128),
        2.0: dict(key_bits_high=1, key_bits_low=1, key_group_size=32),
        1.5: dict(key_bits_high=1, key_bits_low=1, key_group_size=64),
    },
    # G=128; a fraction of channels (by magnitude, per group) at 4 bits, the rest at 2 bits,
    # or at 1 bit below 2.5 bits (2-bit base + boosts cannot go under 2.25)
    "kitty": {
        3.0: dict(pair_ratio=0.375, key_bits_high=4, key_bits_low=2),
        2.5: dict(pair_ratio=0.125, key_bits_high=4, key_bits_low=2),
        2.25: dict(pair_ratio=1 / 3, key_bits_high=4, key_bits_low=1),
        2.0: dict(pair_ratio=0.25, key_bits_high=4, key_bits_low=1),
        1.5: dict(pair_ratio=1 / 12, key_bits_high=4, key_bits_low=1),
    },
    # G=128, 3 / 1 bits; key bits = 1.25 + 2 r
    "pnmix": {rate: dict(pair_ratio=(rate - 1.25) / 2) for rate in SWEEP_RATES},
}
SWEEP_BASE = {"kivi": "kivi-2", "kitty": "kitty", "pnmix": "pnmix-1"}


def sweep_config(method: str, rate: float) -> PNMixConfig:
    """The config of ``method`` (``kivi``, ``kitty`` or ``pnmix``) at ``rate`` average key bits.

    Mapping (head dim 64, the two models evaluated here; scale and zero are 16-bit per
    channel per group, ``32 / G`` bits):

    ======  ===========================  ==========================================  =====================
    rate    kivi (uniform, G varies)     kitty (G=128, 4-bit boost by magnitude)     pnmix (G=128, 3/1 bit)
    ======  ===========================  ==========================================  =====================
    3.0     2-bit, G=32                  24 of 64 channels 4-bit, rest 2-bit         r=0.875 (28 of 32)
    2.5     2-bit, G=64                  8 channels 4-bit, rest 2-bit                r=0.625 (20 pairs)
    2.25    2-bit, G=128 (``kivi-2``)    21 channels 4-bit, rest 1-bit (2.234)       r=0.5 (``pnmix-1``)
    2.0     1-bit, G=32                  16 channels 4-bit, rest 1-bit               r=0.375 (12 pairs)
    1.5     1-bit, G=64                  5 channels 4-bit, rest 1-bit (1.484)        r=0.125 (4 pairs)
    ======  ===========================  ==========================================  =====================

    Every 1-bit group uses the library's 1-bit quantizer, midpoint correction included
    (kivi's and kitty's too), so the sweep compares the mixing schemes, not the quantizer.
    """
    if method not in _SWEEP_FIELDS:
        raise ValueError(f"method={method!r} is invalid: allowed {SWEEP_METHODS}")
    if rate not in _SWEEP_FIELDS[method]:
        raise ValueError(f"rate={rate!r} is invalid: allowed {SWEEP_RATES}")
    return PRESETS[SWEEP_BASE[method]].replace(**_SWEEP_FIELDS[method][rate], name=f"sweep-{method}-{rate}")


def method_configs() -> dict[str, PNMixConfig]:
    """Every named method of the evaluation: presets, criteria variants, ablations, sweep points."""
    pnmix1 = PRESETS["pnmix-1"]
    methods = dict(PRESETS)
    for criterion in SELECTION_CRITERIA[1:]:
        name = f"pnmix-1-{criterion.replace('_', '-')}"
        methods[name] = pnmix1.replace(selection=criterion, name=name)
    methods["pnmix-1-no-sinks"] = pnmix1.replace(sink_tokens=0, name="pnmix-1-no-sinks")
    methods["pnmix-1-no-midpoint"] = pnmix1.replace(midpoint_correction=False, name="pnmix-1-no-midpoint")
    methods["pnmix-1-per-group"] = pnmix1.replace(reselection="per_group", name="pnmix-1-per-group")
    for method in SWEEP_METHODS:
        for rate in SWEEP_RATES:
            methods[f"sweep-{method}-{rate}"] = sweep_config(method, rate)
    return methods


METHODS = method_configs()
METHOD_SETS = {
    "presets": ["fp16", "kivi-2", "pnmix-1", "pnmix-2", "kitty"],
    "criteria": ["pnmix-1", "pnmix-1-k-pair-norm", "pnmix-1-k-magnitude", "pnmix-1-k-range"],
    "ablations": ["pnmix-1", "pnmix-1-no-sinks", "pnmix-1-no-midpoint", "pnmix-1-per-group"],
    "sweep": [f"sweep-{method}-{rate}" for method in SWEEP_METHODS for rate in SWEEP_RATES],
}
"""Named lists of methods (``--methods presets criteria``); a single method name also works."""

METRICS = ("attention_kl", "long_output")

PROMPTS = {
    "math-trains": (
        "Two trains leave stations 450 km apart at 8:15 and travel toward each other, one at 80 km/h and the "
        "other at 70 km/h. The faster train stops for 20 minutes at a station halfway through its trip. At what "
        "time do they meet, and how far from each station? Solve it step by step, then check the answer by a "
        "second method, and finally generalize the method to trains with any speeds and stops."
    ),
    "code-inventory": (
        "Write a complete Python module that manages a warehouse inventory: classes for items, locations and "
        "stock movements, functions to receive, move and ship goods, a report of stock value by location, input "
        "validation with clear errors, and unit tests with pytest for every function. Explain the design first."
    ),
    "math-savings": (
        "Maria saves 15% of her monthly salary of 3,200 dollars, and her salary grows by 4% every year. Her "
        "savings earn 3% interest per year, compounded monthly. How much has she saved after 5 years? Work it "
        "out month by month in a table for the first year, then year by year, and explain every formula."
    ),
    "code-parser": (
        "Implement in Python a tokenizer and a recursive-descent parser for arithmetic expressions with "
        "variables, functions calls, unary minus and operator precedence, an evaluator, and helpful error "
        "messages with positions. Then write tests and walk through the parse of '-(a + 2) * f(b, 3) ^ 2'."
    ),
}
"""Prompts of the long-output metric (chat template applied), in the order used."""


def resolve_methods(names: list[str]) -> list[str]:
    """Expand method-set names (:data:`METHOD_SETS`) into unique method names, order kept."""
    resolved = []
    for name in names:
        if name in METHOD_SETS:
            resolved.extend(METHOD_SETS[name])
        elif name in METHODS:
            resolved.append(name)
        else:
            raise ValueError(f"method {name!r} is unknown: allowed {sorted(METHOD_SETS)} or one of {sorted(METHODS)}")
    return list(dict.fromkeys(resolved))


# ----------------------------------------------------------------------------- attention KL
@torch.no_grad()
def capture_attention_inputs(model, input_ids: torch.Tensor) -> dict:
    """Post-RoPE queries, keys and values of every layer for ``input_ids [1, T]`` (one exact forward).

    Returns ``{"query": [...], "key": [...], "value": [...], "scaling": float, "pairing": str}``,
    lists over layers of float tensors ``[1, heads, T, D]``.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"capture_attention_inputs takes one sequence, got batch {input_ids.shape[0]}")
    captured = {"query": {}, "key": {}, "value": {}}
    scaling = {}
    patch_model(model, "fp16")
    try:
        cache = new_cache(model)
        pairing = cache.layers[0].pairing
        for index, layer in enumerate(cache.layers):

            def recording_attend(query, key, value, valid, layer_scaling, _index=index, _layer=layer):
                captured["query"][_index], captured["key"][_index], captured["value"][_index] = query, key, value
                scaling[_index] = layer_scaling
                return PNMixLayer.attend(_layer, query, key, value, valid, layer_scaling)

            layer.attend = recording_attend
        model(input_ids, cache=cache, use_cache=True)
    finally:
        unpatch_model(model)
    layers = range(len(captured["key"]))
    return {
        **{name: [captured[name][index] for index in layers] for name in captured},
        "scaling": scaling[0],
        "pairing": pairing,
    }


def _cached_keys_in_order(layer: PNMixLayer) -> torch.Tensor:
    """Float32 keys the layer holds for sequence 0, in token order: sinks, dequantized groups, residual."""
    quantized, _ = layer.quantized_keys_values()
    sinks = int(layer.sink_len[0])
    grouped = int(layer.num_groups[0]) * layer.config.key_group_size
    residual = int(layer.residual_len[0])
    return torch.cat(
        [layer.sink_keys[0, :, :sinks].float(), quantized[0, :, :grouped], layer.residual_keys[0, :, :residual].float()],
        dim=1,
    )


@torch.no_grad()
def attention_kl(captured: dict, config: PNMixConfig, context: int, progress: bool = True) -> dict:
    """Attention-distribution KL of decode queries over ``config``'s cache vs exact keys.

    Args:
        captured: :func:`capture_attention_inputs` of ``context + queries`` tokens.
        config: the method.
        context: tokens prefilled into the cache; every later token is one decode query.
    Returns:
        ``mean_kl`` (over layers, query heads and decode steps), ``per_layer_kl``,
        ``max_layer_kl``, ``queries``, ``context``, ``key_bits`` (measured from storage) and
        ``memory`` (the summed memory report).
    """
    total = captured["key"][0].shape[2]
    if not 0 < context < total:
        raise ValueError(f"context={context} is invalid: allowed 1 .. {total - 1} (the captured tokens minus one query)")
    scaling, per_layer, parts = captured["scaling"], [], None
    for query, key, value in tqdm(
        list(zip(captured["query"], captured["key"], captured["value"])),
        desc=f"attention KL {config.name}", unit="layer", disable=not progress, leave=False,
    ):
        layer = PNMixLayer(config, captured["pairing"])
        layer.attend(query[:, :, :context], key[:, :, :context], value[:, :, :context], None, scaling)
        kv_heads, ratio = key.shape[1], query.shape[1] // key.shape[1]
        step_kl = []
        for position in range(context, total):
            step = slice(position, position + 1)
            layer.attend(query[:, :, step], key[:, :, step], value[:, :, step], None, scaling)
            cached = _cached_keys_in_order(layer)  # [H, position + 1, D]
            if cached.shape[1] != position + 1:
                raise RuntimeError(f"the cache holds {cached.shape[1]} keys after {position + 1} tokens")
            grouped_query = query[0, :, position].float().view(kv_heads, ratio, -1)
            exact = torch.einsum("hgd,htd->hgt", grouped_query, key[0, :, : position + 1].float()) * scaling
            approx = torch.einsum("hgd,htd->hgt", grouped_query, cached) * scaling
            log_p, log_q = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
            step_kl.append((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        per_layer.append(torch.stack(step_kl).mean().item())
        layer_parts = layer.memory_bytes()
        parts = layer_parts if parts is None else {name: parts[name] + layer_parts[name] for name in parts}
    memory = summarize_memory(parts)
    return {
        "mean_kl": sum(per_layer) / len(per_layer),
        "per_layer_kl": per_layer,
        "max_layer_kl": max(per_layer),
        "queries": total - context,
        "context": context,
        "key_bits": memory["key_bits_per_element"] if config.quantize else 16.0,
        "memory": memory,
    }


# ----------------------------------------------------------------------------- long outputs
def chat_prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """``[1, P]`` ids of ``prompt`` as a user turn with the generation prompt (chat template)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def generate_reference(model, tokenizer, prompts: dict[str, str], tokens: int, progress: bool = True) -> dict:
    """Greedy full-precision continuations (unpatched model, exactly ``tokens`` new tokens each).

    Returns ``{name: {"ids": [...], "prompt_length": P, "text": decoded continuation,
    "distinct_4grams": fraction of the continuation's 4-grams that are distinct}}`` (a low
    fraction means the greedy text loops, which makes next tokens easy to agree on).
    """
    references = {}
    for name, prompt in tqdm(prompts.items(), desc="full-precision generation", unit="prompt", disable=not progress):
        ids = chat_prompt_ids(tokenizer, prompt)
        output = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        references[name] = {
            "ids": output[0].tolist(),
            "prompt_length": ids.shape[1],
            "text": tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True),
            "distinct_4grams": distinct_ngram_fraction(output[0, ids.shape[1] :].tolist(), 4),
        }
    return references


def distinct_ngram_fraction(ids: list[int], n: int) -> float:
    """Fraction of the ``n``-grams of ``ids`` that are distinct (1.0: no repetition)."""
    grams = [tuple(ids[start : start + n]) for start in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def long_output_fidelity(model, references: dict, config: PNMixConfig, progress: bool = True) -> dict:
    """Teacher-force every reference continuation through ``config``'s cache (prompt prefilled).

    Returns ``mean_kl`` and ``top1_agreement`` over all scored steps of all prompts (each step
    weighs the same), ``per_prompt`` results, ``steps`` and ``key_bits`` (of the longest prompt's cache).
    """
    per_prompt = {}
    for name, reference in references.items():
        ids = torch.tensor([reference["ids"]])
        result = teacher_force(model, ids, config, reference["prompt_length"], reference_logits(model, ids), progress)
        per_prompt[name] = {key: value for key, value in result.items() if key != "memory"}
        per_prompt[name]["key_bits"] = result["memory"]["key_bits_per_element"] if config.quantize else 16.0
    steps = sum(result["steps"] for result in per_prompt.values())
    return {
        "mean_kl": sum(r["mean_kl"] * r["steps"] for r in per_prompt.values()) / steps,
        "top1_agreement": sum(r["top1_agreement"] * r["steps"] for r in per_prompt.values()) / steps,
        "steps": steps,
        "key_bits": max(per_prompt.values(), key=lambda r: r["steps"])["key_bits"],
        "per_prompt": per_prompt,
    }


# ----------------------------------------------------------------------------- running and plots
QUICK = {"context": 288, "queries": 4, "long_tokens": 40, "prompts": 1, "methods": ["fp16", "kivi-2", "pnmix-1", "kitty"]}
"""``--quick``: small sizes that still flush quantized groups (CI)."""


def run_evaluation(
    model,
    tokenizer,
    model_name: str,
    metrics: list[str],
    methods: list[str],
    output: Path,
    context: int = 2048,
    queries: int = 64,
    long_tokens: int = 1024,
    prompts: int = 2,
    progress: bool = True,
) -> dict:
    """Run ``metrics`` for ``methods`` and write the JSON results to ``output`` after every method.

    An existing ``output`` is resumed: methods already measured with the same settings are skipped.
    """
    for metric in metrics:
        if metric not in METRICS:
            raise ValueError(f"metric {metric!r} is unknown: allowed {METRICS}")
    if not 1 <= prompts <= len(PROMPTS):
        raise ValueError(f"prompts={prompts} is invalid: allowed 1 .. {len(PROMPTS)}")
    methods = resolve_methods(methods)
    settings = {"model": model_name, "context": context, "queries": queries, "long_tokens": long_tokens, "prompts": prompts}
    results = json.loads(output.read_text()) if output.is_file() else {}
    if results.get("settings") != settings:
        results = {"settings": settings}
    results["environment"] = _environment()
    for reference in results.get("long_output_references", {}).values():  # files written before the field existed
        reference.setdefault("distinct_4grams", distinct_ngram_fraction(reference["ids"][reference["prompt_length"] :], 4))

    def save():
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2, default=str))

    pending = [m for m in methods if m not in results.get("attention_kl", {})]
    if "attention_kl" in metrics and pending:
        captured = capture_attention_inputs(model, _kl_text_ids(tokenizer, context + queries))
        done = results.setdefault("attention_kl", {})
        for name in tqdm(pending, desc="attention KL", unit="method", disable=not progress):
            started = time.perf_counter()
            done[name] = attention_kl(captured, METHODS[name], context, progress) | _method_record(name, started)
            save()
        del captured
    pending = [m for m in methods if m not in results.get("long_output", {})]
    if "long_output" in metrics and pending:
        references = results.get("long_output_references")
        if references is None:
            chosen = dict(list(PROMPTS.items())[:prompts])
            references = results["long_output_references"] = generate_reference(model, tokenizer, chosen, long_tokens, progress)
            save()
        done = results.setdefault("long_output", {})
        for name in tqdm(pending, desc="long-output fidelity", unit="method", disable=not progress):
            started = time.perf_counter()
            done[name] = long_output_fidelity(model, references, METHODS[name], progress) | _method_record(name, started)
            save()
    save()
    return results


def _kl_text_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of the Hamlet excerpt (``pnmix_patch/data``)."""
    from .models import hamlet_text

    ids = tokenizer(hamlet_text(), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"context + queries = {tokens} tokens exceeds the {ids.shape[1]}-token text: allowed at most that")
    return ids[:, :tokens]


def _method_record(name: str, started: float) -> dict:
    return {"config": METHODS[name].__dict__, "seconds": round(time.perf_counter() - started, 1)}


def _environment() -> dict:
    import platform
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": f"working tree on top of {commit.stdout.strip() or 'unknown'}",
        "hardware": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
    }


SWEEP_LABELS = {"kivi": "KIVI (uniform)", "kitty": "Kitty (4-bit channel boost, per block)", "pnmix": "PN-Mix (3/1-bit pairs)"}
CRITERIA_LABELS = {
    "pnmix-1": "query-key pair norm (PN-Mix)",
    "pnmix-1-k-pair-norm": "key pair norm",
    "pnmix-1-k-magnitude": "key channel magnitude",
    "pnmix-1-k-range": "key channel range",
}


def plot_results(results: dict, folder: Path, prefix: str) -> list[Path]:
    """PNG plots of what ``results`` holds; returns the files written.

    - ``<prefix>_pareto_kl.png``: key bits vs attention KL (and vs long-output KL when measured),
      one line per sweep method;
    - ``<prefix>_pareto_top1.png``: key bits vs long-output top-1 agreement, one line per method;
    - ``<prefix>_criteria.png``: attention KL of the four selection criteria at the same bits.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    model = results["settings"]["model"]
    written = []
    panels = [(metric, "mean_kl") for metric in ("attention_kl", "long_output") if _sweep_points(results, metric, "mean_kl")]
    if panels:
        figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        for axis, (metric, field) in zip(axes[0], panels):
            _plot_sweep(axis, results, metric, field)
            axis.set_yscale("log")
            axis.set_ylabel("attention KL vs full precision" if metric == "attention_kl" else "next-token KL vs full precision")
        figure.suptitle(f"{model}: key bits vs KL (lower is better)")
        written.append(_save(figure, folder / f"{prefix}_pareto_kl.png", plt))
    if _sweep_points(results, "long_output", "top1_agreement"):
        figure, axis = plt.subplots(figsize=(6, 4.2))
        _plot_sweep(axis, results, "long_output", "top1_agreement")
        axis.set_ylabel("top-1 agreement with full precision")
        axis.set_title(f"{model}\nkey bits vs top-1 agreement (higher is better)")
        written.append(_save(figure, folder / f"{prefix}_pareto_top1.png", plt))
    criteria = {name: results.get("attention_kl", {}).get(name) for name in CRITERIA_LABELS}
    if all(criteria.values()):
        figure, axis = plt.subplots(figsize=(8, 3.6))
        values = [criteria[name]["mean_kl"] for name in criteria]
        bars = axis.barh([CRITERIA_LABELS[name] for name in criteria], values, color=["C3", "C0", "C0", "C0"])
        axis.bar_label(bars, labels=[f"{value:.4f}" for value in values], padding=3)
        axis.set_xlim(0, 1.2 * max(values))
        axis.invert_yaxis()
        axis.set_xlabel("attention KL vs full precision (lower is better)")
        bits = criteria["pnmix-1"]["key_bits"]
        axis.set_title(f"{model}\nselection criteria at {bits:.2f} key bits, {results['settings']['context']}-token context")
        written.append(_save(figure, folder / f"{prefix}_criteria.png", plt))
    return written


PRESET_OF_LINE = {"kivi": "kivi-2", "kitty": "kitty", "pnmix": "pnmix-1"}
"""The preset measured on each sweep line (``kivi-2`` and ``pnmix-1`` are its 2.25-bit points)."""


def _sweep_points(results: dict, metric: str, field: str) -> dict:
    """``{method: sorted [(key bits, value)]}`` of the sweep points and presets measured for ``metric``."""
    measured = results.get(metric, {})
    points = {}
    for method in SWEEP_METHODS:
        names = [f"sweep-{method}-{rate}" for rate in SWEEP_RATES] + [PRESET_OF_LINE[method]]
        configs = {}  # one point per distinct config: a preset equal to a sweep point is not drawn twice
        for name in names:
            if name not in measured or field not in measured[name]:
                continue
            config = {key: value for key, value in measured[name].get("config", {"name": name}).items() if key != "name"}
            identity = json.dumps(config or name, sort_keys=True, default=str)
            configs.setdefault(identity, (measured[name]["key_bits"], measured[name][field]))
        if configs:
            points[method] = sorted(configs.values())
    return points


def _plot_sweep(axis, results: dict, metric: str, field: str) -> None:
    for method, line in _sweep_points(results, metric, field).items():
        axis.plot([bits for bits, _ in line], [value for _, value in line], marker="o", label=SWEEP_LABELS[method])
    axis.set_xlabel("key bits per element (measured from storage)")
    axis.set_title(metric.replace("_", " "))
    axis.grid(True, alpha=0.3)
    axis.legend(loc="best", fontsize=8)


def _save(figure, path: Path, plt) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def summary_table(results: dict) -> str:
    """A markdown table of every measured method: key bits, attention KL, long-output KL and top-1."""
    kl, long = results.get("attention_kl", {}), results.get("long_output", {})
    lines = [
        "| method | key bits (measured) | attention KL | long-output KL | long-output top-1 |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys([*kl, *long]):
        bits = (kl.get(name) or long.get(name))["key_bits"]
        cells = [
            f"{kl[name]['mean_kl']:.4g}" if name in kl else "-",
            f"{long[name]['mean_kl']:.4g}" if name in long else "-",
            f"{long[name]['top1_agreement']:.3f}" if name in long else "-",
        ]
        bits_text = "16" if bits == 16.0 else ("-" if math.isnan(bits) else f"{bits:.4f}")
        lines.append(f"| {name} | {bits_text} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
