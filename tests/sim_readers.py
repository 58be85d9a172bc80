"""The NVML reader on a simulated host, driven synchronously: its builders and the bindings that count or skew."""

from __future__ import annotations

from collections import Counter
from typing import Any

from twisted.internet.task import Clock

from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import SimulatedNvml, parse_scenario, simulated_binding
from atopgpud_tw.snapshot import Snapshot


class CountingNvml:
    """The binding (pynvml over the simulated library), counting the calls made to each
    of its functions (and able to rewrite results)."""

    #: what the reader calls through the function table, not the binding's functions
    #: (readers/nvml/direct.py): counted where the simulated library asks the driver model
    DIRECT = (
        "nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetMigMode", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetUUID",
    )

    def __init__(self, nvml: Any, rewrite: dict[str, Any] | None = None) -> None:
        self._nvml = nvml
        self._rewrite = rewrite or {}
        self.calls: Counter[str] = Counter()
        self.args: list[tuple[str, tuple[Any, ...]]] = []
        library = nvml.nvmlLib
        for name in self.DIRECT:
            self._count_model(library, name)

    def _count_model(self, library: Any, name: str) -> None:
        """Count the model's answers to `name`, its handle given as the library gives it out."""
        real = getattr(library.model, name)

        def counted(handle: Any, *args: Any) -> Any:
            self.calls[name] += 1
            self.args.append((name, (library.handle_id(handle), *args)))
            return real(handle, *args)

        setattr(library.model, name, counted)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(value)):
            return value
        rewrite = self._rewrite.get(name)

        def counted(*args: Any) -> Any:
            if name not in self.DIRECT:  # (those are counted where the model answers, once)
                self.calls[name] += 1
                self.args.append((name, args))
            result = value(*args)
            return rewrite(result, *args) if rewrite else result

        return counted


def make_reader(
    scenario: dict, clock: list[float], mig: str = "instances", rewrite: dict[str, Any] | None = None
) -> tuple[NvmlReader, CountingNvml]:
    """An opened reader on a simulated host whose time is ``clock[0]``."""
    nvml = CountingNvml(simulated_binding(parse_scenario(scenario), clock=lambda: clock[0]), rewrite)
    reader = NvmlReader(nvml, reactor=None, mig=mig)
    reader.open()
    return reader, nvml


def poll(reader: NvmlReader, clock: list[float], now: float) -> tuple[Snapshot, dict[str, str]]:
    """Move the simulated time to `now` and read once."""
    clock[0] = now
    return reader.read(now)


class SkewedNvml(SimulatedNvml):
    """GPU 0's process-utilization stamps run 10 s ahead of GPU 1's (its own clock)."""

    SKEW = 10_000_000

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> Any:
        skew = self.SKEW if handle.gpu == 0 else 0
        samples = super().nvmlDeviceGetProcessUtilization(handle, max(0, timeStamp - skew))
        for sample in samples:
            sample.timeStamp += skew
        return samples


def scenario_gpu(index: int, faults: Any = (), **extra: Any) -> dict[str, Any]:
    """A scenario's GPU `index`: 40/10 % busy, one process (pid 100 + index), no sample buffer."""
    return {
        "busid": f"00000000:{0x17 + index:02X}:00.0",
        "gpu_util": 40,
        "mem_util": 10,
        "processes": [{"pid": 100 + index, "memory_mib": 8, "sm_util": 20, "mem_util": 2}],
        "faults": list(faults),
        "samples_supported": False,
        **extra,
    }


class ScenarioRun:
    """The NVML reader over a scenario, polled once a simulated second into a Board.

    `report` logs each poll's problems as the poller does; `contain` counts a poll
    that raises (`failed_polls`) as the poller contains it, else the exception
    goes on to the test.  The driver model's ``nvmlInit`` and
    ``nvmlDeviceGetCount`` are counted in `calls`.
    """

    def __init__(self, scenario: dict[str, Any], *, report: bool = False, contain: bool = True) -> None:
        self.clock = Clock()
        self.nvml = simulated_binding(parse_scenario(scenario), clock=self.clock.seconds)
        #: the driver model beneath the simulated library: its calls are counted
        self.model = self.nvml.nvmlLib.model
        self.calls: dict[str, int] = {}
        for name in ("nvmlInit", "nvmlDeviceGetCount"):
            self._count(name)
        self.report = report
        self.contain = contain
        self.reader = NvmlReader(self.nvml, reactor=None)
        self.reader.open()
        self.board = Board()
        self.history: list[list[tuple[int, ...]]] = []
        self.failed_polls = 0

    def _count(self, name: str) -> None:
        real = getattr(self.model, name)

        def counted(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args)

        setattr(self.model, name, counted)

    def poll(self) -> None:
        try:
            snapshot, problems = self.reader.read(self.clock.seconds())
        except Exception:
            if not self.contain:
                raise
            self.failed_polls += 1
        else:
            if self.report:
                self.reader._problems.report(problems)
            self.board.fold(snapshot)
        self.history.append([
            (d.samples, d.gpu_busy_total, d.mem_busy_total, d.memory_used_cum_kib) for d in self.board.counters.devices
        ])

    def until(self, seconds: float) -> None:
        while self.clock.seconds() < seconds:
            self.poll()
            self.clock.advance(1.0)

    def device(self, index: int) -> Any:
        return self.board.counters.devices[index]

    def assert_monotonic(self) -> None:
        for before, after in zip(self.history, self.history[1:]):
            for old, new in zip(before, after):
                assert all(b >= a for a, b in zip(old, new)), (old, new)
