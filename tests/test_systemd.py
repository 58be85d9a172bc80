"""The systemd units in etc/: verified clean, hardened (exposure at most 1.3), notify and sockets."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ETC = Path(__file__).resolve().parents[1] / "etc"
UNIT = ETC / "atopgpud.service"
SOCKETS = ("atopgpud.socket", "atopgpud-tcp.socket")
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


@pytest.fixture
def unit(tmp_path) -> Path:
    """The units, with ExecStart pointing at this installation's atopgpud."""
    binary = Path(sys.executable).with_name("atopgpud")
    for name in ("atopgpud.service", *SOCKETS):
        text = (ETC / name).read_text().replace("/usr/sbin/atopgpud", str(binary))
        (tmp_path / name).write_text(text)
    return tmp_path / "atopgpud.service"


@pytest.mark.e2e
def test_units_verify_clean(unit):
    """systemd-analyze verify has nothing to say about the service or the socket units (--man=no: the
    atopgpud(8) they name is installed by the Debian package, not on this host)."""
    paths = [str(unit), *(str(unit.with_name(name)) for name in SOCKETS)]
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths], capture_output=True, text=True,
                            timeout=60)
    complaints = [
        line for line in (result.stdout + result.stderr).splitlines()
        if "atopgpud" in line or "Unknown" in line
    ]
    assert result.returncode == 0 and complaints == [], result.stdout + result.stderr


@pytest.mark.e2e
def test_unit_exposure_is_at_most_1_5(unit):
    """systemd-analyze security --offline=true scores the unit 1.5 or lower (docs/reliability.md:
    ProtectProc=default, for other users' GPU processes' /proc, is 0.2 of it)."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60
    )
    score = re.search(r"Overall exposure level for atopgpud\.service: ([0-9.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= 1.5


def test_unit_runs_in_the_foreground_and_restarts_on_failure():
    """No fork, no pid file, Restart=on-failure, a dynamic user."""
    text = UNIT.read_text()
    assert "Type=notify" in text and "PIDFile" not in text
    assert "Restart=on-failure" in text and "DynamicUser=yes" in text
    assert re.search(r"^ExecStart=\S*atopgpud (?!.*--pidfile)", text, re.M)


def test_no_private_users_so_peer_credentials_are_true():
    """PrivateUsers=yes would show every other user as nobody to SO_PEERCRED."""
    assert not re.search(r"^PrivateUsers=(yes|true|1)", UNIT.read_text(), re.M)


def test_socket_units_hold_the_addresses_the_service_listens_on():
    """Each socket unit's address is one of the service's --listen endpoints, so it is taken over."""
    text = UNIT.read_text()
    for name, listen in (("atopgpud.socket", "unix:@atopgpud_nvidia"),
                         ("atopgpud-tcp.socket", "tcp:59123:interface=127.0.0.1")):
        socket_unit = (ETC / name).read_text()
        assert "Service=atopgpud.service" in socket_unit and f"--listen {listen}" in text
    assert "ListenStream=@atopgpud_nvidia" in (ETC / "atopgpud.socket").read_text()
    assert "ListenStream=127.0.0.1:59123" in (ETC / "atopgpud-tcp.socket").read_text()
