"""The systemd unit in etc/: verified clean and hardened (exposure at most 2.5)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "etc" / "atopgpud.service"
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


@pytest.fixture
def unit(tmp_path) -> Path:
    """The unit with ExecStart pointing at this installation's atopgpud."""
    binary = Path(sys.executable).with_name("atopgpud")
    text = UNIT.read_text().replace("/opt/atopgpud/bin/atopgpud", str(binary))
    path = tmp_path / "atopgpud.service"
    path.write_text(text)
    return path


def test_unit_verifies_clean(unit):
    """systemd-analyze verify has nothing to say about the unit."""
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [
        line for line in (result.stdout + result.stderr).splitlines()
        if "atopgpud.service" in line or "Unknown" in line
    ]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr


def test_unit_exposure_is_at_most_2_5(unit):
    """systemd-analyze security --offline=true scores the unit 2.5 or lower."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60
    )
    score = re.search(r"Overall exposure level for atopgpud\.service: ([0-9.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= 2.5


def test_unit_runs_in_the_foreground_and_restarts_on_failure():
    """No fork, no pid file, Restart=on-failure, a dynamic user."""
    text = UNIT.read_text()
    assert "Type=simple" in text and "PIDFile" not in text
    assert "Restart=on-failure" in text and "DynamicUser=yes" in text
    assert re.search(r"^ExecStart=\S*atopgpud (?!.*--pidfile)", text, re.M)
