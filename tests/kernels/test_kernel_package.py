"""``kernels/__init__.py``: the package registers the ops under ``pnmix_patch.kernels`` only, and the
folder found as a top-level ``kernels`` from the repository root (``python -m`` or ``-c`` run there)
hands that name over to the package it shadows (Hugging Face's ``kernels``, which transformers 5.25
and newer import with the models)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_from_root(code: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """``python -c code`` with the repository root as working directory (so first on ``sys.path``)."""
    env = dict(os.environ, PYTHONPATH=pythonpath, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_top_level_name_goes_to_the_package_it_shadows(tmp_path):
    """A ``kernels`` package later on ``sys.path`` is what ``import kernels`` returns from the repository
    root, its submodules included, and no op is registered through the folder."""
    shadowed = tmp_path / "kernels"
    shadowed.mkdir()
    (shadowed / "__init__.py").write_text("CUDAProperties = 'the shadowed package'\n")
    (shadowed / "layer.py").write_text("NAME = 'its submodule'\n")
    code = (
        "import kernels, kernels.layer, torch\n"
        "print(kernels.CUDAProperties, '|', kernels.layer.NAME, '|', hasattr(torch.ops.pnmix, 'decode_attention'))\n"
    )
    result = run_from_root(code, pythonpath=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "the shadowed package | its submodule | False"


def test_without_a_shadowed_package_the_top_level_name_is_an_empty_module():
    """Where no other ``kernels`` is installed the folder stays an empty module: no op is registered
    through it (a second registration of the ``pnmix`` ops would raise)."""
    code = (
        "import importlib.machinery, sys\n"
        "path = [p for p in sys.path if p not in ('', '.')]\n"
        "installed = importlib.machinery.PathFinder.find_spec('kernels', path)\n"
        "import kernels, torch\n"
        "print(installed is None, kernels.__name__, getattr(kernels, '__file__', None), hasattr(torch.ops.pnmix, 'gemv'))\n"
    )
    result = run_from_root(code)
    assert result.returncode == 0, result.stderr
    none_installed, name, origin, registered = result.stdout.split()
    assert name == "kernels"
    if none_installed == "True":
        assert origin == str(ROOT / "kernels" / "__init__.py") and registered == "False"
    else:  # transformers >= 5.25: Hugging Face's package is installed, and is the one found
        assert origin != str(ROOT / "kernels" / "__init__.py")


def test_the_documented_module_commands_run_from_the_repository_root():
    """``python -m pnmix_patch.planner`` (README) from the checkout's root: transformers imports its
    models (and, from 5.25 on, Hugging Face's ``kernels``) with the folder first on ``sys.path``."""
    result = subprocess.run(
        [sys.executable, "-m", "pnmix_patch.planner", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout
