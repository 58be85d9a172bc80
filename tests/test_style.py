"""The code stays ruff-clean (pyproject.toml's rules)."""

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
