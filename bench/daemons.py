"""Start, watch and stop the daemons bench/perf.py compares: ours and the reference.

Both run on the simulator, from the same scenario file.  Ours is ``atopgpud
--reader sim`` (or ``twistd -n atopgpud``) on a unique abstract socket.  The reference is atop's
Python ``atopgpud`` on nvidia-ml-py's real ``pynvml`` over the simulated
libnvidia-ml (``atopgpud_tw/sim/shim`` first on PYTHONPATH); it always listens on the abstract
socket ``atopgpud_nvidia``, so it is started only when nothing else answers there.
Figures of a running daemon come from /proc: CPU seconds (utime + stime of all
its threads, and the finer schedstat sum of its live threads), RSS now and its
peak (VmHWM), open descriptors.  Both run with ``bench/simtime`` first on
PYTHONPATH, whose ``sitecustomize`` times the simulated library's C functions
into a small file (the simulator's share of each NVML call, which a real
driver would replace); `Floor` is a bare LoopingCall with a thread hand-off
(bench/floor.py), the reactor's fixed cost per poll, measured beside them.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "atopgpud_tw" / "sim" / "shim"
SIMTIME = REPO / "bench" / "simtime"
FLOOR = REPO / "bench" / "floor.py"
REFERENCE_ADDRESS = b"\0atopgpud_nvidia"
_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why."""


def ask(address: bytes, request: bytes, timeout: float = 5.0, sock: socket.socket | None = None) -> bytes:
    """One request, on `sock` or a fresh connection; the reply body."""
    if sock is None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fresh:
            fresh.settimeout(timeout)
            fresh.connect(address)
            return ask(address, request, timeout, fresh)
    sock.sendall(request)
    data = b""
    while len(data) < 4 or len(data) < 4 + (int.from_bytes(data[:4], "big") & 0xFFFFFF):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the whole reply")
        data += chunk
    return data[4:]


def samples(address: bytes, sock: socket.socket | None = None) -> int:
    """The first GPU's sample count (polls so far) from an ``S`` reply."""
    body = ask(address, b"S\x02", sock=sock)
    return int(body.split(b"@")[1].split(b"#")[0].split()[4])


def idle_cpu_per_poll(daemon: Daemon, seconds: float, floor: Floor | None = None) -> dict[str, float]:
    """CPU seconds per poll of a daemon that serves no client for `seconds`, and its parts.

    ``cpu``: all its threads (schedstat); ``sim``: of that, the simulated
    library's C functions (bench/simtime); ``sim_calls``: those calls per poll;
    ``floor``: a `Floor` measured over the same window (CPU per tick), if given.
    The polls are counted by two ``S`` requests on one connection kept open
    around the window, whose own work falls outside it: the reference serves a
    connection in a thread of its own, and the CPU time of a thread that has
    ended can no longer be read.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(daemon.address)
        first = samples(daemon.address, sock)
        sim_before, floor_before = daemon.simulator_time(), floor.figures() if floor else (0.0, 0)
        before = threads_cpu(daemon.pid)
        time.sleep(seconds)
        after = threads_cpu(daemon.pid)
        sim_after, floor_after = daemon.simulator_time(), floor.figures() if floor else (0.0, 0)
        polls = max(1, samples(daemon.address, sock) - first)
    ticks = floor_after[1] - floor_before[1]
    return {
        "cpu": (after - before) / polls,
        "sim": (sim_after[0] - sim_before[0]) / polls,
        "sim_calls": (sim_after[1] - sim_before[1]) / polls,
        "floor": (floor_after[0] - floor_before[0]) / ticks if ticks else float("nan"),
    }


def _counters(path: Path, fmt: str) -> tuple[int, ...]:
    """The integers a benchmark helper keeps in a mapped file (zeros until it has written them)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return struct.unpack_from(fmt, view)
    except (OSError, ValueError, struct.error):
        return (0,) * len(struct.unpack(fmt, bytes(struct.calcsize(fmt))))


class Floor:
    """bench/floor.py running: a LoopingCall ticking once a second with a worker-thread hand-off."""

    def __init__(self, workdir: Path) -> None:
        self.counter = workdir / f"floor-{uuid.uuid4().hex[:8]}.count"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(FLOOR), str(self.counter)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while _counters(self.counter, "=Q")[0] < 2:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise BenchError("bench/floor.py did not tick")
            time.sleep(0.1)

    def figures(self) -> tuple[float, int]:
        """CPU seconds of its threads, and its ticks so far."""
        assert self.proc is not None
        return threads_cpu(self.proc.pid), _counters(self.counter, "=Q")[0]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def answers(address: bytes) -> bool:
    """Whether anything accepts connections on an abstract socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
        except OSError:
            return False
        return True


def proc_figures(pid: int) -> dict[str, float]:
    """CPU seconds, RSS and peak RSS (KiB) and open descriptors of a process."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    figures = {"cpu": (int(fields[11]) + int(fields[12])) / _TICKS}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0])
    figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    figures["thread_cpu"] = threads_cpu(pid)
    return figures


