"""Run the real atop against the installed daemon on TCP 127.0.0.1:59123.

atop 2.4 to 2.12 connects to that fixed port (API version 1), so only one daemon
at a time can serve it: `port_lock` serialises every test that listens there,
across pytest processes too, and `held_atop_port` holds it for one test or
skips.  `run_atop` and `AtopProcess` run ``atop [-k] -P GPU,PRE``; `atop_output`
parses what it prints.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

import pytest
from atop_output import AtopRun
from daemon import Client, stop_process
from locks import file_lock

ATOP_PORT = 59123
ATOP_HOST = "127.0.0.1"
TCP_LISTEN = f"tcp:{ATOP_PORT}:interface={ATOP_HOST}"
#: every test that listens on the atop port takes this lock first
LOCK_PATH = Path("/tmp/atopgpud-tests-tcp-59123.lock")


# -- atop itself ------------------------------------------------------------------


def atop_path() -> str | None:
    """The installed atop, or None."""
    return shutil.which("atop")


@functools.cache
def atop_version(atop: str) -> tuple[int, ...]:
    """atop's version as numbers, from ``atop -V`` (``Version: 2.8.1 - ...``)."""
    out = subprocess.run([atop, "-V"], capture_output=True, text=True, timeout=10)
    match = re.search(r"Version:\s*(\d+(?:\.\d+)+)", out.stdout + out.stderr)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


@functools.cache
def atop_needs_k(atop: str) -> bool:
    """Whether this atop talks to atopgpud only when given ``-k``.

    Upstream added ``-k`` in 2.11.1; Debian back-ported it to 2.8.1-1+deb12u1.
    Older builds connect by themselves and reject the flag, so ask ``-h``.
    """
    out = subprocess.run([atop, "-h"], capture_output=True, text=True, timeout=10)
    return re.search(r"^\s*-k\s.*atopgpud", out.stdout + out.stderr, re.MULTILINE) is not None


def skip_reason() -> str | None:
    """Why the atop tests cannot run here, or None."""
    atop = atop_path()
    if atop is None:
        return "atop is not installed (Debian: apt-get install atop)"
    version = atop_version(atop)
    if version and version >= (2, 13):
        return f"atop {'.'.join(map(str, version))} talks API 2 over an abstract socket; these tests are for TCP/API 1"
    return None


# -- the fixed port ------------------------------------------------------------------


def port_lock(timeout: float = 300.0) -> Any:
    """Hold the lock of the atop port; waits for other tests that hold it."""
    return file_lock(LOCK_PATH, timeout)


