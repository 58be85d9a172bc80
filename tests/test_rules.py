"""etc/prometheus's rules: promtool checks them and runs their unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "etc" / "prometheus" / "atopgpud-rules.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "atopgpud-rules-test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return found


def test_rules_pass_promtool_check():
    """promtool check rules accepts every recording and alerting rule."""
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, timeout=60)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_rules_pass_their_unit_tests():
    """promtool test rules: busy rates as atop's arithmetic, and every alert firing when it should."""
    result = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
