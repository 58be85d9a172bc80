"""The NVML reader over a simulated host, read synchronously at a task.Clock's time."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding


class ClockedReader:
    """A reader for `PollerService` whose polls read at once, at the clock's time."""

    name = "sim"

    def __init__(self, scenario: dict[str, Any], clock: Clock) -> None:
        self.clock = clock
        self.nvml = simulated_binding(parse_scenario(scenario), clock=clock.seconds)
        self.reader = NvmlReader(self.nvml, reactor=None)
        self.reader.open()

    def poll(self) -> Deferred:
        return succeed(self.reader.read(self.clock.seconds())[0])

    def close(self) -> None:
        pass
