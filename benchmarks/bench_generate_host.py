"""Host time of one ``generate`` decode step around the replayed graph, on any machine (a CPU is enough).

    python benchmarks/bench_generate_host.py [--layers 36] [--tokens 500] [--repeats 5]

When ``generate`` replays a captured decode step (:class:`~pnmix_patch.graphed_decode.GraphedGenerateCall`),
the GPU runs the step in a few milliseconds and waits, between steps, for the host: transformers' input
preparation, logits processing and stop check, and the call into the graph. That host time is what puts
``generate`` above a hand-written loop over :class:`~pnmix_patch.GraphedDecodeStep`, and it does not need a
GPU to be measured: here the step itself is replaced by a function that returns fixed logits, on a small
patched Llama with ``--layers`` layers (the per-layer cache bookkeeping scales with them; 36 is Qwen3-8B's
count), so what is timed is everything ``generate`` does per token except the model: the interval between
two consecutive calls of the step.

Two rows, taking turns in one process: the patched model as it is (no 4-D attention mask is built for the
decode steps of a static PN-Mix cache, see ``PNMixGenerator.create_masks_for_generate``), and the same with
transformers' mask built on every step. Per-step time: the median interval of ``--repeats`` generations of
``--tokens`` tokens. The end-of-text id lies outside the vocabulary: the stop check runs, never fires.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from unittest import mock

import torch
import transformers
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_masks_for_generate

import pnmix_patch.graphed_decode
from pnmix_patch import GraphedDecodeStep, patch_model
from pnmix_patch.api import PNMixGenerator

CALLS: list[float] = []  # perf_counter() at each stubbed step


def stubbed_step(self, input_ids, position_ids=None):
    """The first call of a step that costs nothing: the state a captured step has, then a replay."""
    if self._input_ids is None:
        self._input_ids, self._storage = input_ids.clone(), pnmix_patch.graphed_decode._storage_of(self.cache)
        self._position_ids = None if position_ids is None else position_ids.clone()
        self._logits = torch.zeros(input_ids.shape[0], 1, self.model.config.vocab_size)
        self._graph = True  # counts as captured
    return self._replay(input_ids, position_ids)


def stubbed_replay(self, input_ids, position_ids=None):
    """A replay that costs nothing: copies the inputs, returns fixed logits; records when it was called."""
    CALLS.append(time.perf_counter())
    self._input_ids.copy_(input_ids)
    if position_ids is not None:
        self._position_ids.copy_(position_ids)
    return self._logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2
    )
    model = patch_model(LlamaForCausalLM(config).eval(), "pnmix-1")
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # generate compiles on a CPU only when asked
    prompt = torch.randint(0, 256, (1, 200))
    settings = dict(
        do_sample=False, eos_token_id=config.vocab_size, pad_token_id=0, cache_implementation="static", compile_config=compile_config
    )

    def step_intervals_us(new_tokens):
        CALLS.clear()
        model.generate(prompt, max_new_tokens=new_tokens, **settings)
        return [(b - a) * 1e6 for a, b in zip(CALLS, CALLS[1:])]

    with_mask = mock.patch.object(PNMixGenerator, "create_masks_for_generate", lambda self, *a, **k: create_masks_for_generate(*a, **k))
    rows = {"patched": [], "4-D mask every step": []}
    with (
        mock.patch.object(pnmix_patch.graphed_decode, "_captures_on", lambda device: True),
        mock.patch.object(GraphedDecodeStep, "__call__", stubbed_step),
        mock.patch.object(GraphedDecodeStep, "_replay", stubbed_replay),
    ):
        step_intervals_us(8)  # first call: builds the step
        for _ in range(args.repeats):
            rows["patched"] += step_intervals_us(args.tokens)
            with with_mask:
                rows["4-D mask every step"] += step_intervals_us(args.tokens)
    result = {
        "command": "python benchmarks/bench_generate_host.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "us_per_step": {name: statistics.median(values) for name, values in rows.items()},
        "steps_timed": {name: len(values) for name, values in rows.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
