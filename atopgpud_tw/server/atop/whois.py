"""The ``P`` reply: who the processes are (codec/contexts.py), for ``atopgpu``.

It lists every active process on the devices the wide request carries, then
the processes that ended most recently (`RECENT_EXITS`, newest last): a client
that asks ``S`` and then ``P`` finds there the processes of its ``S`` reply,
the exited ones among them.  The body is rendered once per poll for every
client.  atop never asks ``P``; its replies are untouched.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters, ExitedProcess, ProcessTotals
from atopgpud_tw.snapshot import UNKNOWN_CONTEXT

#: ended processes whose contexts are kept for ``P``
RECENT_EXITS = 1024


def _info(totals: ProcessTotals) -> codec.ProcessInfo:
    context = totals.context
    if context is None:
        return codec.ProcessInfo(totals.pid, -1, "", "", "", "")  # not read yet
    kind, name = context.workload("auto") if context is not UNKNOWN_CONTEXT else ("unknown", "unknown")
    return codec.ProcessInfo(totals.pid, context.uid, context.user_name, kind, name, context.comm)


class ContextDirectory:
    """The processes' contexts as ``P`` tells them; told of exits by the Board."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.recent: deque[ProcessTotals] = deque(maxlen=RECENT_EXITS)
        self._body: tuple[int, bytes] | None = None

    def exited(self, exits: Iterable[ExitedProcess]) -> None:
        """Keep the most recent exits (a Board exit watcher)."""
        self.recent.extend(exit.totals for exit in exits)

    def _records(self) -> Iterator[codec.ProcessInfo]:
        for device in self.counters.devices[: codec.MAX_WIRE_DEVICES]:
            for totals in device.processes.values():
                yield _info(totals)
        for totals in reversed(self.recent):
            yield _info(totals)

    def body(self) -> bytes:
        """The ``P`` body now, rendered once per poll."""
        generation = self.counters.generation
        if self._body is None or self._body[0] != generation:
            # the active processes, then the newest exits first, as many as fit
            records = list(self._records())
            kept = records[: codec.render_contexts(records).count(b"\n")]
            active = min(len(kept), sum(len(d.processes) for d in self.counters.devices[: codec.MAX_WIRE_DEVICES]))
            # written exits oldest first, the active last: a later line wins for a pid listed twice
            self._body = (generation, codec.render_contexts(kept[active:][::-1] + kept[:active]))
        return self._body[1]
