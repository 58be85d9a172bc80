"""Access control: filesystem sockets with group and mode, uid allow-lists, TCP warnings."""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon import Daemon, unique_name
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import succeed
from twisted.logger import capturedLogs
from twisted.python.failure import Failure

from atopgpud_tw.server.system.listening import CheckedEndpoint

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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
@root_only
def test_without_allow_list_everyone_may_connect(tmp_path):
    """No allow-list: an abstract socket is open to every local user, as atop expects."""
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    try:
        assert nobody_can_connect(b"\0" + daemon.name.encode())
    finally:
        daemon.stop()


def succeeded(deferred: Any) -> Any:
    """The result of a Deferred that has fired; its failure raised here if it failed."""
    outcome: list[Any] = []
    deferred.addBoth(outcome.append)
    assert outcome, "the Deferred has not fired"
    if isinstance(outcome[0], Failure):
        outcome[0].raiseException()
    return outcome[0]


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
    with capturedLogs() as events:
        for address in (
            IPv4Address("TCP", "0.0.0.0", 59123),
            IPv4Address("TCP", "127.0.0.1", 59123),
            IPv6Address("TCP", "::1", 59123),
            UNIXAddress("\0name"),
        ):
            assert succeeded(CheckedEndpoint(FakeEndpoint(address)).listen(object())).getHost() == address
    warnings = [e for e in events if "visible to the network" in e.get("log_format", "")]
    assert [w["host"] for w in warnings] == ["0.0.0.0"]


@pytest.mark.e2e
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


def nobody_can_scrape(address: bytes | str, extra_groups: tuple[str, ...] = ()) -> bool:
    """Whether user nobody gets a metrics page over this UNIX socket."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
        f"s.connect({address!r}); s.sendall(b'GET /metrics HTTP/1.0\\r\\n\\r\\n')\n"
        "sys.exit(0 if s.recv(12).startswith(b'HTTP/1.') else 3)\n"
    )
    result = subprocess.run(
        [SYSTEM_PYTHON, "-c", code], user="nobody", group="nogroup", extra_groups=list(extra_groups),
        capture_output=True, timeout=30,
    )
    return result.returncode == 0


@pytest.mark.e2e
@root_only
def test_allow_list_applies_to_a_unix_metrics_socket(tmp_path):
    """--allow-uid guards --metrics unix:@NAME as it guards the atop sockets."""
    metrics = unique_name("metrics")
    for allowed, expected in (("root", False), ("nobody", True)):
        daemon = Daemon(tmp_path, ["--reader", "sim", "--allow-uid", allowed, "--metrics", f"unix:@{metrics}",
                                   "--metrics-processes"]).start()
        try:
            assert nobody_can_scrape(b"\0" + metrics.encode()) is expected
        finally:
            daemon.stop()
        assert ("refusing a client with uid 65534 on --metrics: not in --allow-uid/--allow-gid" in daemon.log()) \
            is not expected


@pytest.mark.e2e
@root_only
def test_a_supplementary_group_admits(tmp_path):
    """--allow-gid: nobody, with the group only as a supplementary one, is let in; without it, not."""
    daemon = Daemon(tmp_path, ["--reader", "sim", "--allow-gid", "daemon"]).start()
    try:
        address = b"\0" + daemon.name.encode()
        assert not nobody_can_connect(address)
        code = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
            f"s.connect({address!r}); s.sendall(b'T\\x02')\n"
            "sys.exit(0 if s.recv(4) else 3)\n"
        )
        result = subprocess.run([SYSTEM_PYTHON, "-c", code], user="nobody", group="nogroup",
                                extra_groups=["daemon"], capture_output=True, timeout=30)
        assert result.returncode == 0, daemon.log()
    finally:
        daemon.stop()


def test_peer_groups_come_from_the_socket_not_proc():
    """SO_PEERGROUPS: the groups the peer had when it connected (ProtectProc=invisible hides /proc)."""
    from atopgpud_tw.server.system import access

    left, right = socket.socketpair(socket.AF_UNIX)
    try:
        groups = access._peer_groups(left)
        assert groups is not None and groups == frozenset(os.getgroups())
    finally:
        left.close(), right.close()


@pytest.mark.e2e
def test_metrics_socket_gets_the_socket_group(tmp_path):
    """--socket-group applies to a filesystem --metrics socket as to the atop ones."""
    tmp_path.chmod(0o755)
    path = tmp_path / "metrics.sock"
    group = grp.getgrnam("daemon")
    daemon = Daemon(tmp_path, ["--reader", "sim", "--metrics", f"unix:{path}:mode=660", "--socket-group", "daemon"])
    daemon.start()
    try:
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == group.gr_gid
    finally:
        daemon.stop()
    assert not path.exists()


@pytest.mark.e2e
@pytest.mark.parametrize("option", ["--allow-uid", "--allow-gid"])
@pytest.mark.parametrize("value", ["", ",", " "])
def test_an_empty_allow_list_is_an_error_not_everyone(option, value):
    """An unset variable in ExecStart gives an empty list: that is a mistake, said in one line."""
    atopgpud = str(Path(sys.executable).with_name("atopgpud"))
    result = subprocess.run([atopgpud, "--reader", "sim", option, value], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"atopgpud: {option} {value!r}: names no one") and result.stderr.count("\n") == 1


def test_metrics_with_processes_beyond_loopback_is_warned_about():
    """--metrics-processes on all interfaces exposes every GPU process: warned as the atop listener is."""
    with capturedLogs() as events:
        for exposed in (None, "every GPU process (--metrics-processes)"):
            endpoint = CheckedEndpoint(FakeEndpoint(IPv4Address("TCP", "0.0.0.0", 9445)), None, exposed)
            assert succeeded(endpoint.listen(object())).getHost().port == 9445
    warnings = [e for e in events if "visible to the network" in e.get("log_format", "")]
    assert [w["exposed"] for w in warnings] == ["every GPU process (--metrics-processes)"]


@pytest.mark.e2e
def test_the_daemon_warns_of_metrics_processes_beyond_loopback(tmp_path):
    daemon = Daemon(tmp_path, ["--reader", "sim", "--metrics", "tcp:0", "--metrics-processes"]).start()
    daemon.stop()
    assert "every GPU process (--metrics-processes) is visible to the network" in daemon.log()
    quiet = Daemon(tmp_path, ["--reader", "sim", "--metrics", "tcp:0"]).start()
    quiet.stop()
    assert "visible to the network" not in quiet.log()
