"""Who a GPU process is: its user, command, start time and cgroup, read from ``/proc`` once.

A process gone before it could be read, or not visible (``hidepid=``, systemd's
``ProtectProc=``), is `UNKNOWN_CONTEXT`; so is one whose start time changed while
its files were read (its pid taken by another process).  `Contexts` reads at most
`READS_PER_POLL` new processes per poll, in the reader's thread, and reads a pid
again when its start time changes.  A simulated host's processes are read from
``/proc`` too: a scenario whose pids are real processes is shown with their context.
"""

from __future__ import annotations

import functools
import pwd
from dataclasses import asdict, replace

from atopgpud_tw.readers.cgroups import workload_of
from atopgpud_tw.readers.starts import read_proc, stat_start_time
from atopgpud_tw.snapshot import UNKNOWN_CONTEXT, ProcessContext, Snapshot

#: new processes read per poll at most: a poll's cost stays bounded when hundreds start at once
READS_PER_POLL = 64
#: bytes read of each file at most (a command line may be long; a cgroup file of many hierarchies)
_FILE_LIMIT = 16384
_FILES = ("stat", "status", "cgroup", "cmdline")
#: characters of a command line kept
CMDLINE_CHARS = 256
#: user names remembered
_NAMES_KEPT = 4096


def _status_fields(status: bytes) -> tuple[str, int]:
    """(Name, real Uid) of a ``/proc/PID/status`` text; ("", -1) where missing."""
    name, uid = "", -1
    for line in status.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "Uid":
            fields = value.split()
            if fields and fields[0].isdigit():
                uid = int(fields[0])
            break  # Name comes first, Uid some lines later: nothing after it is wanted
    return name, uid


@functools.lru_cache(maxsize=_NAMES_KEPT)
def user_name(uid: int) -> str:
    """The name of `uid` ("" if it has none), looked up once (a lookup goes through NSS)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return ""


def read_context(pid: int, proc: str = "/proc") -> ProcessContext:
    """The context of the process `pid` as ``/proc`` shows it now; `UNKNOWN_CONTEXT` if gone or not visible."""
    base = f"{proc}/{pid}"
    stat, status, cgroup, cmdline = (read_proc(f"{base}/{name}", _FILE_LIMIT) for name in _FILES)
    if stat is None or status is None or cgroup is None:
        return UNKNOWN_CONTEXT
    started = stat_start_time(stat)
    again = read_proc(f"{base}/stat", _FILE_LIMIT)
    if again is None or stat_start_time(again) != started:
        return UNKNOWN_CONTEXT  # the pid went to another process while it was read
    comm, uid = _status_fields(status)
    user = user_name(uid) if uid >= 0 else ""
    command = (cmdline or b"").rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:CMDLINE_CHARS]
    found = workload_of(cgroup.decode("utf-8", "replace"))
    return ProcessContext(uid=uid, user=user, comm=comm, cmdline=command, started=started, **asdict(found))


class Contexts:
    """The contexts of the processes a reader lists, read in the reader's thread: the reactor never reads /proc."""

    def __init__(self, proc: str = "/proc", reads_per_poll: int = READS_PER_POLL) -> None:
        self.proc = proc
        self.reads_per_poll = reads_per_poll
        #: by pid: the start time the reader gave it when it was read, and its context
        self._known: dict[int, tuple[int | None, ProcessContext]] = {}
        #: contexts read since start (for tests and benchmarks)
        self.reads = 0
        #: the pids (and start times) of the last poll, and its contexts if every one was read
        self._listed: dict[int, int | None] = {}
        self._complete: dict[int, ProcessContext] | None = None

    def attach(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` with the contexts of its processes, those read so far."""
        listed = {process.pid: process.started for device in snapshot.devices for process in device.processes or ()}
        if listed == self._listed and self._complete is not None:
            # the same processes as the last poll, every one read then: the same contexts
            return replace(snapshot, contexts=self._complete)
        self._listed = listed
        self._complete = None
        budget = self.reads_per_poll
        known = self._known
        contexts: dict[int, ProcessContext] = {}
        for pid, started in listed.items():
            held = known.get(pid)
            if held is not None and (held[0] == started or started is None):
                contexts[pid] = held[1]
                continue
            if budget <= 0:
                continue  # read in a later poll
            budget -= 1
            self.reads += 1
            context = read_context(pid, self.proc)
            known[pid] = (started, context)
            contexts[pid] = context
        if len(known) > len(contexts):
            # a pid no longer listed is forgotten: a process listed again later is read again
            for pid in [pid for pid in known if pid not in listed]:
                del known[pid]
        if len(contexts) == len(listed) and contexts:
            self._complete = contexts
        if not contexts:
            return snapshot
        return replace(snapshot, contexts=contexts)
