"""Tests of ``pnmix_patch/eval/fidelity.py``'s helpers (its teacher-forced comparisons are exercised by
``test_evaluation.py`` and ``test_real_model.py``)."""

import os
import subprocess
import sys


def test_progress_bars_follow_tqdm_environment():
    """``progress=True`` leaves tqdm's own settings in force (``TQDM_DISABLE=1`` hides the bar, as tqdm
    reads it at import); ``progress=False`` hides it whatever they are."""
    code = (
        "from pnmix_patch.eval.fidelity import progress_bar; "
        "print(progress_bar(range(2), progress=True).disable, progress_bar(range(2), progress=False).disable)"
    )
    for setting, shown in (("1", "True True"), ("", "False True")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")} | ({"TQDM_DISABLE": setting} if setting else {})
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.split() == shown.split()
