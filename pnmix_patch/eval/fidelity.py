"""Teacher-forced fidelity: how far a quantized cache moves the next-token distribution.

The method's reference setting (``docs/fidelity.md``): a text is prefilled (exact
attention), then the following tokens are fed one at a time through the cache; the
logits of every decode step are compared with one full-precision forward pass over
the whole text (top-1 agreement, mean KL(full || quantized), perplexity).
"""

from __future__ import annotations

import contextlib
import math

import torch
from tqdm.auto import tqdm

from ..api import new_cache, patch_model, unpatch_model
from ..config import PNMixConfig
from .hf_quantized import HFQuantizedMethod, quantized_cache_memory


def progress_bar(iterable=None, *, progress: bool = True, **kwargs) -> tqdm:
    """A tqdm progress bar, hidden when ``progress`` is False. Only ``disable=True`` is ever passed: an
    explicit ``disable=False`` would override tqdm's environment settings, so ``TQDM_DISABLE=1`` could
    not silence the library's bars."""
    return tqdm(iterable, **kwargs, **({} if progress else {"disable": True}))


@torch.no_grad()
def reference_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits of one full-precision forward pass (the model must be unpatched)."""
    return model(input_ids, use_cache=False).logits.float()


@contextlib.contextmanager
def method_cache(model, method: PNMixConfig | str | HFQuantizedMethod):
    """An empty cache of ``method`` for ``model`` (unpatched), for the duration of the block.

    A PN-Mix config or preset patches the model for the block (unpatched after) and yields a
    :class:`~pnmix_patch.cache.PNMixCache`; an :class:`~pnmix_patch.eval.hf_quantized.HFQuantizedMethod`
    leaves the model as it is and yields transformers' ``QuantizedCache``.
    """
    if isinstance(method, HFQuantizedMethod):
        yield method.new_cache(model)
        return
    patch_model(model, method)
    try:
        yield new_cache(model)
    finally:
        unpatch_model(model)


def prefill_chunks(model, method, tokens: int, batch: int = 1) -> list[int]:
    """Token counts of the forwards that prefill ``tokens`` prompt tokens into ``method``'s cache:
    one, except where transformers' HQQ cache cannot pack the prompt in one piece
    (:meth:`~pnmix_patch.eval.hf_quantized.HFQuantizedMethod.prefill_chunks`)."""
    if not isinstance(method, HFQuantizedMethod):
        return [tokens]
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return method.prefill_chunks(tokens, batch, text.num_key_value_heads, head_dim)


def cache_memory(cache) -> dict:
    """The memory report of a cache made by :func:`method_cache` (bytes and bits read from its storage)."""
    return cache.memory_report() if hasattr(cache, "memory_report") else quantized_cache_memory(cache)


@torch.no_grad()
def teacher_force(
    model,
    input_ids: torch.Tensor,
    pnmix_config: PNMixConfig | str | HFQuantizedMethod,
    prefill: int,
    reference: torch.Tensor,
    progress: bool = True,
    per_step: bool = False,
) -> dict:
    """Prefill ``input_ids[:, :prefill]``, then feed the rest token by token through a PN-Mix cache.

    Args:
        model: an unpatched model (it is patched for the run and unpatched after).
        input_ids: ``[1, T]`` token ids.
        pnmix_config: PN-Mix config or preset, or one of transformers' quantized caches
            (:data:`~pnmix_patch.eval.hf_quantized.HF_METHODS`, run on the unpatched model).
        prefill: tokens processed in the first (exact-attention) forward.
        reference: :func:`reference_logits` of ``input_ids``.
        per_step: also return the per-step diagnostics (below).
    Returns:
        ``top1_agreement``, ``mean_kl``, ``perplexity`` (on tokens ``prefill+1 .. T-1``),
        ``reference_perplexity``, ``steps``, ``memory`` (the cache's memory report).
        With ``per_step``, lists over the ``T - prefill`` decode steps (step ``j`` feeds token
        ``prefill + j`` and predicts token ``prefill + j + 1``): ``step_kl`` (KL(full || cache)),
        ``step_argmax`` (the cache's top-1 id), ``reference_argmax`` (full precision's top-1 id),
        ``reference_top2`` (full precision's two most likely ``[[id, probability], ...]``) and
        ``step_top2`` (the same under the cache).
    """
    with method_cache(model, pnmix_config) as cache:
        start = 0
        for chunk in prefill_chunks(model, pnmix_config, prefill):
            model(input_ids[:, start : start + chunk], cache=cache, use_cache=True)
            start += chunk
        logits = []
        for position in progress_bar(
            range(prefill, input_ids.shape[1]), progress=progress, desc=str(getattr(pnmix_config, "name", pnmix_config)), leave=False
        ):
            step = model(input_ids[:, position : position + 1], cache=cache, use_cache=True)
            logits.append(step.logits[:, -1].float())
        memory = cache_memory(cache)
    quantized = torch.cat(logits, 0)
    full = reference[0, prefill:]
    log_q, log_p = torch.log_softmax(quantized, -1), torch.log_softmax(full, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    targets = input_ids[0, prefill + 1 :]
    nll = -log_q[:-1].gather(-1, targets[:, None]).mean()
    reference_nll = -log_p[:-1].gather(-1, targets[:, None]).mean()
    details = {}
    if per_step:

        def top2(log_probs):
            values, ids = log_probs.exp().topk(2, dim=-1)
            return [[[int(i), float(v)] for i, v in zip(row_ids, row_values)] for row_ids, row_values in zip(ids, values)]

        details = {
            "step_kl": kl.tolist(),
            "step_argmax": quantized.argmax(-1).tolist(),
            "reference_argmax": full.argmax(-1).tolist(),
            "reference_top2": top2(log_p),
            "step_top2": top2(log_q),
        }
    return details | {
        "top1_agreement": (quantized.argmax(-1) == full.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "perplexity": math.exp(nll.item()),
        "reference_perplexity": math.exp(reference_nll.item()),
        "steps": quantized.shape[0],
        "memory": memory,
    }
