"""Access control: filesystem sockets with group and mode, uid allow-lists, TCP warnings."""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess

import pytest
from daemon import Daemon
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import succeed
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from atopgpud_tw.endpoints import CheckedEndpoint

# the client runs as user nobody, who may not reach this interpreter (under /root)
SYSTEM_PYTHON = "/usr/bin/python3"
root_only = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root to act as another user, and /usr/bin/python3 for that user",
)


def nobody_can_connect(address: bytes | str) -> bool:
    """Whether user nobody gets a reply to T on this UNIX socket."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
        f"s.connect({address!r}); s.sendall(b'T\\x02')\n"
        "sys.exit(0 if s.recv(4) else 3)\n"
    )
    result = subprocess.run(
        [SYSTEM_PYTHON, "-c", code], user="nobody", group="nogroup", capture_output=True, timeout=30
    )
    return result.returncode == 0


def test_filesystem_socket_gets_mode_and_group_and_is_removed_at_exit(tmp_path):
    """unix:PATH:mode=660 with --socket-group: the file has both; SIGTERM removes it."""
    tmp_path.chmod(0o755)
    path = tmp_path / "atopgpud.sock"
    group = grp.getgrnam("daemon")
    daemon = Daemon(tmp_path, ["--reader", "sim", "--listen", f"unix:{path}:mode=660", "--socket-group", "daemon"])
    daemon.start()
    try:
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == group.gr_gid
    finally:
        daemon.stop()
    assert not path.exists()


@root_only
def test_allow_list_refuses_other_users_on_the_abstract_socket(tmp_path):
    """--allow-uid: user nobody is refused unless listed; the refusal is logged."""
    for allowed, expected in (("root", False), ("nobody", True)):
        daemon = Daemon(tmp_path, ["--reader", "sim", "--allow-uid", allowed]).start()
        try:
            assert nobody_can_connect(b"\0" + daemon.name.encode()) is expected
        finally:
            daemon.stop()
        assert ("refusing a client with uid" in daemon.log()) is not expected


@root_only
def test_without_allow_list_everyone_may_connect(tmp_path):
    """No allow-list: an abstract socket is open to every local user, as atop expects."""
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    try:
        assert nobody_can_connect(b"\0" + daemon.name.encode())
    finally:
        daemon.stop()


class FakePort:
    def __init__(self, address):
        self.address = address

    def getHost(self):
        return self.address


class FakeEndpoint:
    def __init__(self, address):
        self.address = address

    def listen(self, factory):
        return succeed(FakePort(self.address))


def test_tcp_beyond_loopback_is_warned_about():
    """A TCP listener on all interfaces logs a warning; loopback does not."""
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        for address in (
            IPv4Address("TCP", "0.0.0.0", 59123),
            IPv4Address("TCP", "127.0.0.1", 59123),
            IPv6Address("TCP", "::1", 59123),
            UNIXAddress("\0name"),
        ):
            result = CheckedEndpoint(FakeEndpoint(address)).listen(object())
            result.addErrback(Failure.raiseException)
    finally:
        globalLogPublisher.removeObserver(events.append)
    warnings = [e for e in events if "visible to the network" in e.get("log_format", "")]
    assert [w["host"] for w in warnings] == ["0.0.0.0"]


def test_abstract_socket_has_no_file(tmp_path):
    """unix:@NAME listens in the abstract namespace: nothing appears on disk."""
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    try:
        client = socket.socket(socket.AF_UNIX)
        client.connect(b"\0" + daemon.name.encode())
        client.close()
        assert not any(daemon.name in p.name for p in tmp_path.iterdir() if not p.name.endswith((".log", ".json")))
    finally:
        daemon.stop()
