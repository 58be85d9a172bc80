"""The code stays ruff-clean and mypy-clean (pyproject.toml's rules for both)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    """ruff check finds nothing in the package, the tests, bench/ and the plugin."""
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff)] if ruff.exists() else [shutil.which("ruff") or pytest.skip("ruff is not installed")]
    result = subprocess.run(
        [*command, "check", "--no-cache", "atopgpud_tw", "tests", "bench", "twisted"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    """mypy, with the zope plugin, finds nothing in the package."""
    mypy = Path(sys.executable).with_name("mypy")
    command = [str(mypy)] if mypy.exists() else [shutil.which("mypy") or pytest.skip("mypy is not installed")]
    result = subprocess.run(
        [*command, "--no-incremental", "--cache-dir", "/dev/null"], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
