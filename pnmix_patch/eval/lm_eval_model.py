"""lm-evaluation-harness model type ``pnmix``: generation tasks through the PN-Mix KV cache.

Two entries:

- the registered model type, for the ``lm_eval`` command line (this module must be
  imported first, which ``pnmix-lm-eval`` / ``python -m pnmix_patch.eval.lm_eval_model`` do)::

      pnmix-lm-eval --model pnmix --model_args pretrained=smollm2,preset=pnmix-1 \\
          --include_path pnmix_patch/eval/tasks --tasks gsm8k_local_8shot

  ``pretrained`` is ``smollm2`` (the embedded model), a ``.gguf`` file, a local model
  folder, or a hub id where a hub is reachable; it is loaded with
  :func:`pnmix_patch.eval.models.load_model` and patched with :func:`pnmix_patch.patch_model`.

- :func:`wrap_model`, for a model that the caller already built (and possibly patched)::

      lm = wrap_model(model, tokenizer, preset="pnmix-1")
      lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=...))

Data parallel: launched by ``torchrun --nproc_per_node N`` or ``accelerate launch
--num_processes N`` (``WORLD_SIZE`` > 1), every process holds a whole model, lm-eval
gives rank ``r`` the documents ``r, r+N, r+2N, ...`` and gathers the per-sample results
on rank 0. This works on CPU (gloo) as well as GPUs (NCCL): the stock ``hf`` model of
lm-eval only turns data parallelism on when it sees several GPUs. lm-eval pads the
ranks with fewer requests with copies of their last request (so that batched
collectives line up); :meth:`PNMixLM.generate_until` answers those copies from the
first answer instead of generating them again, so each request is generated exactly once.

Log-likelihood tasks (multiple choice, perplexity) run one forward pass over the
prompt and continuation: that is prefill, exact attention, and the quantized cache is
never read back. They give the same numbers as the unpatched model (up to rounding); use generation tasks.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..api import is_patched, patch_model, patch_state
from .models import DEFAULT_MODEL, load_model

MODEL_NAME = "pnmix"
TASKS_DIR = Path(__file__).parent / "tasks"
"""Task YAMLs shipped with the package (pass to ``--include_path``)."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accelerator(device: str | None):
    """An ``Accelerator`` (process group initialized: gloo on CPU, NCCL on GPUs) when launched on several processes."""
    if _world_size() <= 1:
        return None
    from accelerate import Accelerator, InitProcessGroupKwargs

    # accelerate only sets up a CPU process group (gloo) when asked for the CPU: without
    # ``cpu=True`` a torchrun launch on a machine without GPUs silently runs N copies of
    # the whole evaluation.
    cpu = not torch.cuda.is_available() or str(device or "").startswith("cpu")
    # Long generations can keep one rank busy for hours while another waits at a collective.
    accelerator = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    if accelerator.num_processes != _world_size():
        raise RuntimeError(
            f"WORLD_SIZE={_world_size()} but accelerate set up {accelerator.num_processes} process(es) "
            f"({accelerator.distributed_type}): the requests would not be split"
        )
    return accelerator


