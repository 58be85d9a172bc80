"""The installed daemon reading GPUs through nvidia-smi, over real sockets.

nvidia-smi is the stand-in tests/fake_nvidia_smi.py, run through a small shell
wrapper so that it is executable by path, as ``--nvidia-smi`` wants it.
Expected figures are read off tests/fixtures/smi/plain-v11.xml by hand.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from daemon import Client, Daemon, env_without_gpu, run_daemon, twistd, unique_name
from smi_doubles import FIXTURES, FakeSmi

from atopgpud_tw import codec

#: what the poller logs, once, for a run that outlived --smi-timeout 0.5
KILLED = "-q -x did not finish within 0.5 s; killed"
NOT_XML = "-q -x: the output is not XML"
#: what a poll says when the killed child has not been reaped yet
NOT_ENDED = "has not ended yet"
#: the T reply for plain-v11.xml: bus ids, product names with "_" for spaces
PLAIN_TYPES = b"2@00000000:17:00.0 NVIDIA_Test_Board_A 3@00000000:65:00.0 NVIDIA_Test_Board_B 3"
MIB = 1024


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeSmi]:
    smi = FakeSmi(tmp_path)
    smi.report("plain-v11.xml")
    yield smi
    smi.reap_leftover()


def smi_args(fake: FakeSmi, reader: str = "nvidia-smi") -> list[str]:
    return [
        "--reader", reader, "--nvidia-smi", str(fake.binary),
        "--interval", "0.2", "--smi-timeout", "0.5",
    ]


@pytest.fixture
def daemon(tmp_path: Path, fake: FakeSmi) -> Iterator[Daemon]:
    with run_daemon(tmp_path, smi_args(fake)) as daemon:
        yield daemon


def wait_until(condition: Callable[[], bool], what: str, daemon: Daemon, timeout: float = 15.0) -> None:
    """Poll `condition` until it holds; fail with the daemon's log after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s\n{daemon.log()}")
        time.sleep(0.05)


def failure_lines(daemon: Daemon, text: str) -> int:
    """How many times a poll failure with `text` in it was logged (the recovery line names it too)."""
    return sum(1 for line in daemon.log().splitlines() if "poll failed:" in line and text in line)


class Watcher:
    """Asks T and S on one connection and keeps every S reply, to check monotonicity."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.history: list[list[codec.DeviceStats]] = []

    def samples(self) -> int:
        """The first GPU's sample count; 0 before the first poll is in."""
        # the client's 5 s socket timeout is the only bound: a reply must come at all.
        # S first: a device listed in S is in every later T (devices are never dropped)
        stats = self.client.stats()
        types = self.client.types()
        if not stats:
            return 0
        assert len(types) == len(stats) == 2
        self.history.append(stats)
        return stats[0].samples

    def unchanged(self, frozen: int) -> bool:
        """Ask again and insist that no sample was counted since `frozen`."""
        assert self.samples() == frozen, "a sample was counted while every run fails"
        return True

    def assert_monotonic(self) -> None:
        for before, after in zip(self.history, self.history[1:]):
            for old, new in zip(before, after):
                for field in ("samples", "gpu_busy_cum", "mem_busy_cum", "memory_used_cum_kib"):
                    assert getattr(new, field) >= getattr(old, field), field
                old_procs = {p.pid: p for p in old.processes if p.state == "A"}
                for proc in new.processes:
                    if proc.pid in old_procs:
                        assert proc.samples >= old_procs[proc.pid].samples
                        assert proc.memory_cum_kib >= old_procs[proc.pid].memory_cum_kib


def nvml_library_present() -> bool:
    """Whether a child with an empty LD_LIBRARY_PATH would still find libnvidia-ml (a GPU host)."""
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    return subprocess.run([sys.executable, "-c", probe], env=env_without_gpu(), capture_output=True).returncode == 0


