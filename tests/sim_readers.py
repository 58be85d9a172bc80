"""The NVML reader on a simulated host, driven synchronously: its builders and the bindings that count or skew."""

from __future__ import annotations

from collections import Counter
from typing import Any

from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import SimulatedNvml, parse_scenario, simulated_binding
from atopgpud_tw.snapshot import Snapshot


class CountingNvml:
    """The binding (pynvml over the simulated library), counting the calls made to each
    of its functions (and able to rewrite results)."""

    def __init__(self, nvml: Any, rewrite: dict[str, Any] | None = None) -> None:
        self._nvml = nvml
        self._rewrite = rewrite or {}
        self.calls: Counter[str] = Counter()
        self.args: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(value)):
            return value
        rewrite = self._rewrite.get(name)

        def counted(*args: Any) -> Any:
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
