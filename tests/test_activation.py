"""Socket activation: sockets passed by systemd take the place of the endpoints they match.

End to end through ``systemd-socket-activate`` (systemd's own tool, which passes
sockets the way a socket unit does): the client connects before the daemon exists,
and its request is answered once the daemon has started.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon import Client, free_port, stop_process, unique_name
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, UNIXServerEndpoint
from twisted.internet.task import Clock

from atopgpud_tw.server.system.listening import ActivationError, Inherited, Listener, address_of, take_inherited

ACTIVATE = shutil.which("systemd-socket-activate")
needs_activate = pytest.mark.skipif(
    ACTIVATE is None, reason="systemd-socket-activate (package systemd) is not installed"
)
ATOPGPUD = str(Path(sys.executable).with_name("atopgpud"))


def activated(tmp_path: Path, listen: list[str], names: list[str], args: list[str]) -> tuple[subprocess.Popen, Path]:
    """``systemd-socket-activate`` holding `listen`, starting atopgpud on the first connection."""
    log = tmp_path / f"{unique_name('activated')}.log"
    command = [ACTIVATE, *(f"--listen={a}" for a in listen), f"--fdname={':'.join(names)}", "--",
               ATOPGPUD, "--reader", "sim", *args]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for _ in range(500):  # until it listens; it starts the daemon at the first connection
        if log.read_text().count("Listening on ") == len(listen):
            break
        time.sleep(0.01)
    return proc, log


def stopped(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM; twistd ends by the signal it was sent, as a daemon should."""
    assert stop_process(proc) in (0, -signal.SIGTERM), log.read_text()


@needs_activate
def test_a_client_that_connects_before_the_daemon_is_answered(tmp_path):
    """The request waits in systemd's socket; the daemon, started by it, answers T and S."""
    name, port = unique_name(), free_port()
    proc, log = activated(
        tmp_path, [f"@{name}", f"127.0.0.1:{port}"], ["atopgpud.socket", "atopgpud-tcp.socket"],
        ["--listen", f"unix:@{name}", "--listen", f"tcp:{port}:interface=127.0.0.1"],
    )
    try:
        client = Client(b"\0" + name.encode(), timeout=30)
        try:
            assert [t.busid for t in client.types()] == ["00000000:17:00.0", "00000000:65:00.0"]
        finally:
            client.close()
        tcp = Client(("127.0.0.1", port), socket.AF_INET, timeout=30)
        try:
            assert len(tcp.stats()) == 2
        finally:
            tcp.close()
        text = log.read_text()
        assert f"serving @{name} (atopgpud.socket), passed by systemd" in text
        assert f"serving 127.0.0.1:{port} (atopgpud-tcp.socket), passed by systemd" in text
        assert "Traceback" not in text
    finally:
        stopped(proc, log)


@needs_activate
def test_a_passed_filesystem_socket_is_left_as_systemd_made_it(tmp_path):
    """Mode, file and all: the daemon neither chmods nor removes a socket it was given."""
    tmp_path.chmod(0o755)
    path = tmp_path / "atopgpud.sock"
    proc, log = activated(tmp_path, [str(path)], ["atopgpud.socket"], ["--listen", f"unix:{path}:mode=600"])
    try:
        path.chmod(0o640)
        client = Client(str(path), timeout=30)
        try:
            client.types()
        finally:
            client.close()
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        stopped(proc, log)
    assert path.exists(), "the daemon removed systemd's socket"
    assert not Path(f"{path}.lock").exists()


@needs_activate
def test_a_passed_socket_that_no_option_names_fails_the_start(tmp_path):
    """One line naming the socket, exit status 1: never a socket held and not served."""
    name, other = unique_name(), unique_name()
    proc, log = activated(tmp_path, [f"@{name}"], ["atopgpud-metrics.socket"], ["--listen", f"unix:@{other}"])
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(b"\0" + name.encode())
            proc.wait(30)
    finally:
        stop_process(proc)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert f"atopgpud: systemd passed @{name} (atopgpud-metrics.socket), which no --listen or --metrics names" in text
    assert "Traceback" not in text


