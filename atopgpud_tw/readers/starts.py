"""Process start times: what tells a reused pid from the process that had it.

A process that exits and a new one that gets its pid between two polls are
listed by the driver under one pid; their start times differ (field 22 of
``/proc/PID/stat``, ``starttime``).  Where ``/proc`` does not show the pid
(another pid namespace, ``hidepid``, ``ProtectProc=invisible``) it is None, and a
pid is one process while every poll lists it (docs/fidelity.md, "A pid reused").
`ProcStarts` reads each process's once and watches it with a pidfd, rather than
three system calls per listed pid at every poll.  A simulated host's binding
carries start times of its own (`START_TIMES`).
"""

from __future__ import annotations

import errno
import os
import resource
import select
from typing import Any, Callable, Iterable

from twisted.logger import Logger

log = Logger(namespace="atopgpud_tw.readers")

#: the attribute of an NVML binding that gives its host's process start times in place of /proc
START_TIMES = "process_start_time"

StartTimes = Callable[[int], "int | None"]


def read_proc(path: str, limit: int = 4096) -> bytes | None:
    """The first `limit` bytes of a ``/proc`` file; None where it cannot be opened or read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def stat_fields(stat: bytes) -> list[bytes]:
    """The fields of a ``/proc/PID/stat`` line from field 3 (the state) on to field 22 (``starttime``,
    [19]), the rest in one: the command name (field 2) is in parentheses and may hold spaces and ')'."""
    return stat[stat.rfind(b")") + 1:].split(None, 20) if b")" in stat else []


def proc_start_time(pid: int, proc: str = "/proc") -> int | None:
    """``starttime`` of ``/proc/PID/stat`` (`proc`: where /proc is); None where the pid cannot be seen or read."""
    return stat_start_time(read_proc(f"{proc}/{pid}/stat") or b"")


def stat_start_time(stat: bytes) -> int | None:
    """Field 22 (``starttime``) of a ``/proc/PID/stat`` line; None if it has none."""
    try:
        return int(stat_fields(stat)[19])
    except (IndexError, ValueError):
        return None


NO_PIDFDS = (
    "start times: no pidfds here (Linux 5.3 and later have them, unless a system call filter refuses them); "
    "each listed pid's is read at every poll"
)
#: at most this share of the soft RLIMIT_NOFILE is taken by pidfds (the rest is the clients', the logs', NVML's)
PIDFD_SHARE = 2


class Starts:
    """Start times of listed pids from a function (a simulated host's), in a reader's worker thread: `check`
    once the driver's lists are taken, then the call or `of` per pid; `sweep` after each poll."""

    def __init__(self, own: StartTimes) -> None:
        self._own = own

    def __call__(self, pid: int) -> int | None:
        return self._own(pid)

    def check(self) -> None:
        """Which kept processes have exited since the lists were taken."""

    def of(self, pids: list[int]) -> Iterable[int | None]:
        """The start times of one list's pids, in its order."""
        return map(self._own, pids)

    def sweep(self) -> None:
        """A poll is over: what the pids not listed since the last sweep held is let go."""

    def close(self) -> None:
        """Everything kept is let go."""


class ProcStarts(Starts):
    """Start times from ``/proc/PID/stat``, each read once per process where the kernel has pidfds.

    A pidfd opened when a pid is first listed, before its start time is read, watches that process;
    one ``poll()`` over a list's pidfds, after the list is taken, says which have exited (readable even
    once the pid is reused): only those are read again.  A pid with no pidfd (none in the kernel, one
    this namespace cannot see, no descriptors to spare) is read at every poll.
    """

    def __init__(self, proc: str = "/proc", limit: int | None = None) -> None:
        super().__init__(self._read)
        self._proc = proc
        #: start times by pid: of a watched process until it exits, of an unwatched pid for this list only
        self._known: dict[int, int | None] = {}
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._poller = select.poll()
        #: pids read at every poll while they stay listed (no pidfd for them)
        self._unwatched: set[int] = set()
        #: of those, the ones left without a pidfd by the limit: tried again when there is room
        self._crowded: set[int] = set()
        #: the unwatched pids whose start times are in `_known` (for the current list)
        self._transient: list[int] = []
        self._seen: set[int] = set()
        self._pidfds = hasattr(os, "pidfd_open")
        if not self._pidfds:
            log.info(NO_PIDFDS)
        if limit is None:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = soft // PIDFD_SHARE if soft != resource.RLIM_INFINITY else 1 << 16
        self._limit = limit

    def _read(self, pid: int) -> int | None:
        return proc_start_time(pid, self._proc)

    def __call__(self, pid: int) -> int | None:
        self._seen.add(pid)
        try:
            return self._known[pid]
        except KeyError:
            return self._learn(pid)

    def check(self) -> None:
        self._forget_unwatched()
        if not self._fds:
            return
        for fd, _ in self._poller.poll(0):
            self._let_go(self._pids[fd])

    def of(self, pids: list[int]) -> Iterable[int | None]:
        # this list's pidfds only: polled over all of them at each of a poll's lists, the
        # kernel would look at every process once per list
        known = self._known
        self._forget_unwatched()
        fds = self._fds
        if fds:
            poller = select.poll()
            register = poller.register
            for fd in map(fds.__getitem__, fds.keys() & pids):
                register(fd, select.POLLIN)
            for fd, _ in poller.poll(0):
                self._let_go(self._pids[fd])
        self._seen.update(pids)
        for pid in set(pids).difference(known):
            self._learn(pid)
        return map(known.__getitem__, pids)

    def sweep(self) -> None:
        seen = self._seen
        for pid in self._fds.keys() - seen:
            self._let_go(pid)
        for pid in self._known.keys() - seen:
            del self._known[pid]
        self._unwatched &= seen
        if self._crowded:
            self._crowded &= seen
            if len(self._fds) < self._limit:  # room again: tried at their next listing
                self._unwatched -= self._crowded
                for pid in self._crowded:
                    self._known.pop(pid, None)
                self._crowded.clear()
        seen.clear()

    def close(self) -> None:
        for pid in list(self._fds):
            self._let_go(pid)
        self._known.clear()
        self._unwatched.clear()
        self._crowded.clear()
        self._transient.clear()

    def _forget_unwatched(self) -> None:
        """The start times read for pids with no pidfd are good for the list they were read for only."""
        for pid in self._transient:
            self._known.pop(pid, None)
        self._transient.clear()

    @property
    def watched(self) -> int:
        """How many processes have a pidfd."""
        return len(self._fds)

    def _learn(self, pid: int) -> int | None:
        if pid not in self._unwatched:
            self._watch(pid)
        started = self._known[pid] = self._read(pid)
        if pid in self._unwatched:
            self._transient.append(pid)
        return started

    def _watch(self, pid: int) -> None:
        if self._pidfds and len(self._fds) < self._limit:
            try:
                fd = os.pidfd_open(pid)
            except OSError as error:
                if error.errno in (errno.ENOSYS, errno.EPERM):
                    # ENOSYS: a kernel before 5.3; EPERM: a system call filter (pidfd_open
                    # itself never answers it)
                    self._pidfds = False
                    log.info(NO_PIDFDS)
                elif error.errno in (errno.EMFILE, errno.ENFILE):
                    self._crowded.add(pid)
            except (ValueError, OverflowError):
                pass
            else:
                self._fds[pid] = fd
                self._pids[fd] = pid
                self._poller.register(fd, select.POLLIN)
                return
        elif self._pidfds:
            self._crowded.add(pid)
        self._unwatched.add(pid)

    def _let_go(self, pid: int) -> None:
        """The pidfd of a pid no longer listed or whose process has exited: closed, its start time forgotten."""
        fd = self._fds.pop(pid)
        del self._pids[fd]
        self._poller.unregister(fd)
        os.close(fd)
        self._known.pop(pid, None)


def start_times(binding: Any) -> Starts:
    """Where a reader over `binding` finds process start times: its own host's (simulated) if it has, else /proc."""
    own = getattr(binding, START_TIMES, None)
    return Starts(own) if callable(own) else ProcStarts()
