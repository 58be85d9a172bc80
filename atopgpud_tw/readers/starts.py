"""Process start times: what tells a reused pid from the process that had it.

A process that exits and a new one that gets its pid between two polls are
listed by the driver under one pid.  Their start times differ: field 22 of
``/proc/PID/stat`` (``starttime``, clock ticks since boot), read while the pid
is listed.  Where ``/proc`` does not show the pid (another pid namespace,
``hidepid``, systemd's ``ProtectProc=invisible``) the start time is not known
(None) and a pid is one process for as long as every poll lists it
(docs/fidelity.md, "A pid reused").

A simulated host has no such processes: its binding carries the start times
of its own (`START_TIMES`, the simulator's ``process_start_time``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

#: the attribute of an NVML binding that gives its host's process start times in place of /proc
START_TIMES = "process_start_time"

StartTimes = Callable[[int], "int | None"]


def proc_start_time(pid: int) -> int | None:
    """``starttime`` of ``/proc/PID/stat``; None where the pid cannot be seen or read."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except (OSError, ValueError):
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return stat_start_time(data)


def stat_start_time(stat: bytes) -> int | None:
    """Field 22 (``starttime``) of a ``/proc/PID/stat`` line; None if it has none."""
    # the command name (field 2) is in parentheses and may hold spaces and ')'
    close = stat.rfind(b")")
    fields = stat[close + 2:].split(b" ", 20) if close >= 0 else []
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def start_times(binding: Any) -> StartTimes:
    """Where a reader over `binding` finds process start times: the binding's own host's
    (a simulated one) if it says, else /proc."""
    own = getattr(binding, START_TIMES, None)
    return own if callable(own) else proc_start_time