def _resolve_device(device: str | None, accelerator) -> torch.device:
    if accelerator is not None:
        return accelerator.device
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available: pass device=cpu")
    return torch.device(device)


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.float16 if device.type == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: allowed auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class PNMixLM(HFLM):
    """lm-eval's Hugging Face causal LM, running on a PN-Mix patched model.

    Args:
        pretrained: ``"smollm2"``, a ``.gguf`` file, a local folder, a hub id, or a built
            ``PreTrainedModel`` (then ``tokenizer`` is required).
        preset: the name of a preset (``pnmix_patch.PRESETS``: ``pnmix-1``, ``kitty``, ``fp16``, ...) or a
            ``PNMixConfig``. ``None`` keeps an already patched model's config (and patches
            an unpatched one with ``pnmix-1``).
        tokenizer: a tokenizer object or name; by default the model's own.
        device: ``cpu``, ``cuda``, ``cuda:N``; ignored under a multi-process launch
            (each process takes its own device). Default: CUDA when available.
        dtype: ``auto`` (float16 on CUDA, float32 on CPU), ``float32``, ``float16``, ``bfloat16``.
        request_log_dir: if set, each rank appends one JSON line per generation request it
            generates (task, doc_id, idx) to ``rank<r>.jsonl`` there.
        **kwargs: passed to lm-eval's ``HFLM`` (``batch_size``, ``max_length``,
            ``add_bos_token``, ``think_end_token``, ...).
    """

    def __init__(
        self,
        pretrained="smollm2",
        preset=None,
        tokenizer=None,
        device: str | None = None,
        dtype="auto",
        request_log_dir: str | None = None,
        **kwargs,
    ) -> None:
        accelerator = _accelerator(device)
        gguf_file = kwargs.pop("gguf_file", None)
        if gguf_file and isinstance(pretrained, str):  # lm-eval's hf style: pretrained=FOLDER,gguf_file=NAME
            pretrained = os.path.join(pretrained, gguf_file)
        if isinstance(pretrained, str):
            target = _resolve_device(device, accelerator)
            model, own_tokenizer = load_model(pretrained or DEFAULT_MODEL, dtype=_resolve_dtype(dtype, target), device=str(target))
            name = pretrained
        else:
            model, own_tokenizer, name = pretrained, None, type(pretrained).__name__
            if accelerator is not None and model.device != accelerator.device:
                model = model.to(accelerator.device)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        tokenizer = tokenizer or own_tokenizer
        if tokenizer is None:
            raise ValueError("a built model needs its tokenizer: PNMixLM(model, tokenizer=tokenizer)")
        if preset is not None or not is_patched(model):
            patch_model(model, preset or "pnmix-1")
        for dropped in ("parallelize", "tp_plan", "peft", "delta", "autogptq", "gptqmodel"):
            if kwargs.pop(dropped, None):
                raise ValueError(f"{dropped} is not supported by the {MODEL_NAME} model type")
        # HFLM warns that a built model means a single process: this class sets up the
        # processes itself (below), so the warning would be wrong.
        hf_logger = logging.getLogger(HFLM.__module__)
        level = hf_logger.level
        hf_logger.setLevel(logging.ERROR)
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        finally:
            hf_logger.setLevel(level)
        self.pretrained = name
        self.pnmix_config = patch_state(model).pnmix_config
        if accelerator is not None:
            self.accelerator = accelerator
            self._device = accelerator.device
            self._rank = accelerator.process_index
            self._world_size = accelerator.num_processes
        self.request_log_dir = request_log_dir

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate each request once; lm-eval's padding copies get the first copy's answer."""
        # lm-eval lists every request ``repeats`` times (sampling several answers), then,
        # on ranks with fewer requests, the last one again as padding. Keep the first
        # ``repeats`` occurrences of each request object and answer the rest from them.
        seen: dict[int, int] = {}
        unique, source = [], []
        for request in requests:
            count = seen.get(id(request), 0)
            seen[id(request)] = count + 1
            if count < max(getattr(request, "repeats", 1), 1):
                source.append(len(unique))
                unique.append(request)
            else:
                source.append(next(i for i, r in enumerate(unique) if r is request))
        self._log_requests(unique)
        answers = super().generate_until(unique, disable_tqdm=disable_tqdm)
        return [answers[i] for i in source]

    def _log_requests(self, requests) -> None:
        if not self.request_log_dir:
            return
        folder = Path(self.request_log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}.jsonl", "a", encoding="utf-8") as file:
            for request in requests:
                entry = {"task": request.task_name, "doc_id": request.doc_id, "idx": request.idx, "world_size": self.world_size}
                file.write(json.dumps(entry) + "\n")


if __name__ != "__main__":  # ``python -m`` registers the package's module, once (below)
    register_model(MODEL_NAME)(PNMixLM)


def wrap_model(model, tokenizer, preset=None, **kwargs) -> PNMixLM:
    """An lm-eval model (``lm_eval.simple_evaluate(model=...)``) for a model the caller built.

    ``model`` is patched with ``preset`` if given, or with ``pnmix-1`` if it is not
    patched yet; an already patched model keeps its config when ``preset`` is ``None``.
    Under ``torchrun`` / ``accelerate launch`` each process wraps its own copy (put it on
    ``cuda:LOCAL_RANK`` for GPUs) and the requests are split between processes.
    """
    return PNMixLM(pretrained=model, tokenizer=tokenizer, preset=preset, **kwargs)


def cli_evaluate() -> None:
    """``lm_eval``'s command line with the ``pnmix`` model type registered."""
    from lm_eval.__main__ import cli_evaluate as lm_eval_cli

    lm_eval_cli()


if __name__ == "__main__":
    from pnmix_patch.eval.lm_eval_model import cli_evaluate as _registered_cli

    _registered_cli()
