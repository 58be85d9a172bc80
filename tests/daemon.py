"""Start the installed daemon as a child process and talk to it over a real socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from atopgpud_tw import codec


def twistd() -> list[str]:
    """The installed twistd of this interpreter."""
    found = Path(sys.executable).with_name("twistd")
    if found.exists():
        return [str(found)]
    path = shutil.which("twistd")
    assert path, "twistd is not installed"
    return [path]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> int:
    """Signal a child (SIGTERM by default), SIGKILL it if it lingers; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signum)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def unique_name(prefix: str = "atopgpud-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Client:
    """A blocking atop-like client: one connection, requests answered in order.

    Written apart from `atopgpud_tw.atopgpu.connection` on purpose: the tests read
    the wire through code that does not share the client's mistakes.
    """

    def __init__(self, address: Any, family: int = socket.AF_UNIX, timeout: float = 5.0) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(address)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {size} bytes")
            data += chunk
        return data

    def read_reply(self) -> tuple[int, bytes]:
        version, length = codec.parse_prelude(self.read_exact(4))
        return version, self.read_exact(length)

    def ask(self, command: str, version: int = 2) -> tuple[int, bytes]:
        self.send(codec.encode_request(command, version))
        return self.read_reply()

    def types(self, version: int = 2) -> list[codec.DeviceType]:
        got, body = self.ask("T", version)
        return codec.parse_types(body)

    def stats(self, version: int = 2) -> list[codec.DeviceStats]:
        got, body = self.ask("S", version)
        assert got == codec.negotiate(version)
        return codec.parse_stats(body, got)

    def close(self) -> None:
        self.sock.close()


class Daemon:
    """``twistd -n atopgpud`` on a unique abstract socket (and optional extra listeners)."""

    def __init__(self, tmp: Path, args: Sequence[str] = (), scenario: Any = None) -> None:
        self.name = unique_name()
        self.args = list(args)
        if scenario is not None:
            path = tmp / f"{self.name}.json"
            path.write_text(json.dumps(scenario))
            self.args += ["--reader", "sim", "--scenario", str(path)]
        self.log_path = tmp / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> Daemon:
        command = [
            *twistd(), "-n", "--pidfile=", "atopgpud",
            "--listen", f"unix:@{self.name}", *self.args,
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                client = self.client()
                try:
                    client.ask("T")  # answered only once the reactor runs
                finally:
                    client.close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"daemon not ready:\n{self.log()}")

    def client(self) -> Client:
        return Client(b"\0" + self.name.encode())

    def wait_samples(self, count: int, timeout: float = 30.0) -> list[codec.DeviceStats]:
        """Poll S (on a fresh connection) until the first GPU has `count` samples."""
        deadline = time.monotonic() + timeout
        client = self.client()
        try:
            while time.monotonic() < deadline:
                stats = client.stats()
                if stats and stats[0].samples >= count:
                    return stats
                time.sleep(0.02)
        finally:
            client.close()
        raise AssertionError(f"no {count} samples in time:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, signum: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        status = stop_process(self.proc, signum)
        self._log.close()
        return status


@contextmanager
def run_daemon(tmp: Path, args: Sequence[str] = (), scenario: Any = None) -> Iterator[Daemon]:
    """A started daemon, stopped (SIGTERM, then SIGKILL) when the block ends, however it ends."""
    daemon = Daemon(tmp, args, scenario).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def env_without_gpu() -> dict[str, str]:
    """The environment for a child that must not find a real NVML library."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ""
    return env


def smi_stand_in(tmp_path: Path, report: Path, listing: Path | None = None) -> Path:
    """An executable nvidia-smi printing `report` (and `listing` for -L): the one
    stand-in of tests/smi_doubles.py in report mode."""
    from smi_doubles import FakeSmi

    smi = FakeSmi(tmp_path)
    smi.report(report.name, report.read_bytes())
    if listing is not None:
        shutil.copy(listing, smi.state / "list.txt")
    return smi.binary


def first_reply(daemon: Daemon) -> tuple[bytes, list[codec.DeviceStats]]:
    """T and S once the first poll is in."""
    daemon.wait_samples(1)
    client = daemon.client()
    try:
        return client.ask("T")[1], client.stats()
    finally:
        client.close()