def threads_cpu(pid: int) -> float:
    """CPU seconds of the threads alive now, in nanosecond resolution (schedstat).

    Finer than utime + stime (clock ticks), which a poll of a few milliseconds
    hardly moves; threads that have ended are not counted.
    """
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return total / 1e9


class Daemon:
    """A daemon child process on the simulator; `label` names it in reports."""

    label = "daemon"
    address: bytes
    #: whether its simulated library's C functions are timed (bench/simtime: a wrapper around every call)
    timed = True

    def __init__(self, scenario: Path, workdir: Path) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{self.label}-{uuid.uuid4().hex[:8]}.log"
        self.simtime_path = workdir / f"{self.label}-{uuid.uuid4().hex[:8]}.simtime"

    def simulator_time(self) -> tuple[float, int]:
        """CPU seconds its threads spent in the simulated library's C functions, and the calls."""
        nanoseconds, calls = _counters(self.simtime_path, "=QQ")
        return nanoseconds / 1e9, calls

    def _timed(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the simulated library timed (bench/simtime first on PYTHONPATH)."""
        if not self.timed:
            return env
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SIMTIME), env.get("PYTHONPATH")]))
        env["ATOPGPUD_BENCH_SIMTIME"] = str(self.simtime_path)
        return env

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self, min_samples: int = 2, timeout: float = 60.0) -> None:
        """Start it and wait until it has polled `min_samples` times."""
        command, env = self.command()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.label} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if samples(self.address) >= min_samples:
                    return
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise BenchError(f"{self.label} did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def figures(self) -> dict[str, float]:
        return proc_figures(self.pid)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Ours(Daemon):
    """``atopgpud --reader sim`` (the command the shipped unit runs), or ``twistd -n
    atopgpud --reader sim`` with `twistd`, on a unique abstract socket.

    `source` is a copy of the source tree put first on PYTHONPATH (an older
    version, to compare before and after); `label` names the run in reports.
    """

    label = "ours"

    def __init__(self, scenario: Path, workdir: Path, source: str | None = None, options: tuple[str, ...] = (),
                 twistd: bool = False, label: str | None = None) -> None:
        if label:
            self.label = label
        super().__init__(scenario, workdir)
        self.options = options
        self.name = f"atopgpud-bench-{uuid.uuid4().hex[:12]}"
        self.address = b"\0" + self.name.encode()
        self.source = source
        self.twistd = twistd

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        if self.source:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.source, env.get("PYTHONPATH")]))
        if self.twistd:
            start = [str(Path(sys.executable).with_name("twistd")), "-n", "--pidfile=", "atopgpud"]
        else:
            # the console script imports atopgpud_tw.__main__ from PYTHONPATH first, as twistd does the plugin
            start = [str(Path(sys.executable).with_name("atopgpud"))]
        return [
            *start, "--reader", "sim", "--scenario", str(self.scenario), "--listen", f"unix:@{self.name}",
            *self.options,
        ], self._timed(env)


class Reference(Daemon):
    """atop's ``atopgpud`` (Python) in the foreground, its ``pynvml`` over the simulated library."""

    label = "reference"
    address = REFERENCE_ADDRESS

    def __init__(self, scenario: Path, workdir: Path, script: Path, wait: float = 0.0) -> None:
        super().__init__(scenario, workdir)
        self.script = script
        #: seconds to wait for the abstract socket to be free (another benchmark's reference)
        self.wait = wait

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(REPO)])
        env["ATOPGPUD_SCENARIO"] = str(self.scenario)
        # -s as its "#!" line asks, but not -E: the simulator comes in through PYTHONPATH
        return [sys.executable, "-s", str(self.script), "-f"], self._timed(env)

    def start(self, min_samples: int = 2, timeout: float = 60.0) -> None:
        free_by = time.monotonic() + self.wait
        while answers(REFERENCE_ADDRESS) and time.monotonic() < free_by:
            time.sleep(0.5)
        if answers(REFERENCE_ADDRESS):
            raise BenchError(
                "something already listens on the abstract socket @atopgpud_nvidia (an atopgpud?); "
                "the reference daemon can only listen there: stop it and run the benchmark again"
            )
        super().start(min_samples, timeout)


def reference_script(path: Path, workdir: Path) -> Path:
    """The reference daemon as a runnable script: whatever precedes its ``#!`` line is dropped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise BenchError(f"--reference {path}: {error.strerror or error}") from None
    start = text.find("#!")
    if start < 0 or "gpuformatter" not in text:
        raise BenchError(f"--reference {path}: not atop's Python atopgpud (no '#!' line or no formatters)")
    script = workdir / "reference_atopgpud.py"
    script.write_text(text[start:], encoding="utf-8")
    return script


def workdir() -> Path:
    """A fresh folder for scenario files, logs and the reference script."""
    return Path(tempfile.mkdtemp(prefix="atopgpud-bench-"))
