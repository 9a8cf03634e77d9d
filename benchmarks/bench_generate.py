"""``model.generate`` against the graphed decode step it replays: per-token time on a CUDA GPU.

    python benchmarks/bench_generate.py [--model qwen3-8b] [--model llama-3.1-8b] [--batches 1 32]
        [--contexts 1024 32768] [--tokens 64] [--skip-reduce-overhead] [--real-model smollm2] [--out DIR]

For each model shape (random bf16 weights, PN-Mix ``pnmix-1`` with ``patch_gemv``), batch and context, one
static PN-Mix cache is prefilled (64 tokens) and filled to the context (``common.fill_pnmix``), then timed
three ways on it, each from the same filled state:

- ``graphed-loop``: a hand-written greedy loop over :class:`~pnmix_patch.GraphedDecodeStep` (argmax fed
  back, synchronized every token): the latency ``generate`` should reach;
- ``generate``: ``model.generate(input_ids, cache=<the filled cache>, max_new_tokens=n, do_sample=False)``,
  whose compiled call (``mode="reduce-overhead"``, the default) replays one captured graph per batch shape
  (:class:`~pnmix_patch.graphed_decode.GraphedGenerateCall`);
- ``generate-reduce-overhead``: the same with the graph off, so ``torch.compile``'s own CUDA graphs run
  (not with ``--skip-reduce-overhead``).

``generate``'s per-token time is the slope between ``--tokens`` and 4 new tokens (wall clock, median of 3
pairs of calls), so the one-token prefill of the pre-filled cache and the call's set-up cancel. Its
end-of-text token is an id outside the vocabulary: the stop check runs on every token, as in a user's call,
and never ends a generation of random weights early (``min_new_tokens`` would add a logits processor).

``--real-model`` (``smollm2``, the embedded SmolLM2-135M-Instruct, or a GGUF file): greedy tokens of ``generate`` through the graphed
compiled call against eager decoding on the same static cache (``disable_compile=True``) and on the dynamic
cache, 200 new tokens after a chat prompt: equal, or the first position where they part.

Writes ``bench_generate[_{tag}].json`` under ``--out`` (default ``benchmarks/results``) after every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, CompileConfig

import pnmix_patch.api
import pnmix_patch.graphed_decode
from pnmix_patch import GraphedDecodeStep, new_cache, patch_gemv, patch_model
from pnmix_patch.planner import model_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPT, cache_arg, fill_pnmix, prefill, report_writer  # noqa: E402

MODELS = ("qwen3-8b", "llama-3.1-8b")
SHORT = 4  # new tokens of the short generate call (the slope's other end)
REPEATS = 3


def synchronized_seconds(function) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def refill(model, cache, name, batch, context) -> None:
    """The cache emptied in place (same storage: captured graphs stay valid), prefilled and filled to ``context``."""
    cache.reset()
    prefill(model, cache, name, batch)
    fill_pnmix(cache, context)


def graphed_loop_ms(model, cache, name, batch, context, tokens) -> float:
    step = GraphedDecodeStep(model, cache)
    times = []
    for repeat in range(REPEATS):
        refill(model, cache, name, batch, context)
        token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)

        def loop():
            nonlocal token
            for _ in range(tokens):
                token = step(token)[:, -1:].argmax(-1)
                torch.cuda.synchronize()

        seconds = synchronized_seconds(loop)
        if repeat or step.captured:  # the first loop compiles and captures
            times.append(seconds * 1e3 / tokens)
    return statistics.median(times)


def generate_ms(model, cache, name, batch, context, tokens, graphed: bool) -> float:
    ids = torch.randint(0, 1000, (batch, context + 1), device=model.device)  # the cache holds all but the last
    never = model.config.vocab_size  # an end-of-text id no step can produce
    settings = dict(do_sample=False, eos_token_id=never, pad_token_id=0, compile_config=CompileConfig(), **{name: cache})

    def run(new_tokens):
        refill(model, cache, name, batch, context)
        return synchronized_seconds(lambda: model.generate(ids, max_new_tokens=new_tokens, **settings))

    with mock.patch.object(pnmix_patch.graphed_decode, "_captures_on", lambda device: graphed and device.type == "cuda"):
        run(tokens)  # compiles (and captures)
        slopes = [(run(tokens) - run(SHORT)) * 1e3 / (tokens - SHORT) for _ in range(REPEATS)]
    return statistics.median(slopes)


def time_shape(model_name, batches, contexts, tokens, write, rows, reduce_overhead=True) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(model_config(model_name), dtype=torch.bfloat16).eval()
    patch_gemv(model)
    patch_model(model, "pnmix-1")
    model.generation_config.pad_token_id = 0
    name = cache_arg(model)
    for batch in batches:
        cache = new_cache(model, max(contexts) + PROMPT + 4 * tokens, static=True)
        for context in contexts:
            row = {"model": model_name, "batch": batch, "context": context, "tokens": tokens}
            row["graphed_loop_ms_per_token"] = graphed_loop_ms(model, cache, name, batch, context, tokens)
            row["generate_ms_per_token"] = generate_ms(model, cache, name, batch, context, tokens, graphed=True)
            row["generate_over_graphed_loop"] = row["generate_ms_per_token"] / row["graphed_loop_ms_per_token"]
            line = (
                f"{model_name} batch {batch} T={context}: graphed loop {row['graphed_loop_ms_per_token']:.3f} ms, "
                f"generate {row['generate_ms_per_token']:.3f} ms ({row['generate_over_graphed_loop']:.3f}x)"
            )
            if reduce_overhead:
                ms = row["generate_reduce_overhead_ms_per_token"] = generate_ms(model, cache, name, batch, context, tokens, graphed=False)
                row["reduce_overhead_over_graphed_loop"] = ms / row["graphed_loop_ms_per_token"]
                line += f", generate reduce-overhead {ms:.3f} ms ({row['reduce_overhead_over_graphed_loop']:.3f}x)"
            print(line, flush=True)
            rows.append(row)
            write({"rows": rows})
        del cache
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


def real_model_tokens(name_or_path: str, new_tokens: int = 200, device: str = "cuda") -> dict:
    """Greedy tokens of the graphed compiled generate against eager decoding, on a real model
    (``pnmix_patch.eval.models.load_model``'s names: ``smollm2``, a ``.gguf`` file, a folder), bf16."""
    from pnmix_patch.eval.models import load_model

    model, tokenizer = load_model(name_or_path, dtype=torch.bfloat16, device=device)
    patch_model(model, "pnmix-1")
    messages = [{"role": "user", "content": "Explain step by step how a hash map handles collisions, with an example in Python."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].to(device)
    settings = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    runs = {
        "graphed": model.generate(ids, cache_implementation="static", compile_config=CompileConfig(), **settings),
        "eager_static": model.generate(ids, cache_implementation="static", disable_compile=True, **settings),
        "eager_dynamic": model.generate(ids, **settings),
    }
    tokens = {name: run.sequences[0, ids.shape[1] :] for name, run in runs.items()}
    state = pnmix_patch.api.patch_state(model)
    captured = state.generate_call is not None and state.generate_call.step is not None and state.generate_call.step.captured

    def first_difference(other: str) -> dict | None:
        """Where ``other``'s greedy tokens first leave the graphed run's, and at that step each run's
        logit margin between the two tokens (what it picked minus what the other picked): a margin
        within float noise in both runs is a near tie, not a wrong step."""
        different = (tokens["graphed"] != tokens[other]).nonzero()
        if different.numel() == 0:
            return None
        step = int(different[0, 0])
        picks = int(tokens["graphed"][step]), int(tokens[other][step])
        margins = {}
        for name, (mine, theirs) in (("graphed", picks), (other, picks[::-1])):
            logits = runs[name].logits[step][0].float()
            margins[name] = float(logits[mine] - logits[theirs])
        return {"new_token": step, "tokens": picks, "margins": margins}

    result = {
        "prompt_tokens": ids.shape[1],
        "new_tokens": new_tokens,
        "graph_captured": captured,
        "first_difference_graphed_vs_eager_static": first_difference("eager_static"),
        "first_difference_graphed_vs_eager_dynamic": first_difference("eager_dynamic"),
        "graphed_text_head": tokenizer.decode(tokens["graphed"][:60]),
    }
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--tokens", type=int, default=64, help=f"new tokens of the long generate call (> {SHORT})")
    parser.add_argument("--skip-reduce-overhead", action="store_true", help="time generate through its graphed call only")
    parser.add_argument(
        "--real-model", help="'smollm2' (the embedded model) or a GGUF file: greedy tokens of the graphed generate against eager ones"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.tokens <= SHORT:
        parser.error(f"--tokens {args.tokens}: allowed more than {SHORT}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    write = report_writer(args.out, "bench_generate" + (f"_{args.tag}" if args.tag else "") + ".json", __file__)
    report, rows = {}, []
    if args.real_model:
        report["real_model"] = real_model_tokens(args.real_model)
        write(**report)
    for model_name in args.model or []:
        torch._dynamo.reset()
        time_shape(
            model_name, args.batches, args.contexts, args.tokens, lambda part: write(**report, **part), rows, not args.skip_reduce_overhead
        )
    write(complete=True, **report, rows=rows)


if __name__ == "__main__":
    main()
