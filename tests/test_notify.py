"""Type=notify: READY=1 once serving, a status line, STOPPING=1; nothing without systemd."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from daemon import Client, stop_process, unique_name
from twisted.internet.task import Clock

from atopgpud_tw.server.system.notify import STATUS_EVERY, Notifier, NotifyService

ATOPGPUD = str(Path(sys.executable).with_name("atopgpud"))


class Listener:
    """A NOTIFY_SOCKET of our own: the datagrams a daemon sends to systemd."""

    def __init__(self) -> None:
        self.name = unique_name("notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name.encode())
        self.sock.settimeout(30)

    def next(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.splitlines())

    def close(self) -> None:
        self.sock.close()


def start(tmp_path: Path, listener: Listener, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{listener.name}.log"
    env = {**os.environ, "NOTIFY_SOCKET": "@" + listener.name}
    proc = subprocess.Popen([ATOPGPUD, "--reader", "sim", *args], env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, log


def test_ready_when_serving_with_a_status_line_and_stopping_said(tmp_path):
    listener, name = Listener(), unique_name()
    proc, log = start(tmp_path, listener, "--listen", f"unix:@{name}")
    try:
        ready = listener.next()
        assert ready == {"READY": "1", "STATUS": "sim: 2 GPUs"}, log.read_text()
        client = Client(b"\0" + name.encode())  # listening by the time it says ready
        try:
            assert len(client.types()) == 2
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert listener.next() == {"STOPPING": "1", "STATUS": "stopping"}
    finally:
        stop_process(proc)
        listener.close()
    assert "NOTIFY_SOCKET" not in log.read_text()


def test_a_failed_start_never_says_ready(tmp_path):
    """A listener that cannot listen: exit status 1 and no READY=1 (the unit fails)."""
    listener, name = Listener(), unique_name()
    taken = socket.socket(socket.AF_UNIX)
    taken.bind(b"\0" + name.encode())
    taken.listen()
    proc, log = start(tmp_path, listener, "--listen", f"unix:@{name}")
    try:
        assert proc.wait(30) == 1, log.read_text()
        listener.sock.settimeout(0.2)
        try:
            message = listener.sock.recv(4096)
        except TimeoutError:
            message = b""
        assert b"READY=1" not in message
    finally:
        stop_process(proc)
        listener.close()
        taken.close()


class Sent:
    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.active = True

    def send(self, **fields: str) -> None:
        self.messages.append(fields)


class RunningClock(Clock):
    def callWhenRunning(self, f, *args):  # noqa: N802 - Twisted's name
        f(*args)


def test_status_is_sent_when_it_changes_and_only_then():
    sent, clock, status = Sent(), RunningClock(), ["nvml: 2 GPUs"]
    service = NotifyService(sent, lambda: status[0], clock)  # type: ignore[arg-type]
    service.startService()
    assert sent.messages == [{"READY": "1", "STATUS": "nvml: 2 GPUs"}]
    clock.advance(STATUS_EVERY)
    assert len(sent.messages) == 1
    status[0] = "nvml: 1 GPU, 1 lost"
    clock.advance(STATUS_EVERY)
    assert sent.messages[-1] == {"STATUS": "nvml: 1 GPU, 1 lost"}
    service.stopService()
    assert sent.messages[-1] == {"STOPPING": "1", "STATUS": "stopping"} and not clock.getDelayedCalls()


def test_without_systemd_nothing_is_sent_or_scheduled():
    notifier = Notifier({})
    clock = RunningClock()
    service = NotifyService(notifier, lambda: "x", clock)
    service.startService()
    assert not notifier.active and not clock.getDelayedCalls()
    service.stopService()


def test_an_abstract_and_a_filesystem_notify_socket(tmp_path):
    assert Notifier({"NOTIFY_SOCKET": "@name"}).address == "\0name"
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    environ = {"NOTIFY_SOCKET": str(path)}
    Notifier(environ).send(READY="1")
    assert sock.recv(100) == b"READY=1" and environ == {}
    sock.close()
