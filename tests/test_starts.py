"""Process start times kept per process (readers/starts.py): read once while a
process lives, read again once it has exited, and read at every poll where
the kernel gives no pidfd."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from atopgpud_tw.readers import starts as starts_module
from atopgpud_tw.readers.starts import NO_PIDFDS, ProcStarts, proc_start_time

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids whose stat is read."""
    done: list[int] = []
    real = proc_start_time

    def counted(pid: int, proc: str = "/proc") -> int | None:
        done.append(pid)
        return real(pid, proc)

    monkeypatch.setattr(starts_module, "proc_start_time", counted)
    return done


def _stat(root: Path, pid: int, started: int) -> None:
    (root / str(pid)).mkdir(exist_ok=True)
    fields = " ".join(str(n) for n in range(4, 22))
    (root / str(pid) / "stat").write_bytes(f"{pid} (sleep x) S {fields} {started} 0 0\n".encode())


def _is_pidfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    except OSError:
        return False


@pytest.mark.e2e
def test_a_start_time_is_read_once_while_its_process_lives(sleeper: subprocess.Popen, reads: list[int]) -> None:
    tracker = ProcStarts()
    expected = proc_start_time(sleeper.pid)
    for _ in range(5):
        assert list(tracker.of([sleeper.pid, sleeper.pid])) == [expected, expected]
        tracker.sweep()
    assert reads == [sleeper.pid] and tracker.watched == 1
    tracker.close()
    assert tracker.watched == 0


@pytest.mark.e2e
def test_a_process_that_exits_has_the_start_time_of_its_pid_read_again(tmp_path: Path, reads: list[int]) -> None:
    """A pid whose watched process exited and that is listed again (reused: a new stat
    in a /proc of the test's making) is read again."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _stat(tmp_path, child.pid, 100)
    tracker = ProcStarts(str(tmp_path))
    try:
        assert list(tracker.of([child.pid])) == [100]
        tracker.sweep()
        _stat(tmp_path, child.pid, 200)  # not read while the process watched lives
        assert list(tracker.of([child.pid])) == [100]
        tracker.sweep()
    finally:
        child.kill()
        child.wait()
    assert list(tracker.of([child.pid])) == [200]  # exited: read again
    tracker.sweep()
    assert reads == [child.pid, child.pid] and tracker.watched == 0  # its pid gone: read at every poll now
    assert list(tracker.of([child.pid])) == [200] and len(reads) == 3
    tracker.close()


@pytest.mark.e2e
@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM, errno.ESRCH, errno.EMFILE])
def test_without_a_pidfd_a_start_time_is_read_at_every_poll(
    sleeper: subprocess.Popen, reads: list[int], monkeypatch: pytest.MonkeyPatch, code: int, logged: Sequence[str]
) -> None:
    tried: list[int] = []

    def refused(pid: int, flags: int = 0) -> int:
        tried.append(pid)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pidfd_open", refused)
    tracker = ProcStarts()
    expected = proc_start_time(sleeper.pid)
    for _ in range(3):
        assert list(tracker.of([sleeper.pid])) == [expected]
        assert tracker(sleeper.pid) == expected  # the same list's pid again: kept within the list
        tracker.sweep()
    assert reads == [sleeper.pid] * 3 and tracker.watched == 0
    # no pidfds in the kernel: never asked again; a pid not seen: not while it stays listed;
    # no descriptors: asked again while there is room
    assert len(tried) == {errno.ENOSYS: 1, errno.EPERM: 1, errno.ESRCH: 1, errno.EMFILE: 3}[code]
    tracker.of([os.getpid()])
    assert len(tried) == {errno.ENOSYS: 1, errno.EPERM: 1, errno.ESRCH: 2, errno.EMFILE: 4}[code]
    assert list(logged) == ([NO_PIDFDS] if code in (errno.ENOSYS, errno.EPERM) else [])  # said once


@pytest.mark.e2e
def test_pidfds_are_closed_once_their_pids_are_no_longer_listed(
    sleeper: subprocess.Popen, reads: list[int]
) -> None:
    tracker = ProcStarts()
    tracker.of([sleeper.pid, os.getpid()])
    tracker.sweep()
    fds = [tracker._fds[sleeper.pid], tracker._fds[os.getpid()]]
    assert len(fds) == 2 and all(map(_is_pidfd, fds))
    tracker.of([os.getpid()])
    tracker.sweep()
    assert tracker.watched == 1 and not _is_pidfd(fds[0]) and _is_pidfd(fds[1])
    tracker.of([sleeper.pid])  # listed again: read again
    tracker.sweep()
    assert sorted(reads) == sorted([sleeper.pid, os.getpid(), sleeper.pid]) and tracker.watched == 1
    fds.append(tracker._fds[sleeper.pid])
    tracker.close()
    assert tracker.watched == 0 and not any(map(_is_pidfd, fds))


@pytest.mark.e2e
def test_no_more_pidfds_than_the_limit(sleeper: subprocess.Popen, reads: list[int]) -> None:
    """Beyond the limit a pid is read at every poll, and given a pidfd once there is room."""
    tracker = ProcStarts(limit=1)
    for _ in range(2):
        tracker.of([os.getpid(), sleeper.pid])
        tracker.sweep()
    (watched,) = tracker._fds
    other = sleeper.pid if watched == os.getpid() else os.getpid()
    assert sorted(reads) == sorted([watched, other, other])
    reads.clear()
    tracker.of([other])
    tracker.sweep()  # the watched pid let go: room for the other
    tracker.of([other])
    tracker.of([other])
    tracker.sweep()
    assert tracker._fds.keys() == {other} and reads == [other, other]
    tracker.close()


def test_the_soft_descriptor_limit_bounds_the_pidfds() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert ProcStarts()._limit == soft // 2


@pytest.mark.e2e
def test_the_nvml_reader_keeps_pidfds_for_the_listed_processes_and_closes_them(
    sleeper: subprocess.Popen, reads: list[int]
) -> None:
    """Over two GPUs listing real pids: each read once, the one no longer listed let go
    of at the end of its poll, the rest at shut-down."""
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.sim import parse_scenario, simulated_binding

    now = [0.0]
    scenario = {"gpus": [
        {"busid": "00000000:17:00.0", "processes": [{"pid": sleeper.pid, "memory_mib": 8, "stop": 1.2}]},
        {"busid": "00000000:18:00.0", "processes": [{"pid": os.getpid(), "memory_mib": 8}]},
    ]}
    reader = NvmlReader(simulated_binding(parse_scenario(scenario), clock=lambda: now[0]), reactor=None)
    tracker = reader._starts = ProcStarts()
    reader.open()
    expected = {sleeper.pid: proc_start_time(sleeper.pid), os.getpid(): proc_start_time(os.getpid())}
    for step in range(1, 5):
        now[0] = step * 0.5
        snapshot, _ = reader.read(now[0])
        listed = {p.pid: p.started for device in snapshot.devices for p in device.processes}
        assert listed == {pid: started for pid, started in expected.items() if pid != sleeper.pid or now[0] < 1.2}
        assert tracker.watched == len(listed)
    assert sorted(reads) == sorted(expected)
    reader.close()
    assert tracker.watched == 0