def test_serves_the_report_values(daemon: Daemon) -> None:
    """T and S carry the report's bus ids, names, memory in KiB, busy figures and processes."""
    # T lists no device until the first poll is folded in (the socket listens before that)
    daemon.wait_samples(1)
    client = daemon.client()
    try:
        for version in (1, 2):
            got, body = client.ask("T", version)
            assert (got, body) == (version, PLAIN_TYPES)
    finally:
        client.close()
    a, b = daemon.wait_samples(2)
    n = a.samples
    # 12.6 % rounds to 13; 150 % is clamped to 100
    assert (a.gpu_busy_now, a.mem_busy_now, a.gpu_busy_cum, a.mem_busy_cum) == (13, 100, 13 * n, 100 * n)
    assert (a.memory_total_kib, a.memory_used_kib) == (16384 * MIB, 1000 * MIB)
    assert a.memory_used_cum_kib == 1000 * MIB * n
    processes = {p.pid: (p.state, p.kind, p.gpu_busy, p.mem_busy, p.memory_now_kib, p.memory_cum_kib, p.samples)
                 for p in a.processes}
    assert processes == {
        # listed as C (500 MiB) and G (300 MiB): one C+G process, sent as C, with the larger memory
        100: ("A", "C", -1, -1, 500 * MIB, 500 * MIB * n, n),
        200: ("A", "G", -1, -1, 0, 0, n),
        # an MPS client (M+C) counts as compute
        300: ("A", "C", -1, -1, 64 * MIB, 64 * MIB * n, n),
    }
    assert (b.gpu_busy_now, b.mem_busy_now, b.memory_total_kib, b.memory_used_kib) == (0, 0, 8192 * MIB, 5 * MIB)
    assert (b.samples, b.gpu_busy_cum, b.mem_busy_cum, b.memory_used_cum_kib) == (n, 0, 0, 5 * MIB * n)
    assert b.processes == ()


def test_hung_nvidia_smi_is_killed_and_polling_recovers(daemon: Daemon, fake: FakeSmi) -> None:
    """A hanging run is killed (logged once); replies keep coming; samples freeze, then grow again."""
    watcher = Watcher(daemon.client())
    try:
        wait_until(lambda: watcher.samples() >= 2, "two samples", daemon)
        fake.mode("hang")
        wait_until(lambda: watcher.samples() >= 0 and KILLED in daemon.log(), "a killed run", daemon)
        # every run from here on hangs: the killed one started after the switch
        frozen = watcher.samples()
        calls = len(fake.calls())
        wait_until(lambda: watcher.unchanged(frozen) and len(fake.calls()) >= calls + 2, "two more hung runs", daemon)

        fake.mode("report")
        wait_until(lambda: watcher.samples() > frozen, "samples growing again", daemon)
        wait_until(lambda: "polls work again" in daemon.log(), "a recovery line", daemon)
        watcher.assert_monotonic()
        # a new run starts only once the previous child was reaped: the last hung one is gone
        pid = fake.hung_pid()
        assert pid is not None and not Path(f"/proc/{pid}").exists()
    finally:
        watcher.client.close()
    # a poll while the killed child is still being reaped fails with the kill's own words
    assert failure_lines(daemon, KILLED) == 1 and not failure_lines(daemon, NOT_ENDED), daemon.log()


def test_garbage_output_fails_polls_with_one_log_line(daemon: Daemon, fake: FakeSmi) -> None:
    """Output that is no report: replies keep coming, samples stop, the cause is logged once."""
    watcher = Watcher(daemon.client())
    try:
        wait_until(lambda: watcher.samples() >= 2, "two samples", daemon)
        fake.mode("garbage")
        wait_until(lambda: watcher.samples() >= 0 and NOT_XML in daemon.log(), "a garbage report", daemon)
        # every run from here on prints garbage: the failed one started after the switch
        frozen = watcher.samples()
        calls = len(fake.calls())
        wait_until(lambda: watcher.unchanged(frozen) and len(fake.calls()) >= calls + 3, "three more runs", daemon)
        assert failure_lines(daemon, NOT_XML) == 1, daemon.log()
        watcher.assert_monotonic()
    finally:
        watcher.client.close()


