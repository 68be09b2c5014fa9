"""The code base stays ruff-clean (the style rules in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def test_ruff_check_is_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    res = subprocess.run([exe, "check", "fedskew", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


def test_git_holds_no_run_outputs_data_or_links() -> None:
    """Nothing under outputs/ or data/, no checkpoint, virtualenv or wheel, and no symbolic link (a
    link committed as `outputs` sends a fresh clone's runs to a folder that is not there, and a
    checkout replaces a real `outputs/` folder by it)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    res = subprocess.run([git, "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    entries = [line.split(maxsplit=3) for line in res.stdout.splitlines()]
    links = [e[3] for e in entries if e[0] == "120000"]
    assert not links, f"symbolic links in git: {links}"
    banned = ("outputs", "data", ".venv", ".whl")
    kept = [e[3] for e in entries if e[3].split("/")[0] in banned or e[3].endswith((".pt", ".ckpt"))]
    assert not kept, f"run outputs, data or checkpoints in git: {kept[:5]}"
