"""An endpoint that cannot listen ends the installed daemon: one line, exit status 1, nothing left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from daemon import Client, free_port, twistd, unique_name

COMMANDS = {
    "atopgpud": lambda tmp: [str(Path(twistd()[0]).with_name("atopgpud"))],
    "twistd -n": lambda tmp: [*twistd(), "-n", "--pidfile=", "atopgpud"],
    "twistd": lambda tmp: [*twistd(), f"--pidfile={tmp / 'twistd.pid'}", f"--logfile={tmp / 'twistd.log'}", "atopgpud"],
}


def run(command: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command, "--reader", "sim", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def assert_one_line(result: subprocess.CompletedProcess[str], endpoint: str, cause: str, tmp: Path) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = [line for line in result.stderr.splitlines() if line.startswith("atopgpud: ")]
    assert lines == [f"atopgpud: cannot listen on {endpoint}: {cause}"], output
    assert "Traceback" not in output
    assert not list(tmp.glob("**/*.lock")) and not list(tmp.glob("*.pid"))


@pytest.fixture
def taken_abstract() -> Iterator[str]:
    name = unique_name()
    with socket.socket(socket.AF_UNIX) as holder:
        holder.bind(b"\0" + name.encode())
        holder.listen()
        yield name


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_taken_abstract_name(tmp_path, taken_abstract, how):
    """A second daemon on a taken abstract name says so and exits 1."""
    endpoint = f"unix:@{taken_abstract}"
    result = run(COMMANDS[how](tmp_path), "--listen", endpoint)
    assert_one_line(result, endpoint, "address already in use", tmp_path)


@pytest.mark.parametrize("how", ["atopgpud", "twistd -n"])
def test_taken_tcp_port(tmp_path, taken_port, how):
    """A TCP port another process listens on: one line, exit 1."""
    endpoint = f"tcp:{taken_port}:interface=127.0.0.1"
    result = run(COMMANDS[how](tmp_path), "--listen", endpoint)
    assert_one_line(result, endpoint, "address already in use", tmp_path)


@pytest.mark.parametrize("how", ["atopgpud", "twistd -n"])
def test_unusable_socket_path(tmp_path, how):
    """A filesystem socket in a directory that does not exist: one line, exit 1, no lock file."""
    endpoint = f"unix:{tmp_path}/nonexistent/dir/sock"
    result = run(COMMANDS[how](tmp_path), "--listen", endpoint)
    assert_one_line(result, endpoint, "no such file or directory", tmp_path)


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_taken_metrics_endpoint(tmp_path, taken_port, how):
    """--metrics on a taken port ends start-up; the --listen socket opened first is removed."""
    endpoint = f"tcp:{taken_port}:interface=127.0.0.1"
    sock = tmp_path / "ok.sock"
    result = run(COMMANDS[how](tmp_path), "--listen", f"unix:{sock}", "--metrics", endpoint)
    assert_one_line(result, f"{endpoint} (--metrics)", "address already in use", tmp_path)
    assert not sock.exists()


def test_lock_held_by_a_running_daemon(tmp_path):
    """A filesystem socket whose lock another daemon holds: that daemon's lock is left alone."""
    sock = tmp_path / "held.sock"
    first = subprocess.Popen([*COMMANDS["twistd -n"](tmp_path), "--reader", "sim", "--listen", f"unix:{sock}",
                              "--listen", f"tcp:{free_port()}:interface=127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if sock.exists():
                break
            subprocess.run(["sleep", "0.1"])
        result = run(COMMANDS["atopgpud"](tmp_path), "--listen", f"unix:{sock}")
        assert result.returncode == 1
        assert result.stderr == f"atopgpud: cannot listen on unix:{sock}: another process holds {sock}.lock\n"
        assert Path(f"{sock}.lock").is_symlink() and sock.exists()
    finally:
        first.terminate()
        first.wait(10)
    assert not sock.exists() and not Path(f"{sock}.lock").exists()


def test_daemonized_twistd_serves_and_leaves_nothing(tmp_path):
    """Listened on before twistd forks, the socket is served by the daemon, whose lock it is, and removed at stop."""
    sock = tmp_path / "d.sock"
    pidfile = tmp_path / "twistd.pid"
    result = run(COMMANDS["twistd"](tmp_path), "--listen", f"unix:{sock}")
    assert result.returncode == 0, result.stderr
    pid = int(pidfile.read_text())
    try:
        assert os.readlink(f"{sock}.lock") == str(pid)
        client = Client(str(sock))
        assert client.ask("T")[0] == 2
        client.close()
    finally:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pidfile.exists() and not sock.exists() and not Path(f"{sock}.lock").exists()