def test_auto_falls_back_to_nvidia_smi(tmp_path: Path, fake: FakeSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    """--reader auto without an NVML library serves the report through nvidia-smi and says so."""
    if nvml_library_present():
        pytest.skip("an NVML library is installed here: auto would pick nvml")
    # the daemon inherits this environment
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    with run_daemon(tmp_path, smi_args(fake, reader="auto")) as daemon:
        a, _ = daemon.wait_samples(2)
        client = daemon.client()
        try:
            assert client.ask("T") == (2, PLAIN_TYPES)
        finally:
            client.close()
        assert (a.memory_total_kib, a.memory_used_kib) == (16384 * MIB, 1000 * MIB)
        assert "reading GPUs through nvidia-smi" in daemon.log()


def test_auto_without_nvml_or_nvidia_smi_exits_with_one_line(tmp_path: Path) -> None:
    """--reader auto with neither reader usable: status 1, one stderr line naming both causes."""
    if nvml_library_present():
        pytest.skip("an NVML library is installed here: auto would pick nvml")
    command = [
        *twistd(), "-n", "--pidfile=", "atopgpud", "--listen", f"unix:@{unique_name()}",
        "--reader", "auto", "--nvidia-smi", "/nonexistent",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, env=env_without_gpu(), capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=60,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert "nvml:" in line and "NVML library" in line
    assert "nvidia-smi:" in line and "/nonexistent" in line
    assert "Traceback" not in done.stdout + done.stderr


def test_a_ten_kilobyte_product_name_keeps_t_within_atops_limit(tmp_path: Path, fake: FakeSmi) -> None:
    """A report naming its GPU in 10 KB: T is within 8192 bytes, with the name's last 64 characters."""
    plain = (FIXTURES / "plain-v11.xml").read_text()
    huge = "X" * 10_000 + " Board A"
    (fake.state / "report.xml").write_text(plain.replace("NVIDIA Test Board A", huge, 1))
    with run_daemon(tmp_path, smi_args(fake)) as running:
        running.wait_samples(1)
        client = running.client()
        try:
            version, body = client.ask("T", 2)
        finally:
            client.close()
    assert 4 + len(body) <= codec.ATOP_REPLY_LIMIT
    assert codec.parse_types(body)[0].name == codec.wire_token(huge).decode()
    assert codec.wire_token(huge).endswith(b"XXX_Board_A") and len(codec.wire_token(huge)) == 64


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(word) for word in (task / "children").read_text().split())
        except OSError:
            pass
    return found


@pytest.mark.parametrize("mode", ["leave", "escape"])
def test_what_a_run_leaves_behind_dies_with_it(tmp_path: Path, fake: FakeSmi, mode: str) -> None:
    """A child of nvidia-smi that ignores SIGTERM and lets go of the pipes, in the run's group
    or in a session of its own (with a child of its own there), is killed and reaped when the
    run ends, at start-up too, and none outlives the daemon."""
    fake.mode(mode)
    daemon = Daemon(tmp_path, smi_args(fake))
    try:
        daemon.start()
        assert daemon.proc is not None
        daemon.wait_samples(4)
        left = fake.leftovers()
        # open's trial run and at least three polls, each leaving one (two when escaping)
        assert len(left) >= (2 if mode == "escape" else 1) * 4
        wait_until(lambda: not any(map(_running, left)), "every leftover killed", daemon, timeout=5)
        # and reaped: no zombie of the daemon's own piles up
        wait_until(lambda: not (_children(daemon.proc.pid) & set(left)), "leftovers reaped", daemon, timeout=5)
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()
        try:
            wait_until(
                lambda: not any(map(_running, fake.leftovers())), "no leftover outlives the daemon", daemon, timeout=5
            )
        finally:
            fake.reap_leftovers()


def test_what_a_hung_run_started_in_a_session_of_its_own_dies_at_shutdown(tmp_path: Path, fake: FakeSmi) -> None:
    """A run cut short by the daemon's stop takes its setsid'd grandchildren with it."""
    daemon = Daemon(tmp_path, [*smi_args(fake)[:-2], "--smi-timeout", "30"])
    try:
        daemon.start()
        daemon.wait_samples(1)
        fake.mode("escape-hang")
        wait_until(
            lambda: len(fake.leftovers()) >= 2 and fake.hung_pid() is not None,
            "a hung run with an escaped grandchild",
            daemon,
        )
    finally:
        daemon.stop()
        try:
            wait_until(lambda: not any(map(_running, fake.leftovers())), "no leftover outlives it", daemon, timeout=5)
            assert fake.hung_pid() is not None and not _running(fake.hung_pid())
        finally:
            fake.reap_leftovers()
