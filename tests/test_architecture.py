"""The package's layers import downward only, and no import closes a circle (``docs/architecture.md``).

Every import of the package's own modules is read from the source (module level and inside
functions alike), so a lazy import cannot hide a dependency that runs back up.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"pnmix_patch": ROOT / "pnmix_patch", "pnmix_patch.kernels": ROOT / "kernels", "pnmix_patch.patches": ROOT / "patches"}
"""Installed package name -> folder (``setup.cfg`` maps ``kernels/`` and ``patches/`` into the package)."""

LAYERS = (
    ("foundation", ("pnmix_patch.config", "pnmix_patch.mixins")),
    ("reference", ("pnmix_patch.reference",)),
    ("kernels", ("pnmix_patch.kernels",)),
    ("caches", ("pnmix_patch.cache", "pnmix_patch.static_cache")),
    ("modules", ("pnmix_patch.attention", "pnmix_patch.linear")),
    ("patches", ("pnmix_patch.patches",)),
    ("api", ("pnmix_patch.api", "pnmix_patch.graphed_decode", "pnmix_patch.cache_io")),
    ("tools", ("pnmix_patch.eval", "pnmix_patch.planner", "pnmix_patch.cli", "pnmix_patch.__main__")),
)
"""Bottom to top: a module may import its own layer and the layers below it."""


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (``pnmix_patch.kernels.common``), packages as their ``__init__``."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = package_modules()


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


def imported_modules(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports (``from x import y`` counts ``x.y`` where that is a module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target == "pnmix_patch" or target.startswith("pnmix_patch."))
    found.discard(name)  # a script importing itself under its installed name (``python -m``)
    return found


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        if name != "pnmix_patch":
            layer_of(name)


def test_the_package_does_not_import_its_own_facade():
    """``pnmix_patch/__init__.py`` re-exports the public API for users; inside the package each module
    imports the module that defines what it needs."""
    offenders = sorted(name for name, targets in GRAPH.items() if "pnmix_patch" in targets and name != "pnmix_patch")
    assert not offenders, f"modules importing the pnmix_patch facade: {offenders}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "pnmix_patch"))
def test_imports_run_downward(name):
    upward = sorted(t for t in GRAPH[name] if t != "pnmix_patch" and layer_of(t) > layer_of(name))
    assert not upward, f"{name} ({LAYERS[layer_of(name)][0]}) imports from higher layers: " + ", ".join(
        f"{t} ({LAYERS[layer_of(t)][0]})" for t in upward
    )


def test_no_import_circle():
    """Depth-first search over the module graph; a back edge is a circle."""
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == "open":
                circle = trail[trail.index(target) :] + [target] if target in trail else [module, target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_relative_and_lazy_imports():
    """The graph holds what the source says: the kernels package's own submodules, a relative import one level
    up, and an import made inside a function."""
    assert "pnmix_patch.kernels.decode_attention" in GRAPH["pnmix_patch.kernels"]
    assert "pnmix_patch.api" in GRAPH["pnmix_patch.eval.fidelity"]
    assert "pnmix_patch.eval.models" in GRAPH["pnmix_patch.planner"]  # imported inside a method
