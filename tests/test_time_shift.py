"""The installed daemon with its wall clock really stepped, and a suspend played (tests/timeshift.py).

Steps back and forward, and a sleep of a day, while the daemon runs on the
simulator (``--reader sim``) and with the NVML reader over the real
nvidia-ml-py on the simulated C library (the shim, docs/simulator.md).  Each
interval is checked with atop's arithmetic: the difference of two replies'
cumulative busy sums over the difference of their sample counts, per GPU and
per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from atop_helpers import TCP_LISTEN, AtopProcess, held_atop_port, sleepers
from atop_output import process_lines
from daemon import Client, stop_process, twistd, unique_name
from timeshift import Shift, build

from atopgpud_tw import codec

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "atopgpud_tw" / "sim" / "shim"
INTERVAL = 0.25
PID = 4343
SCENARIO = {
    "gpus": [{
        "name": "NVIDIA A10", "busid": "00000000:65:00.0", "memory_total_mib": 24000, "memory_used_mib": 1000,
        "gpu_util": 40, "mem_util": 10,
        "processes": [{"pid": PID, "memory_mib": 100, "sm_util": 30, "mem_util": 5}],
    }],
}


@pytest.fixture(scope="session")
def timeshift_library(tmp_path_factory):
    built = build(tmp_path_factory.mktemp("timeshift"))
    if isinstance(built, str):
        if os.environ.get("CI") == "true":
            pytest.fail(built)
        pytest.skip(built)
    return built


class ShiftedDaemon:
    """The daemon as a child whose wall clock this test moves."""

    def __init__(self, tmp: Path, library: Path, how: str, extra: tuple[str, ...] = (),
                 spec: dict | None = None) -> None:
        self.name = unique_name("atopgpud-time")
        scenario = tmp / f"{self.name}.json"
        scenario.write_text(json.dumps(spec or SCENARIO))
        self.shift = Shift(tmp / f"{self.name}.shift")
        self.log_path = tmp / f"{self.name}.log"
        env = dict(os.environ, LD_PRELOAD=str(library), TIMESHIFT_FILE=str(self.shift.path), LD_LIBRARY_PATH="")
        options = ["--listen", f"unix:@{self.name}", "--interval", str(INTERVAL), "--idle-timeout", "30", *extra]
        self.pidfile = tmp / f"{self.name}.pid"
        if how == "nvml":  # atopgpud, the NVML reader, the real binding over the simulated library
            env.update(PYTHONPATH=str(SHIM), ATOPGPUD_SCENARIO=str(scenario))
            command = [str(Path(twistd()[0]).with_name("atopgpud")), "--reader", "nvml", *options]
        else:
            sim = ["--reader", "sim", "--scenario", str(scenario)]
            if how.startswith("twistd -n"):  # with --reactor=NAME after it, that reactor
                command = [*twistd(), *how.split()[1:], "--pidfile=", "atopgpud", *sim, *options]
            else:  # twistd daemonizes: its log to a file
                command = [*twistd(), f"--pidfile={self.pidfile}", f"--logfile={self.log_path}",
                           "atopgpud", *sim, *options]
        self.daemonized = how == "twistd"
        self._log = open(tmp / f"{self.name}.out", "wb")
        self.out_path = tmp / f"{self.name}.out"
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        self.wait_polls(4)

    @property
    def pid(self) -> int:
        if self.daemonized:
            return int(self.pidfile.read_text())
        return self.proc.pid

    def client(self) -> Client:
        return Client(b"\0" + self.name.encode())

    def stats(self) -> codec.DeviceStats:
        client = self.client()
        try:
            return client.stats()[0]
        finally:
            client.close()

    def wait_polls(self, count: int, timeout: float = 30.0) -> codec.DeviceStats:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.daemonized and self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited:\n{self.log()}")
            try:
                found = self.stats()
                if found.samples >= count:
                    return found
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"no {count} polls in time:\n{self.log()}")

    def log(self) -> str:
        text = self.out_path.read_text(errors="replace")
        if self.log_path.exists():
            text += self.log_path.read_text(errors="replace")
        return text

    def stop(self) -> None:
        if self.daemonized:
            if self.pidfile.exists():
                os.kill(self.pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while self.pidfile.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            stop_process(self.proc)
        else:
            stop_process(self.proc)
        self._log.close()


def _interval(before: codec.DeviceStats, after: codec.DeviceStats, where: str) -> None:
    """atop's arithmetic over one interval: 40 %/10 % for the GPU and 30 %/5 % for the process,
    to within one poll's worth; polls at their interval; no counter lower."""
    polls = after.samples - before.samples
    assert polls >= 1, f"{where}: no poll"
    for name in ("samples", "gpu_busy_cum", "mem_busy_cum", "memory_used_cum_kib"):
        assert getattr(after, name) >= getattr(before, name), f"{where}: {name} went down"
    assert abs((after.gpu_busy_cum - before.gpu_busy_cum) - 40 * polls) <= 40, (where, polls, before, after)
    assert abs((after.mem_busy_cum - before.mem_busy_cum) - 10 * polls) <= 10, (where, polls, before, after)
    old = {p.pid: p for p in before.processes}
    new = {p.pid: p for p in after.processes}
    assert PID in old and PID in new, (where, before, after)
    done = new[PID].samples - old[PID].samples
    assert done == polls, (where, done, polls)
    assert new[PID].gpu_busy >= old[PID].gpu_busy and new[PID].mem_busy >= old[PID].mem_busy, where
    assert abs((new[PID].gpu_busy - old[PID].gpu_busy) - 30 * done) <= 30, (where, done, old[PID], new[PID])
    assert abs((new[PID].mem_busy - old[PID].mem_busy) - 5 * done) <= 5, (where, done, old[PID], new[PID])


