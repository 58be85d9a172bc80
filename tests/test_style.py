"""The code stays ruff-clean and mypy-clean (pyproject.toml's rules for both), in the quick loop:
both keep their caches in the checkout (.ruff_cache, .mypy_cache), so a run after a small edit
takes well under a second each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.lint
def test_ruff_is_clean():
    """ruff check finds nothing in the package, the tests, bench/ and the plugin."""
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff)] if ruff.exists() else [shutil.which("ruff") or pytest.skip("ruff is not installed")]
    result = subprocess.run(
        [*command, "check", "atopgpud_tw", "tests", "bench", "twisted"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    """mypy, with the zope plugin, finds nothing in the package (run in this process)."""
    out, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                   "--cache-dir", str(ROOT / ".mypy_cache"), str(ROOT / "atopgpud_tw")])
    assert status == 0, out + errors
