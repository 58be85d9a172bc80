"""Running out of file descriptors: one line per burst, polls go on, service comes back.

And a listen backlog that holds a burst of connections rather than refusing them.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import time

from daemon import Client, Daemon, stop_process, twistd, unique_name
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from atopgpud_tw.server.system.listening import DEFAULT_BACKLOG, AcceptLog, listen_endpoint

LIMIT = 48


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def test_out_of_descriptors_is_one_line_and_the_daemon_recovers(tmp_path):
    name = unique_name()
    log = tmp_path / "daemon.log"
    proc = subprocess.Popen(
        [*twistd(), "-n", "--pidfile=", "atopgpud", "--reader", "sim", "--listen", f"unix:@{name}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limited,
    )
    address = b"\0" + name.encode()
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                probe = Client(address)
                probe.types()
                probe.close()
                break
            except OSError:
                time.sleep(0.05)
        for _ in range(3 * LIMIT):  # far more than the daemon has descriptors for
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(address)
            held.append(sock)
        time.sleep(1.5)  # the accept loop runs through them; two polls go by
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(0.5)
        client = Client(address)
        try:
            first = client.stats()[0].samples
            time.sleep(1.2)
            assert client.stats()[0].samples > first  # still polling
        finally:
            client.close()
    finally:
        for sock in held:
            sock.close()
        stop_process(proc)
    text = log.read_text()
    assert "EMFILE" not in text and "Traceback" not in text, text
    assert text.count("out of file descriptors: new connections on unix:@") == 1, text


def test_accept_trouble_is_said_once_per_burst():
    clock = Clock()
    watcher = AcceptLog("unix:@x", clock)
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        for _ in range(100):
            watcher({"log_format": "EMFILE encountered; releasing reserved file descriptor."})
            watcher({"log_format": "EMFILE recovery: Closed socket from {address}", "address": "x"})
            watcher({"log_format": "Re-reserving EMFILE recovery file descriptor."})
        clock.advance(60)
        watcher({"log_format": "Could not accept new connection ({acceptError})", "acceptError": "ENOBUFS"})
        watcher({"log_format": "something else"})
    finally:
        globalLogPublisher.removeObserver(events.append)
    texts = [e["log_format"] for e in events]
    assert texts[0].startswith("out of file descriptors") and texts[1] == "{count} more {what} in that burst"
    assert events[1]["count"] == 99
    assert texts[2] == "cannot accept a connection on {where}: {error}" and texts[3] == "something else"
    assert len(texts) == 4


def test_backlog_holds_a_burst(tmp_path):
    """Every endpoint listens with the kernel's backlog, not Twisted's 50."""
    clock = Clock()
    assert listen_endpoint(clock, "unix:@x")._backlog == DEFAULT_BACKLOG
    assert listen_endpoint(clock, "tcp:59123:interface=127.0.0.1")._backlog == DEFAULT_BACKLOG
    assert listen_endpoint(clock, "unix:/tmp/x.sock:mode=660")._backlog == DEFAULT_BACKLOG
    assert listen_endpoint(clock, "tcp:59123:backlog=7")._backlog == 7
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    burst: list[socket.socket] = []
    try:
        daemon.proc.send_signal(19)  # SIGSTOP: nothing is accepted while the burst arrives
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            sock.connect(b"\0" + daemon.name.encode())  # BlockingIOError here: refused for want of backlog
            burst.append(sock)
        daemon.proc.send_signal(18)  # SIGCONT
    finally:
        for sock in burst:
            sock.close()
        daemon.proc.send_signal(18)
        daemon.stop()