def _span(daemon: ShiftedDaemon, seconds: float, where: str) -> codec.DeviceStats:
    """Let `seconds` pass; the polls in it came at the interval (not stalled, not back to back)."""
    before = daemon.stats()
    time.sleep(seconds)
    after = daemon.stats()
    polls = after.samples - before.samples
    expected = seconds / INTERVAL
    assert 0.6 * expected <= polls <= expected + 2, f"{where}: {polls} polls in {seconds} s:\n{daemon.log()}"
    _interval(before, after, where)
    return after


@pytest.mark.parametrize("how", ["twistd -n", "nvml"])
def test_steps_back_and_forward_keep_polling_and_figures(tmp_path, timeshift_library, how):
    """The wall clock set back a minute, forward an hour and back a day, at moments no poll
    chose: polling goes on at its interval and every interval reads the load."""
    daemon = ShiftedDaemon(tmp_path, timeshift_library, how)
    try:
        start = daemon.stats()
        for step, pause in ((-60, 0.37), (3600, 0.61), (-86400, 0.13), (1.5, 0.29)):
            time.sleep(pause)
            before = daemon.stats()
            daemon.shift.step(step)
            after = _span(daemon, 2.0, f"{how}: stepped {step:+g} s")
            _interval(before, after, f"{how}: the interval holding the {step:+g} s step")
        _interval(start, daemon.stats(), f"{how}: the whole run")
        assert "Traceback" not in daemon.log(), daemon.log()
    finally:
        daemon.stop()


@pytest.mark.parametrize("how", ["twistd", "twistd -n --reactor=poll", "twistd -n --reactor=asyncio"])
def test_twistd_daemonized_or_on_another_reactor_polls_across_a_step_back(tmp_path, timeshift_library, how):
    """``twistd atopgpud`` (daemonized after the reactor's clock was chosen), and twistd's other
    reactors, poll on after a step back."""
    daemon = ShiftedDaemon(tmp_path, timeshift_library, how)
    try:
        daemon.shift.step(-600)
        _span(daemon, 2.0, f"{how}: stepped back 600 s")
    finally:
        daemon.stop()


@pytest.mark.parametrize("how", ["twistd -n", "nvml"])
def test_a_suspend_of_a_day(tmp_path, timeshift_library, how):
    """The host sleeps a day: after resume a poll within one interval, the next interval right
    (the time asleep neither busy nor idle), and a client idle across it still connected."""
    daemon = ShiftedDaemon(tmp_path, timeshift_library, how)
    idle = daemon.client()
    idle.stats()
    try:
        before = daemon.stats()
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)
            daemon.shift.sleep(86400)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        resumed = time.monotonic()
        first = daemon.wait_polls(before.samples + 2, timeout=10)  # the poll due while stopped, then one more
        assert time.monotonic() - resumed <= 2 * INTERVAL + 0.5, "no poll within an interval of resuming"
        after = _span(daemon, 2.0, f"{how}: after the suspend")
        _interval(before, after, f"{how}: the interval holding the suspend")
        del first
        assert idle.stats()[0].samples >= after.samples  # the idle connection was kept
    finally:
        idle.close()
        daemon.stop()


def test_atop_across_steps_of_the_daemons_wall_clock(tmp_path, timeshift_library):
    """atop itself (Debian's 2.8.1 over TCP, or a newer one with -k), every 2 s while the daemon's wall
    clock is set back 90 s and then forward a day: each interval's GPU and process figures are the load."""
    with held_atop_port("this test needs that port for atop"), sleepers(1) as (proc,):
        spec = json.loads(json.dumps(SCENARIO))
        spec["gpus"][0]["processes"][0]["pid"] = proc.pid
        daemon = ShiftedDaemon(tmp_path, timeshift_library, "twistd -n", ("--listen", TCP_LISTEN), spec)
        try:
            atop = AtopProcess(2, 6, "GPU,PRE")
            atop.read_samples(2)
            time.sleep(0.7)
            daemon.shift.step(-90)
            atop.read_samples(4)
            time.sleep(1.1)
            daemon.shift.step(86400)
            run = atop.finish()
        finally:
            daemon.stop()
    assert run.returncode == 0, str(run)
    intervals = run.samples[1:]  # the first covers the time since boot
    assert len(intervals) == 5, str(run)
    for number, sample in enumerate(intervals, start=1):
        (gpu,) = sample.gpus
        where = f"interval {number}: {gpu}"
        assert 2 / INTERVAL - 3 <= gpu.samples <= 2 / INTERVAL + 2, where  # polls at their interval
        assert abs(gpu.gpu_cum - 40 * gpu.samples) <= 40, where
        assert abs(gpu.mem_cum - 10 * gpu.samples) <= 10, where
    lines = process_lines(intervals, proc.pid)
    assert len(lines) == 5, str(run)
    for line in lines:
        assert line.samples >= 2 / INTERVAL - 3, line
        assert abs(line.gpu_busy - 30) <= 30 / line.samples + 1, line  # an interval's average, off by a poll at most