@contextmanager
def held_atop_port(why: str = "these tests need that port for atop") -> Iterator[None]:
    """The atop port, held while the block runs; skips where atop cannot run here or, saying `why`, where
    something else holds the port."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with port_lock():
        taken = port_taken()
        if taken:
            pytest.skip(f"{taken}; {why}")
        yield


def port_taken() -> str | None:
    """Who holds TCP 127.0.0.1:59123, in words, or None when a daemon may listen there."""
    try:
        with socket.create_connection((ATOP_HOST, ATOP_PORT), timeout=1.0):
            return f"something already answers on TCP {ATOP_HOST}:{ATOP_PORT}"
    except OSError:
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # as Twisted does, so that a port in TIME_WAIT counts as free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((ATOP_HOST, ATOP_PORT))
    except OSError as error:
        return f"TCP {ATOP_HOST}:{ATOP_PORT} cannot be bound: {error.strerror}"
    finally:
        probe.close()
    return None


def port_answers() -> bool:
    """Whether something accepts connections on the atop port."""
    return answers((ATOP_HOST, ATOP_PORT), socket.AF_INET)


def answers(address: Any, family: int) -> bool:
    """Whether something accepts connections at `address` (TCP, or a UNIX socket)."""
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(address)
        return True
    except OSError:
        return False
    finally:
        probe.close()


# -- the daemon -----------------------------------------------------------------------


def daemon_command() -> list[str]:
    """The installed ``atopgpud`` console script of this interpreter."""
    found = Path(sys.executable).with_name("atopgpud")
    if found.exists():
        return [str(found)]
    return [sys.executable, "-m", "atopgpud_tw"]


def write_scenario(path: Path, gpus: Sequence[dict[str, Any]], **top: Any) -> Path:
    """A simulator scenario file with these GPUs."""
    path.write_text(json.dumps({"gpus": list(gpus), **top}, indent=1))
    return path


class TcpDaemon:
    """``atopgpud --reader sim`` listening where old atop looks: TCP 127.0.0.1:59123.

    Or elsewhere: `listen` the daemon's ``--listen``, `address` and `family`
    where a client reaches it (the abstract socket atop 2.13 looks for).
    """

    def __init__(
        self, scenario: Path, log_path: Path, interval: float = 0.25,
        listen: str = TCP_LISTEN, address: Any = (ATOP_HOST, ATOP_PORT), family: int = socket.AF_INET,
    ) -> None:
        self.command = [
            *daemon_command(), "--reader", "sim", "--scenario", str(scenario),
            "--listen", listen, "--interval", str(interval),
        ]
        self.address, self.family = address, family
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 30.0) -> TcpDaemon:
        """Start it and return once the port answers."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while not answers(self.address, self.family):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not listen within {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        # and once its first poll is counted: an atop that asks before sees no figures yet
        while not self._polled():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not poll within {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def _polled(self) -> bool:
        client = Client(self.address, self.family)
        try:
            return all(device.samples for device in client.stats(2))
        finally:
            client.close()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it lingers; the exit status."""
        if self.proc is None:
            return None
        status = stop_process(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None
        return status

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def sleepers(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real processes (``sleep 60``) whose pids a scenario can put on a GPU."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def unused_pids(count: int) -> list[int]:
    """Pids above the kernel's pid_max: no process can have them."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return [pid_max + 1 + n for n in range(count)]


def atop_command(interval: int, count: int, labels: str = "GPU,PRE", atop: str | None = None) -> list[str]:
    """``atop [-k] -P labels interval count``; `atop` the binary (default: the installed one)."""
    atop = atop or atop_path()
    assert atop is not None
    flags = ["-k"] if atop_needs_k(atop) else []
    return [atop, *flags, "-P", labels, str(interval), str(count)]


def run_atop(interval: int, count: int, labels: str = "GPU,PRE", atop: str | None = None) -> AtopRun:
    """Run atop (`atop`, default the installed one) to the end and keep what it printed."""
    done = subprocess.run(
        atop_command(interval, count, labels, atop),
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=interval * count + 30,
    )
    return AtopRun(done.stdout, done.stderr, done.returncode)


class AtopProcess:
    """atop running in the background; a thread takes its lines as it prints each sample."""

    def __init__(self, interval: int, count: int, labels: str = "GPU,PRE") -> None:
        self.timeout = interval * count + 30
        self.proc = subprocess.Popen(
            atop_command(interval, count, labels),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        self.lines: list[str] = []
        #: `time.monotonic()` when each sample's SEP line arrived (atop flushes each sample)
        self.sample_times: list[float] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                if line.startswith("SEP"):
                    self.sample_times.append(time.monotonic())
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def read_samples(self, count: int) -> None:
        """Wait until `count` samples in all have been printed."""
        with self._changed:
            done = self._changed.wait_for(
                lambda: len(self.sample_times) >= count or self._ended, timeout=self.timeout
            )
            if not done or len(self.sample_times) < count:
                raise AssertionError(f"atop printed no {count} samples:\n{''.join(self.lines)}")

    def finish(self) -> AtopRun:
        """Wait for atop to end; everything it printed."""
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.wait(self.timeout)
        self._reader.join(self.timeout)
        return AtopRun("".join(self.lines), err, self.proc.returncode)

    def kill(self) -> None:
        """Stop it if it still runs (after a failure)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
