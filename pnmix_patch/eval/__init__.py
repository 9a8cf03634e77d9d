"""Evaluation tools: fidelity metrics and the ``pnmix eval`` study (:mod:`.evaluation`), teacher forcing
through a cache (:mod:`.fidelity`), transformers' own quantized cache as comparison methods
(:mod:`.hf_quantized`), the lm-evaluation-harness model (:mod:`.lm_eval_model`, tasks in
``tasks/``), and loading the packaged real models and text (:mod:`.models`, ``data/``).

They sit above the public API and use only it (and the caches, for the attention study); nothing in the
library imports them.
"""
