"""Signals a daemon is sent, through the installed daemon: none kills it without cleaning up."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from daemon import Client, Daemon, twistd


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2])
def test_signal_is_logged_and_ignored_in_the_foreground(tmp_path, signum):
    """twistd -n: SIGHUP, SIGUSR1 and SIGUSR2 are logged and the daemon serves on."""
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    try:
        daemon.proc.send_signal(signum)
        wait_for(lambda: f"{signal.Signals(signum).name}: ignored" in daemon.log())
        client = daemon.client()
        assert client.ask("T")[0] == 2
        client.close()
        assert daemon.proc.poll() is None
    finally:
        status = daemon.stop()
    assert status in (0, -signal.SIGTERM) and "Traceback" not in daemon.log()


def test_two_sigterms_at_once_stop_cleanly(tmp_path):
    """Two SIGTERMs a fraction of a millisecond apart: one shutdown, no ReactorNotRunning, socket file gone."""
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path, ["--reader", "sim", "--listen", f"unix:{sock}"]).start()
    os.kill(daemon.proc.pid, signal.SIGTERM)
    os.kill(daemon.proc.pid, signal.SIGTERM)
    assert daemon.stop() in (0, -signal.SIGTERM)
    log = daemon.log()
    assert "Server Shut Down." in log and "Traceback" not in log and "ReactorNotRunning" not in log
    assert not sock.exists() and not Path(f"{sock}.lock").exists()


def test_daemonized_sighup_reopens_the_log_file_and_sigusr1_rotates_it(tmp_path):
    """twistd with --logfile: SIGHUP reopens the log file (moved away as by logrotate), SIGUSR1 rotates it."""
    log, pidfile, sock = tmp_path / "d.log", tmp_path / "d.pid", tmp_path / "d.sock"
    subprocess.run([*twistd(), f"--pidfile={pidfile}", f"--logfile={log}", "atopgpud", "--reader", "sim",
                    "--listen", f"unix:{sock}"], check=True, timeout=60, stdin=subprocess.DEVNULL)
    pid = int(pidfile.read_text())
    try:
        wait_for(lambda: "Server Shut Down" not in log.read_text() and sock.exists())
        client = Client(str(sock))  # answered: the reactor runs, with every handler in place
        assert client.ask("T")[0] == 2
        client.close()
        log.rename(tmp_path / "d.log.moved")
        os.kill(pid, signal.SIGHUP)
        wait_for(lambda: log.exists() and "SIGHUP: log file" in log.read_text())
        os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: (tmp_path / "d.log.1").exists())
        client = Client(str(sock))
        assert client.ask("T")[0] == 2
        client.close()
    finally:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not pidfile.exists())
    assert not sock.exists() and not Path(f"{sock}.lock").exists()
    assert "Traceback" not in "".join(p.read_text() for p in tmp_path.glob("d.log*"))


def test_sighup_is_handled_from_the_service_start_before_the_reactor_runs():
    """The listeners may take clients before the reactor runs: a SIGHUP then (a reload
    asked as the daemon starts) must not take the default action, which is to die."""
    from twisted.internet.task import Clock

    from atopgpud_tw.server.system.signals import SignalService

    class NotYetRunning(Clock):
        def __init__(self) -> None:
            super().__init__()
            self.when_running: list = []

        def callWhenRunning(self, f, *args):
            self.when_running.append((f, args))

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}
    service = SignalService(NotYetRunning())
    try:
        service.startService()
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None)
        assert signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)
        assert [f.__name__ for f, _ in service.reactor.when_running] == ["wrap_stops"]
    finally:
        service.stopService()
        for signum, handler in before.items():
            signal.signal(signum, handler)
