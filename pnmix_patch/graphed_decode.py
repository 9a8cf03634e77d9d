"""A decode step captured once as a CUDA graph and replayed with no per-call Python work.

``torch.compile(model.forward, mode="reduce-overhead")`` replays a CUDA graph too, but every
call first runs Dynamo's guards, gathers the graph's inputs (every weight and every cache
tensor: for a 32-layer 8B model about 290 weights, and 18 PN-Mix or 64 bf16 cache tensors) and
lets the CUDA-graph tree check their addresses and bump the version counters of the mutated
ones. At batch 1 that host work (0.66-1.11 ms per synchronized call on an H100 host, Llama-3.1-8B
and Qwen3-8B shapes, bf16 and the PN-Mix cache, against 64-76 us replayed by this class;
``docs/performance.md``) is a large part of a 6-8 ms step, and a loop that reads each token before
feeding it back waits for it on every step.

:class:`GraphedDecodeStep` is the gpt-fast pattern without that layer: the step is compiled
(``fullgraph=True``, no CUDA graphs of its own), run for real a few times, then captured once
with ``torch.cuda.graph`` around a static input buffer. A call copies the token ids into that
buffer and replays the graph: no guards, no input gathering. It needs a cache whose decode step
is free of host synchronization and keeps its storage in place (:class:`~pnmix_patch.PNMixStaticCache`,
or transformers' ``StaticCache``): everything the step changes (tokens written, residual buffers
flushed, lengths) is then device work inside the graph. On CPU no graph is captured and a call
runs the compiled step.

On GPUs of compute capability 9.0 and up (with a Triton that has it) the step's kernels launch
with programmatic dependent launch (PDL) by default: each kernel's programs may start while the
one before it finishes, and wait on the GPU for its writes. Both the library's kernels (:mod:`pnmix_patch.kernels.common`) and
the kernels Inductor compiles for the step (``triton.enable_pdl``) launch so. On an H200 (batch 1,
``patch_gemv``) a step takes 0.968-0.971x its time without PDL at 32K and 0.990-0.993x at 1K,
Qwen3-8B and Llama-3.1-8B shapes; 0.989x at batch 32 (Qwen3-8B, 8K; ``docs/performance.md``).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch._inductor.config
from transformers.modeling_outputs import CausalLMOutputWithPast

from .kernels import common
from .static_cache import PNMixStaticCache

# The output field naming the cache (``cache`` from transformers 5.24, ``past_key_values`` before).
_OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class GraphedDecodeStep:
    """One decode step of ``model`` on ``cache``, compiled and replayed as a CUDA graph.

    Args:
        model: a causal LM (patched with :func:`~pnmix_patch.patch_model` or not).
        cache: a prefilled cache that compiles without host synchronization and keeps its
            addresses: :class:`~pnmix_patch.PNMixStaticCache` or transformers' ``StaticCache``.
        warmup_steps: real decode steps run through the compiled step before the graph is
            captured (at least 1: the first one compiles).
        pdl: launch the step's kernels, the library's and Inductor's (where its torch has the switch
            ``triton.enable_pdl``), with programmatic dependent launch. None (the default): where the
            token ids' GPU has it (compute capability 9.0 and up, and a Triton that can, see
            :func:`~pnmix_patch.kernels.common.has_pdl`); True there only. Decided at the first call,
            then kept in :attr:`pdl`.

    Call it with the next token ids, ``[batch, 1]`` int64, on the model's device, and optionally their
    positions (``position_ids``, ``[batch, 1]`` int64, as ``generate`` passes them: left-padded rows count
    their own positions); it returns the logits ``[batch, 1, vocab]``. Without positions the model takes
    the cache's length as every row's position. Pass positions on every call or on none. On CUDA the
    logits live in the graph's memory and are overwritten by the next call: read or clone them before
    calling again. Every call, warm-up ones included, is
    a real decode step that advances the cache. The graph stays valid after ``cache.reset()`` and
    a new prefill of the same batch size (the static caches keep their storage); once the cache
    has allocated its storage again (a prefill of another batch size in between), a call raises
    instead of replaying into memory the cache no longer holds. As with any
    compiled step of the static PN-Mix cache, a sequence that outgrows ``max_cache_len`` cannot
    raise: its outputs become NaN.

    Raises:
        ValueError: ``warmup_steps`` not an int >= 1; ``pdl`` not None or a bool; token ids (or positions) that are
            not ``[batch, 1]``, of another shape than the first call's, or on another device; positions given
            on some calls only; with
            ``pdl=True``, first token ids on a device without programmatic dependent launch.
        TypeError: token ids or positions that are not an int64 tensor.
        RuntimeError: the cache's storage was allocated again since the first call.
    """

    def __init__(self, model: torch.nn.Module, cache, warmup_steps: int = 2, pdl: bool | None = None):
        if type(warmup_steps) is not int or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r}: allowed an int >= 1 (the first step compiles)")
        if pdl is not None and type(pdl) is not bool:
            raise ValueError(f"pdl={pdl!r}: allowed None (where the GPU has it), True or False")
        self.model = model
        self.cache = cache
        self._pdl_asked = pdl
        self.pdl: bool | None = None
        """Whether the step's kernels launch with programmatic dependent launch (None until the first call)."""
        # ``cache`` from transformers 5.24, ``past_key_values`` before.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._forward = None  # compiled at the first call, once the PDL setting is known
        self._warmup_left = warmup_steps
        self._input_ids: torch.Tensor | None = None  # the first call's shape and device; on CUDA the graph's input
        self._position_ids: torch.Tensor | None = None  # likewise, when the first call gave positions
        self._storage: list | None = None  # the cache's storage at the first call (see _storage_of)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        """Whether the graph has been captured (calls now replay it)."""
        return self._graph is not None

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for name, tensor in (("input_ids", input_ids), ("position_ids", position_ids)):
            if tensor is None and name == "position_ids":
                continue
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64:
                raise TypeError(f"{name} must be an int64 tensor [batch, 1]; got {getattr(tensor, 'dtype', type(tensor))}")
            if tensor.dim() != 2 or tensor.shape[1] != 1:
                raise ValueError(f"{name} must be [batch, 1] (one decode token per sequence); got {list(tensor.shape)}")
        if position_ids is not None and (position_ids.shape != input_ids.shape or position_ids.device != input_ids.device):
            raise ValueError(
                f"position_ids of shape {list(position_ids.shape)} on {position_ids.device}: allowed the token ids' "
                f"{list(input_ids.shape)} on {input_ids.device}"
            )
        if self._input_ids is None:
            self._compile(input_ids.device)
            self._input_ids = input_ids.clone()  # contiguous: warm-ups and capture see the same input
            self._position_ids = None if position_ids is None else position_ids.clone()
            self._storage = _storage_of(self.cache)
        elif any(now is not then for now, then in zip(_storage_of(self.cache), self._storage)):
            raise RuntimeError(
                "the cache allocated its storage again since this step was built (a prefill of another batch "
                "size after cache.reset()): build a new GraphedDecodeStep"
            )
        elif input_ids.shape != self._input_ids.shape or input_ids.device != self._input_ids.device:
            raise ValueError(
                f"input_ids of shape {list(input_ids.shape)} on {input_ids.device}: this step was built for "
                f"{list(self._input_ids.shape)} on {self._input_ids.device}"
            )
        elif (position_ids is None) != (self._position_ids is None):
            raise ValueError(
                f"position_ids {'missing' if position_ids is None else 'given'}: this step was built "
                f"{'without' if self._position_ids is None else 'with'} them (pass them on every call or on none)"
            )
        if input_ids.device.type != "cuda":
            return self._step(input_ids, position_ids)
        if self._graph is not None:
            return self._replay(input_ids, position_ids)
        self._input_ids.copy_(input_ids)
        if position_ids is not None:
            self._position_ids.copy_(position_ids)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=input_ids.device)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._on_capture_stream(self._step)
        return self._on_capture_stream(self._capture)

    def _replay(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The captured step on inputs already checked against the first call's."""
        self._input_ids.copy_(input_ids)
        if position_ids is not None:
            self._position_ids.copy_(position_ids)
        self._graph.replay()
        return self._logits

    def _compile(self, device: torch.device) -> None:
        has_pdl = device.type == "cuda" and common.has_pdl(device.index)
        if self._pdl_asked and not has_pdl:
            raise ValueError(
                f"pdl=True: the token ids are on {device}; programmatic dependent launch needs a CUDA GPU "
                "of compute capability 9.0 or newer and a Triton that has it (pdl=None uses it where it can)"
            )
        self.pdl = has_pdl if self._pdl_asked is None else self._pdl_asked
        # No CUDA graphs of torch.compile's own: this class captures the whole step once. Inductor's
        # kernels launch with PDL or not as the library's do (its switch is read when it compiles).
        options = {"triton.enable_pdl": self.pdl} if hasattr(torch._inductor.config.triton, "enable_pdl") else {}
        self._forward = torch.compile(self.model.forward, fullgraph=True, options=options)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = {} if position_ids is None else {"position_ids": position_ids}
        with torch.no_grad():
            return self._forward(input_ids=input_ids, use_cache=True, **positions, **{self._cache_argument: self.cache}).logits

    def _on_capture_stream(self, run) -> torch.Tensor:
        # Warm-up steps run on the stream the capture will use, so libraries set up their
        # per-stream workspaces there before capturing; the caller's stream waits for them.
        # The library's kernels read the PDL switch at launch: the capture records it.
        current = torch.cuda.current_stream(self._input_ids.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), common.programmatic_dependent_launch(self.pdl):
            logits = run(self._input_ids, self._position_ids)
        current.wait_stream(self._stream)
        return logits

    def _capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        # Capture records the kernels without running them: the step this call asks for is
        # the first replay.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            self._logits = self._step(input_ids, position_ids)
        self._graph = graph
        graph.replay()
        return self._logits


def _storage_of(cache) -> list:
    """Per layer, the object that allocating its storage again replaces: a static PN-Mix layer's
    dict of tensors, a transformers static layer's key tensor."""
    return [layer._storage if hasattr(layer, "_storage") else getattr(layer, "keys", None) for layer in cache.layers]


def _captures_on(device: torch.device) -> bool:
    """Whether :class:`GraphedGenerateCall` captures decode steps on ``device`` (CUDA graphs: CUDA only)."""
    return device.type == "cuda"


class GraphedGenerateCall:
    """The compiled call a PN-Mix patched model hands ``generate`` (its ``get_compiled_call``): each decode
    step on a CUDA :class:`~pnmix_patch.PNMixStaticCache` replays one :class:`GraphedDecodeStep`, so
    ``model.generate(..., cache_implementation="static")`` decodes at the graphed step's latency without
    the host work of ``torch.compile(mode="reduce-overhead")`` (guards, input gathering, the CUDA-graph
    tree's checks) on every token.

    The step is built at the first decode call and built again when the batch shape, the cache or its
    storage changes (a new batch size allocates the static cache again). Every other call (no static
    PN-Mix cache, not CUDA, more than one token per row, an argument the graph does not take) goes to
    ``fallback``, transformers' own compiled call. Where building or capturing the step fails, a warning
    names the error and every later call goes to ``fallback``.

    The graph takes the token ids and positions only: a decode step of the static PN-Mix cache reads no
    attention mask (left padding is recorded in the cache at prefill), so the mask and ``cache_position``
    that ``generate`` passes are not needed.

    Args:
        model: the patched causal LM.
        fallback: called with ``generate``'s keyword arguments where the graph does not serve.
    """

    # generate's decode-step arguments the graph serves; any other sends the call to the fallback.
    _SERVED = {"input_ids", "position_ids", "attention_mask", "cache_position", "cache", "past_key_values", "use_cache", "return_dict"}
    _OFF_WHEN_FALSY = {"output_attentions", "output_hidden_states"}

    def __init__(self, model: torch.nn.Module, fallback):
        self.model = model
        self.fallback = fallback
        self.step: GraphedDecodeStep | None = None
        self._output: CausalLMOutputWithPast | None = None  # the captured step's output, returned by every replay
        self.failure: str | None = None
        """Why the graph cannot serve (the error that building or capturing it raised), or None."""

    def __call__(self, **inputs):
        if not self._serves(inputs):
            return self.fallback(**inputs)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        input_ids, position_ids = inputs["input_ids"], inputs.get("position_ids")
        step = self.step
        if (
            step is None
            or step.cache is not cache
            or step._input_ids.shape != input_ids.shape
            or (step._position_ids is None) != (position_ids is None)
            or any(now is not then for now, then in zip(_storage_of(cache), step._storage))
        ):
            step = self.step = GraphedDecodeStep(self.model, cache)
            self._output = None
        if step.captured:  # inputs checked above; every replay writes the same logits: the output made at capture serves all
            step._replay(input_ids, position_ids)
            return self._output
        try:
            logits = step(input_ids, position_ids)
        except Exception as error:  # compiling (before the step runs) or capturing (records, runs nothing): the cache is as it was
            self.failure, self.step = f"{type(error).__name__}: {error}", None
            warnings.warn(
                f"the decode step could not be captured as a CUDA graph ({self.failure}); generate goes on "
                "with transformers' compiled call",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fallback(**inputs)
        output = CausalLMOutputWithPast(logits=logits, **{_OUTPUT_CACHE_FIELD: cache})
        if step.captured:
            self._output = output
        return output

    def _serves(self, inputs: dict) -> bool:
        cache = inputs.get("cache", inputs.get("past_key_values"))
        input_ids = inputs.get("input_ids")
        logits_to_keep = inputs.get("logits_to_keep", 0)
        return (
            self.failure is None
            and isinstance(cache, PNMixStaticCache)
            and isinstance(input_ids, torch.Tensor)
            and _captures_on(input_ids.device)
            and input_ids.dim() == 2
            and input_ids.shape[1] == 1
            and cache.layers[0].decodes(1)
            and inputs.get("use_cache", True) is not False
            and type(logits_to_keep) is int
            and logits_to_keep in (0, 1)
            and not any(inputs.get(name) for name in self._OFF_WHEN_FALSY)
            and set(inputs) <= self._SERVED | self._OFF_WHEN_FALSY | {"logits_to_keep"}
        )
