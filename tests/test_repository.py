"""The repository states what the code is, not how it was made, and its links stay inside it.

Every tracked text file is read: no reference to what lies outside the repository (:data:`OUTSIDE`),
and every relative markdown link points to a file that exists in it.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".txt", ".cfg", ".toml", ".yaml", ".yml", ".sh", ".ini", ".jsonl"}
TEXT_NAMES = {"run", ".gitignore"}

OUTSIDE = re.compile(r"\bissues? #?\d+\b|\b(?:PR|pull request) #?\d+\b|PNMIX_SPEC|\.\./shared\b", re.IGNORECASE)
"""References to what lies outside the repository: tracker numbers and the source specification (the
repository explains the method in its own docs). Ordinary words stay allowed ("issues a warning")."""

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|\!\[[^\]]*\]\(([^)\s]+)\)")


def tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        paths = [ROOT / name for name in names]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the virtual environment
        paths = [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]
    return sorted(p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES))


FILES = tracked_text_files()


def outside_lines(text: str) -> list[str]:
    return [f"{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links of a markdown file that leave the repository or name no existing file."""
    broken = []
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # an anchor, or a URL
            continue
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    return broken


def test_the_references_check_catches_outside_references_and_spares_code_words():
    assert outside_lines("as issue 42 asks") and outside_lines("see ../shared/PNMIX_SPEC.md")
    assert not outside_lines("a helper function takes the first token; a third of the error; issues a warning")


def test_the_link_check_catches_links_out_of_the_repository(tmp_path):
    page = ROOT / "README.md"
    assert broken_links(page, "[spec](../shared/PNMIX_SPEC.md) [gone](docs/nowhere.md)") == ["../shared/PNMIX_SPEC.md", "docs/nowhere.md"]
    assert broken_links(page, "[method](docs/method.md#pairs) [paper](https://arxiv.org/abs/2502.00527) [top](#set-up)") == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repository(path):
    if path == Path(__file__):
        return  # this file spells the references out
    found = outside_lines(path.read_text(encoding="utf-8", errors="replace"))
    assert not found, f"{path.relative_to(ROOT)} refers to what lies outside the repository:\n" + "\n".join(found[:20])


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_stay_in_the_repository(path):
    broken = broken_links(path, path.read_text(encoding="utf-8"))
    assert not broken, f"{path.relative_to(ROOT)} links outside the repository or to missing files: {broken}"
