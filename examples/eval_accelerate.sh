#!/usr/bin/env bash
# Data-parallel lm-evaluation-harness run through the PN-Mix KV cache.
#
# Every process loads the whole model; lm-eval gives rank r the documents r, r+N, ...
# and rank 0 gathers the samples and writes the results.
#
#   examples/eval_accelerate.sh                              # embedded SmolLM2, tiny local task, all GPUs or 2 CPU processes
#   MODEL=/models/Qwen3-8B PRESET=pnmix-1 NPROC=8 TASKS=gsm8k_local_8shot examples/eval_accelerate.sh
#   MODEL=/models/Qwen3-8B TASKS=aime24 GEN_KWARGS=max_gen_toks=32768,do_sample=True,temperature=0.6,top_p=0.95,top_k=20 \
#       MODEL_ARGS_EXTRA=,max_length=40960 examples/eval_accelerate.sh   # needs a reachable hub for the data
#
# GPUs: `accelerate launch --multi_gpu` (NCCL). CPU: `torchrun` (gloo); on CPU,
# `accelerate launch --cpu --num_processes N` may start a single process, so it is not used.
# Extra arguments are passed to lm_eval (e.g. --limit 20).
set -euo pipefail
cd "$(dirname "$0")/.."                          # task data paths are relative to the repository root

MODEL=${MODEL:-smollm2}                          # smollm2, a .gguf file, a model folder, or a hub id
PRESET=${PRESET:-pnmix-1}                        # a name of pnmix_patch.PRESETS: pnmix-1, kitty, fp16, ...
TASKS=${TASKS:-gsm8k_local_tiny}
INCLUDE=${INCLUDE:-pnmix_patch/eval/tasks}
OUTPUT=${OUTPUT:-results/lm_eval}
BATCH_SIZE=${BATCH_SIZE:-1}
GEN_KWARGS=${GEN_KWARGS:-}
MODEL_ARGS_EXTRA=${MODEL_ARGS_EXTRA:-}

if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    NPROC=${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}
    LAUNCH=(accelerate launch --multi_gpu --num_processes "$NPROC" --num_machines 1 --mixed_precision no --dynamo_backend no)
    [ "$NPROC" -gt 1 ] || LAUNCH=(accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no)
    DEVICE=cuda
else
    NPROC=${NPROC:-2}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    LAUNCH=(torchrun --nproc_per_node "$NPROC")
    DEVICE=cpu
fi

ARGS=(--model pnmix --model_args "pretrained=${MODEL},preset=${PRESET}${MODEL_ARGS_EXTRA}"
      --device "$DEVICE" --batch_size "$BATCH_SIZE" --include_path "$INCLUDE" --tasks "$TASKS"
      --output_path "$OUTPUT" --log_samples)
[ -z "$GEN_KWARGS" ] || ARGS+=(--gen_kwargs "$GEN_KWARGS")

exec "${LAUNCH[@]}" -m pnmix_patch.eval.lm_eval_model "${ARGS[@]}" "$@"
