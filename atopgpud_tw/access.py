"""Who may connect: peer credentials of UNIX-socket clients, and bursts of refusals.

An abstract socket has no file permissions: any local process in the same network
namespace can connect and see every GPU process.  Sites that want less give the
daemon an allow-list of uids and gids (``--allow-uid``/``--allow-gid``); a client
on a UNIX socket is then accepted only if SO_PEERCRED says its uid is listed, or
its primary or a supplementary group is.  TCP clients carry no credentials: keep
TCP on loopback, or off, where this matters.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gids: frozenset[int]


def peer_of(transport: Any) -> Peer | None:
    """The credentials of a UNIX-socket peer; None for other transports."""
    try:
        handle = transport.getHandle()
        if handle.family != socket.AF_UNIX:
            return None
        raw = handle.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, frozenset({gid}) | _supplementary_groups(pid))


def _supplementary_groups(pid: int) -> frozenset[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


@dataclass(frozen=True)
class AllowList:
    """uids and gids allowed on UNIX sockets; empty means everyone."""

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    @property
    def restricts(self) -> bool:
        return bool(self.uids or self.gids)

    def admits(self, peer: Peer | None) -> bool:
        """Whether a client may stay; TCP peers (no credentials) always may."""
        if not self.restricts or peer is None:
            return True
        return peer.uid == 0 or peer.uid in self.uids or bool(peer.gids & self.gids)


class BurstLog:
    """Logs the first of a burst of events, and a count when the burst is over.

    A flood of refused connections costs one line at its start and one at its end,
    however many there were.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, quiet: float = 10.0) -> None:
        self.clock = clock
        self.quiet = quiet
        self.total = 0
        self._more = 0
        self._call: Any = None
        self._what = ""

    def event(self, first_line: Callable[[], None], what: str) -> None:
        """Count one event; `first_line` logs it if it starts a burst."""
        self.total += 1
        if self._call is not None and self._call.active():
            self._more += 1
            self._call.reset(self.quiet)
            return
        first_line()
        self._what = what
        self._more = 0
        self._call = self.clock.callLater(self.quiet, self._over)

    def _over(self) -> None:
        self._call = None
        if self._more:
            self.log.warn("{count} more {what} in that burst", count=self._more, what=self._what)

    def stop(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