@needs_activate
def test_the_metrics_endpoint_can_be_passed_too(tmp_path):
    """A passed TCP socket on --metrics's address serves /metrics."""
    name, port = unique_name(), free_port()
    proc, log = activated(
        tmp_path, [f"@{name}", f"127.0.0.1:{port}"], ["atopgpud.socket", "atopgpud-metrics.socket"],
        ["--listen", f"unix:@{name}", "--metrics", f"tcp:{port}:interface=127.0.0.1"],
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as web:
            web.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            page = b""
            while chunk := web.recv(65536):
                page += chunk
        assert b"200 OK" in page.split(b"\r\n")[0] and b"\natopgpud_poll_interval_seconds 1.0" in page
    finally:
        stopped(proc, log)


# -- matching, without sockets --


def passed(kind: str, *address: object) -> Inherited:
    family = {"unix": socket.AF_UNIX, "tcp4": socket.AF_INET, "tcp6": socket.AF_INET6}[kind]
    if kind == "unix":
        key: tuple = ("unix", address[0])
    else:
        key = ("tcp", ipaddress.ip_address(address[0]), address[1])
    return Inherited(-1, family, key, "test.socket")


def test_endpoint_addresses():
    clock = Clock()
    assert address_of(UNIXServerEndpoint(clock, "\0atopgpud_nvidia")) == ("unix", b"\0atopgpud_nvidia")
    assert address_of(TCP4ServerEndpoint(clock, 59123, interface="127.0.0.1")) == (
        "tcp", ipaddress.ip_address("127.0.0.1"), 59123)
    assert address_of(TCP6ServerEndpoint(clock, 59123)) == ("tcp", ipaddress.ip_address("::"), 59123)
    assert address_of(TCP4ServerEndpoint(clock, 0)) is None  # any port: nothing to match


def test_matching_takes_each_passed_socket_once():
    clock = Clock()
    listeners = [
        Listener("unix:@a", UNIXServerEndpoint(clock, "\0a"), "atop"),
        Listener("tcp:59123", TCP4ServerEndpoint(clock, 59123), "atop"),
        Listener("tcp:9445:interface=127.0.0.1", TCP4ServerEndpoint(clock, 9445, interface="127.0.0.1"), "metrics"),
    ]
    # all interfaces over IPv6 (ListenStream=59123) is what tcp:59123 asks for
    chosen = take_inherited(clock, listeners, [passed("tcp6", "::", 59123), passed("unix", b"\0a")])
    assert [c.passed is not None for c in chosen] == [True, True, False]
    with pytest.raises(ActivationError, match=r"systemd passed 127.0.0.2:9445 \(test.socket\), which no"):
        take_inherited(clock, listeners, [passed("tcp4", "127.0.0.2", 9445)])
    with pytest.raises(ActivationError, match="@b"):
        take_inherited(clock, listeners, [passed("unix", b"\0a"), passed("unix", b"\0b")])


def test_without_systemd_nothing_is_inherited():
    from atopgpud_tw.server.system.listening import inherited_sockets

    environ = {"LISTEN_FDNAMES": "x"}
    assert inherited_sockets(environ) == [] and "LISTEN_FDNAMES" not in environ
    assert os.environ.get("LISTEN_FDS") is None


def test_passed_descriptor_that_is_no_listening_socket_is_refused():
    from atopgpud_tw.server.system.listening import _inspect

    left, right = socket.socketpair()
    read, write = os.pipe()
    try:
        with pytest.raises(ActivationError, match="not a listening stream socket"):
            _inspect(left.fileno(), "x.socket")
        with pytest.raises(ActivationError, match="not a socket"):
            _inspect(read, "y.socket")
    finally:
        left.close(), right.close(), os.close(read), os.close(write)


def test_the_passed_socket_still_listens_after_the_daemon_stops(tmp_path):
    """systemd keeps the socket across the service's restarts: the daemon must not shut it down."""
    name = unique_name()
    held = socket.socket(socket.AF_UNIX)  # what systemd holds
    held.bind(b"\0" + name.encode())
    held.listen(16)
    log = tmp_path / "daemon.log"
    # as systemd starts a service: the socket as descriptor 3, LISTEN_PID the service's own
    wrapper = (
        "import os, sys\n"
        f"os.dup2({held.fileno()}, 3)\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='atopgpud.socket')\n"
        f"os.execv({ATOPGPUD!r}, [{ATOPGPUD!r}, '--reader', 'sim', '--listen', 'unix:@{name}'])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", wrapper], pass_fds=(held.fileno(),), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        client = Client(b"\0" + name.encode(), timeout=30)
        try:
            assert len(client.types()) == 2
        finally:
            client.close()
    finally:
        stopped(proc, log)
    try:
        with socket.socket(socket.AF_UNIX) as late:  # waits in the queue for the next daemon
            late.connect(b"\0" + name.encode())
        assert "passed by systemd" in log.read_text()
    finally:
        held.close()
