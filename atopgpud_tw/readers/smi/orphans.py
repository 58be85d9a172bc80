"""What nvidia-smi runs leave behind, found and killed when each run ends.

A process that calls ``setsid`` or ``setpgid`` leaves its run's group (child.py), so
the daemon makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux
3.4): what a run started stays below it.  The daemon starts no processes but its runs,
so a child Twisted did not spawn is left over from one: `Orphans.sweep` SIGKILLs and
reaps each, and their own children, handed over in turn, `ROUND` seconds later.  Only
the daemon's own children are signalled: a pid cannot be reused before its parent reaps it.

Not caught: a process that is not below the daemon (reached through a socket or
a D-Bus activation), and anything once the daemon is killed with SIGKILL (systemd
then kills the unit's control group).  Where the prctl fails only the group is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Collection

from twisted.logger import Logger

from atopgpud_tw.readers.starts import read_proc, stat_fields

log = Logger(namespace="atopgpud_tw.readers.smi_orphans")

PR_SET_CHILD_SUBREAPER = 36
#: seconds between sweeps while killed processes' own children are still coming
ROUND = 0.05
#: sweeps in a row, at most, after one run (about a second); then at the next run's end
ROUNDS = 20


def become_subreaper() -> bool:
    """Make this process a child subreaper; False (and why, logged) if the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
            return True
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as error:
        reason = str(error)
    log.warn(
        "nvidia-smi: cannot become a child subreaper ({reason}): what a run starts in a session "
        "of its own outlives the run",
        reason=reason,
    )
    return False


def children(pid: int) -> set[int]:
    """The children of `pid` (zombies included), from /proc."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            if tid == str(pid) and not Path(f"/proc/{pid}/task/{tid}/children").exists():
                return _children_by_scan(pid)  # a kernel without CONFIG_PROC_CHILDREN
            continue
        found.update(int(word) for word in text.split())
    return found


def _children_by_scan(pid: int) -> set[int]:
    parent = [str(pid).encode()]
    return {int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and stat_fields(read_proc(f"/proc/{entry}/stat") or b"")[1:2] == parent}


def dead(pid: int) -> bool:
    """Whether `pid` has exited (a zombie, or reaped)."""
    return stat_fields(read_proc(f"/proc/{pid}/stat") or b"")[:1] in ([], [b"Z"], [b"X"])


def spawned() -> Collection[int]:
    """The children Twisted spawned and has not reaped yet: never touched here."""
    from twisted.internet import process

    return set(process.reapProcessHandlers)


class Orphans:
    """Kills and reaps the daemon's children that are left over from runs."""

    def __init__(self, reactor: Any, known: Callable[[], Collection[int]] = spawned) -> None:
        self._reactor = reactor
        self._known = known
        self._pending: Any = None

    def leftovers(self) -> set[int]:
        """The daemon's children no reap handler waits for."""
        return children(os.getpid()) - set(self._known())

    def sweep(self, rounds: int = ROUNDS) -> None:
        """Reap the dead leftovers and kill the living; again in `ROUND` seconds while any is left."""
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        if self._once() and rounds > 1:
            self._pending = self._reactor.callLater(ROUND, self.sweep, rounds - 1)

    def sweep_now(self, limit: float = 1.0, ending: Collection[int] = ()) -> None:
        """Sweep, blocking, until none is left or `limit` seconds have passed (start-up, shutdown);
        `ending`: runs just killed, which Twisted reaps, whose children may still be handed over."""
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        deadline = time.monotonic() + limit
        quiet = 0  # sweeps in a row that found nothing: two, since /proc's children lists can
        # miss a process while it is being handed over (proc(5)); these sweeps also scan /proc
        while quiet < 2 and time.monotonic() < deadline:
            busy = self._once(thorough=True) or not all(map(dead, ending))
            quiet = 0 if busy else quiet + 1
            time.sleep(ROUND / 5)

    def _once(self, thorough: bool = False) -> bool:
        """One sweep; whether any leftover remains.  `thorough` also scans /proc for children (it costs more)."""
        remaining = False
        found = self.leftovers()
        if thorough:
            found |= _children_by_scan(os.getpid()) - set(self._known())
        for pid in found:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # reaped meanwhile
            if done:
                continue
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            remaining = True
        return remaining
