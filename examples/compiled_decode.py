"""Low-latency single-stream decoding: a static PN-Mix cache and a compiled decode step.

The gpt-fast pattern on a transformers model: prefill eagerly (pair selection and the
first packing run there), then decode one token at a time through
``torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")`` — on CUDA the
whole step, cache update and flush included, replays as one CUDA graph.

    python examples/compiled_decode.py                       # embedded SmolLM2, CPU or CUDA
    python examples/compiled_decode.py --model path/to/model --tokens 1024 --dtype bfloat16
    python examples/compiled_decode.py --graphed
    python examples/compiled_decode.py --graphed --gemv
    python examples/compiled_decode.py --graphed --gemv --no-pdl

``--graphed`` replays the step through :class:`pnmix_patch.GraphedDecodeStep` instead: the
same compiled step captured once as a CUDA graph, without ``torch.compile``'s per-call guards
and input checks (on CUDA; lower host time per token at batch 1). ``--gemv`` also sends the
linear layers' one-token products through ``pnmix::gemv`` (:func:`pnmix_patch.patch_gemv`), which reads
the weights faster than cuBLAS at batch 1 on an H200. On GPUs of compute capability 9.0 and up the
graphed step's kernels, the library's and Inductor's, launch with programmatic dependent launch: each
may start while the one before it finishes (``docs/performance.md`` has its measured effect).
``--no-pdl`` turns it off. Through ``reduce-overhead`` it is the user's to turn on: ``PNMIX_PDL=1`` and
``TORCHINDUCTOR_ENABLE_PDL=1`` in the environment.

The same through ``generate`` (its compiled path):
``model.generate(..., cache_implementation="static")`` on CUDA, plus
``compile_config=CompileConfig(fullgraph=True)`` to choose the compile options.
"""

import argparse
import time
from types import SimpleNamespace

import torch

from pnmix_patch import GraphedDecodeStep, cache_argument, new_cache, patch_gemv, patch_model
from pnmix_patch.eval.models import load_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file, a model folder or a hub id")
parser.add_argument("--preset", default="pnmix-1")
parser.add_argument("--tokens", type=int, default=512, help="tokens to generate")
parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bf16 on CUDA, fp32 on CPU")
parser.add_argument("--graphed", action="store_true", help="replay the step with GraphedDecodeStep")
parser.add_argument("--gemv", action="store_true", help="one-token linear products through pnmix::gemv (patch_gemv)")
parser.add_argument("--no-pdl", action="store_true", help="with --graphed: no programmatic dependent launch")
args = parser.parse_args()
if args.no_pdl and not args.graphed:
    parser.error("--no-pdl: allowed only with --graphed")
if args.tokens < 5:
    parser.error(f"--tokens {args.tokens}: allowed 5 or more (the first 4 are generated before the timed loop)")

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
model, tokenizer = load_model(args.model, dtype=dtype, device=device)
patch_model(model, args.preset)
if args.gemv:
    patch_gemv(model)
cache_name = cache_argument(model)

messages = [{"role": "user", "content": "Prove that the square root of 2 is irrational, step by step."}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
prompt = prompt["input_ids"].to(device)
cache = new_cache(model, max_cache_len=prompt.shape[1] + args.tokens, static=True)
# Compile the decode step only: a prefill chunk has another shape and host-side work.
if args.graphed:
    graphed = GraphedDecodeStep(model, cache, pdl=False if args.no_pdl else None)

    def decode_step(input_ids, **_):
        return SimpleNamespace(logits=graphed(input_ids))
else:
    decode_step = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead" if device == "cuda" else "default")


def synchronize():
    if device == "cuda":
        torch.cuda.synchronize()


with torch.no_grad():
    token = model(input_ids=prompt, **{cache_name: cache}).logits[:, -1:].argmax(-1)
    tokens = [token]
    for _ in range(3):  # compile and record the graph outside the timed loop
        token = decode_step(input_ids=token, **{cache_name: cache}).logits[:, -1:].argmax(-1)
        tokens.append(token)
    synchronize()
    started = time.perf_counter()
    for _ in range(args.tokens - len(tokens)):
        # clone: the next replay reuses the graph's output memory
        token = decode_step(input_ids=token, **{cache_name: cache}).logits[:, -1:].argmax(-1).clone()
        tokens.append(token)
    synchronize()
    elapsed = time.perf_counter() - started

print(tokenizer.decode(torch.cat(tokens, 1)[0], skip_special_tokens=True))
timed = args.tokens - 4
print(
    f"\n{timed} tokens in {elapsed:.2f} s: {timed / elapsed:.1f} tokens/s ({1e3 * elapsed / timed:.2f} ms/token), "
    f"{args.preset} cache of {cache.memory_report()['total_bytes'] / 2**20:.1f} MiB preallocated for {cache.layers[0].max_cache_len} positions"
)
