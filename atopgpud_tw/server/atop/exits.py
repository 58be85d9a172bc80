"""Each client's queue of the processes that ended and that it has not been told about yet.

The Board queues one poll's exits for every client at once, as one shared list
of `ExitReport`s (each ``E`` record rendered once per version, for every client
that hears of it); a reply takes off the front of a client's queue what it sent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from atopgpud_tw.counters import ProcessTotals
from atopgpud_tw.server.atop import render

DEFAULT_EXITED_LIMIT = 8192


@dataclass(eq=False)
class ExitReport:
    """An exited process (`counters.ExitedProcess`) as every client's queue holds it:
    one object shared by all, its ``E`` records rendered once per version."""

    device_index: int
    totals: ProcessTotals
    records: dict[int, bytes] = field(default_factory=dict)

    def record(self, version: int) -> bytes:
        record = self.records.get(version)
        if record is None:
            record = self.records[version] = render.render_process(self.totals, version, b"E")
        return record


@dataclass(eq=False)
class ClientQueue:
    """One client's exits not yet told, at most `limit` (the oldest dropped and counted).

    A client is told of exits only after its first ``S`` (`subscribed`): what ended
    before that has no earlier figures for atop to subtract from.
    """

    limit: int = DEFAULT_EXITED_LIMIT
    subscribed: bool = False
    entries: deque[ExitReport] = field(default_factory=deque)
    dropped: int = 0
    #: one poll's exits when the queue holds exactly that list (a client that asks once per
    #: poll), else None: its reply is then every such client's, rendered once
    batch: Sequence[ExitReport] | None = None
    #: exits dropped from this queue since the client last asked
    lost: int = 0

    def add(self, exited: Sequence[ExitReport]) -> int:
        """Queue exits; returns how many old entries had to be dropped."""
        if not self.subscribed:
            return 0
        self.batch = None if self.entries else exited
        self.entries.extend(exited)
        overflow = len(self.entries) - self.limit
        if overflow <= 0:
            return 0
        self.batch = None
        for _ in range(overflow):
            self.entries.popleft()
        self.dropped += overflow
        self.lost += overflow
        return overflow

    def holds_only(self, batch: Sequence[ExitReport] | None) -> bool:
        """Whether the queue holds exactly `batch` (the same list object the Board shared)."""
        return batch is not None and self.batch is batch

    def take(self, count: int) -> None:
        self.batch = None
        if count >= len(self.entries):
            self.entries.clear()
        else:
            for _ in range(count):
                self.entries.popleft()

    def only_devices_below(self, count: int) -> None:
        """Drop the exits on devices from index `count` on, which no reply to this client carries."""
        if any(entry.device_index >= count for entry in self.entries):
            self.entries = deque(entry for entry in self.entries if entry.device_index < count)
            self.batch = None
