"""Replaying a calibration recording (tests/gpu/calibrate.py) as a simulated GPU (docs/simulator.md).

The samples calls give the recorded samples once simulated time reaches their stamps, the other
calls what the recording's last call before then returned.  Simulated time 0 is the start of the
busy spells; driver stamps map onto the recorder's clock by the smallest delay seen between a
samples call and its newest sample.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from atopgpud_tw.nvml_codes import NOT_FOUND, NOT_SUPPORTED, VALUE_TYPE_UNSIGNED_INT
from atopgpud_tw.sim.answers import Memory, NvmlFault, ProcessSample, Rates, RunningProcess, Sample
from atopgpud_tw.sim.jsonfile import read_json

#: the format tag calibrate.py writes
FORMAT = "atopgpud-calibration/1"
#: utilization samples the simulated driver keeps per device (about 16 s at 1/6 s)
SAMPLE_BUFFER = 100
#: how far a real driver moves a sample's stamp between two calls that both return it (µs):
#: an H200 on driver 580.159.04 returned the same samples 1 to 16 µs apart, either way, at
#: the end of a recording than while it ran (docs/fidelity.md, "Calibration on a real GPU");
#: samples come at least 1/6 s apart, so 1 ms tells a re-stamped sample from the next one
RESTAMPED_US = 1000


class RecordingError(ValueError):
    """A recording that cannot be replayed; the message names what is wrong."""


@dataclass(frozen=True)
class Recording:
    """What a replayed GPU answers, on the recording's own clocks."""

    name: str
    uuid: str
    busid: str
    memory_total: int
    #: the driver's clock (µs) at the start of the busy spells
    origin_us: int
    #: (stamp µs, value) of the GPU and memory samples, and (stamp µs, pid, sm, mem, enc, dec) of
    #: the process samples, by stamp; (seconds after the start, its answer) of the other calls, in order
    gpu: tuple[tuple[int, int], ...]
    mem: tuple[tuple[int, int], ...]
    processes: tuple[tuple[int, int, int, int, int, int], ...]
    rates: tuple[tuple[float, int, int], ...]
    memory: tuple[tuple[float, int, int, int], ...]
    memory_v2: tuple[tuple[float, int, int, int, int], ...]
    compute: tuple[tuple[float, tuple[tuple[int, int], ...]], ...]
    graphics: tuple[tuple[float, tuple[tuple[int, int], ...]], ...]


def driver_offset_us(sample_calls: Sequence[dict[str, Any]]) -> int | None:
    """The wall clock minus the driver's sample clock (µs): the smallest delay seen
    between a samples call and the newest sample it returned."""
    lags = [
        int(round(call["at"][0] * 1_000_000)) - max(stamp for stamp, _ in call["samples"])
        for call in sample_calls
        if call.get("samples")
    ]
    return min(lags) if lags else None


def load_recording(path: str | Path) -> Recording:
    """Read a recording for replay; `RecordingError` names what is missing."""
    data = read_json(path, RecordingError)
    try:
        return parse_recording(data, str(path))
    except (KeyError, TypeError, ValueError, IndexError) as error:
        if isinstance(error, RecordingError):
            raise
        raise RecordingError(f"{path}: not a usable recording ({type(error).__name__}: {error})") from None


def parse_recording(data: Any, path: str = "<recording>") -> Recording:
    """Build a `Recording` from a decoded calibration file."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordingError(f"{path}: not a calibration recording (format {FORMAT!r} expected)")
    calls = data["calls"]
    start_wall = float(data["schedule"]["start"][0])
    offset = driver_offset_us(calls["samples"])
    if offset is None:
        raise RecordingError(f"{path}: no utilization samples recorded")
    origin = int(round(start_wall * 1_000_000)) - offset

    def since_start(call: dict[str, Any]) -> float:
        return float(call["at"][0]) - start_wall

    kinds: dict[str, dict[int, int]] = {"gpu": {}, "memory": {}}
    for call in calls["samples"]:
        for stamp, value in call.get("samples") or ():
            kinds[call["type"]].setdefault(int(stamp), int(value))
    processes: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {}
    for call in calls["process_utilization"]:
        for pid, stamp, sm, mem, enc, dec in call.get("samples") or ():
            processes.setdefault((int(pid), int(stamp)), (int(stamp), int(pid), int(sm), int(mem), int(enc), int(dec)))
    rates = tuple((since_start(c), int(c["gpu"]), int(c["memory"])) for c in calls["rates"] if "gpu" in c)

    def memory(version: str, *names: str) -> tuple[Any, ...]:
        return tuple((since_start(c), *(int(c[version][name]) for name in names)) for c in calls["memory"]
                     if isinstance(c.get(version), dict) and "total" in c[version])

    memory_v1, memory_v2 = memory("v1", "total", "used", "free"), memory("v2", "total", "used", "free", "reserved")
    lists: dict[str, list[tuple[float, tuple[tuple[int, int], ...]]]] = {"compute": [], "graphics": []}
    for call in calls["processes"]:
        for kind, found in lists.items():
            listed = call.get(kind)
            if isinstance(listed, list):
                found.append((since_start(call), tuple((int(pid), int(used or 0)) for pid, used in listed)))
    device = data["device"]
    return Recording(
        name=str(device["name"]),
        uuid=str(device["uuid"]),
        busid=str(device["busid"]),
        memory_total=int(device["memory_total"]),
        origin_us=origin,
        gpu=_once(sorted(kinds["gpu"].items()), lambda entry: 0),
        mem=_once(sorted(kinds["memory"].items()), lambda entry: 0),
        processes=_once(sorted(processes.values()), lambda entry: entry[1]),
        rates=rates,
        memory=memory_v1,
        memory_v2=memory_v2,
        compute=tuple(lists["compute"]),
        graphics=tuple(lists["graphics"]),
    )


def _once(entries: Sequence[tuple[int, ...]], key: Callable[[tuple[int, ...]], int]) -> tuple[Any, ...]:
    """`entries` (sorted by stamp, their first field) with each sample once: a sample that a
    later call returned again on a stamp up to `RESTAMPED_US` later or earlier (for a process
    sample: of the same `key`, its pid) is the one already kept."""
    kept: list[tuple[int, ...]] = []
    last: dict[int, int] = {}
    for entry in entries:
        stamp, who = entry[0], key(entry)
        if who in last and stamp - last[who] <= RESTAMPED_US:
            continue
        last[who] = stamp
        kept.append(entry)
    return tuple(kept)


def _driver_now(recording: Recording, now: float) -> int:
    return recording.origin_us + int(round(now * 1_000_000))


def _kept(series: Sequence[tuple[int, int]], driver_now: int) -> Sequence[tuple[int, int]]:
    """The samples of `series` in the replayed buffer when the driver's clock reads `driver_now`."""
    last = bisect.bisect_right(series, (driver_now, 1 << 62))
    return series[max(0, last - SAMPLE_BUFFER):last]


def _at(entries: Sequence[tuple[Any, ...]], now: float) -> tuple[Any, ...] | None:
    """The last entry recorded at or before `now`, else the first; None when there is none."""
    if not entries:
        return None
    index = bisect.bisect_right([entry[0] for entry in entries], now) - 1
    return entries[max(0, index)]


class Replayed:
    """A replayed GPU's answers (`answers.Answers`) in simulated time (`clock`, unwrapped); the
    recording's stamps are shifted onto `base_us`, the GPU's sample clock at simulated time 0."""

    def __init__(self, recording: Recording, clock: Callable[[], float], base_us: int) -> None:
        self.recording = recording
        self._clock = clock
        self._shift = base_us - recording.origin_us

    def rates(self, handle: Any, gpu: Any) -> Rates:
        """nvmlDeviceGetUtilizationRates; NOT_SUPPORTED when the recording has none."""
        entry = _at(self.recording.rates, self._clock())
        if entry is None:
            raise NvmlFault(NOT_SUPPORTED)
        return Rates(entry[1], entry[2])

    def samples(self, device: Any, gpu: Any, field: str, timeStamp: int) -> tuple[int, list[Sample]]:
        """nvmlDeviceGetSamples: the newest `SAMPLE_BUFFER` recorded by now, those newer than `timeStamp`."""
        series = self.recording.gpu if field == "gpu" else self.recording.mem
        kept = _kept(series, _driver_now(self.recording, self._clock()))
        out = [Sample(stamp + self._shift, value) for stamp, value in kept if stamp + self._shift > timeStamp]
        if not out:
            raise NvmlFault(NOT_FOUND)
        return VALUE_TYPE_UNSIGNED_INT, out

    def memory(self, handle: Any, gpu: Any, version: Any, now: float) -> Memory:
        """nvmlDeviceGetMemoryInfo in bytes: its v2 answers for v2 where the recording has some
        (reserved 0 otherwise)."""
        recording, at = self.recording, self._clock()
        entry = _at(recording.memory_v2, at) if version is not None else None
        if entry is not None:
            return Memory(entry[1], entry[2], entry[3], entry[4])
        entry = _at(recording.memory, at)
        if entry is None:
            return Memory(recording.memory_total, 0, recording.memory_total)
        return Memory(entry[1], entry[2], entry[3])

    def running(self, handle: Any, gpu: Any, call: str, kinds: tuple[str, ...], now: float) -> list[RunningProcess]:
        """The compute or graphics list (pid, usedGpuMemory bytes); NOT_SUPPORTED when not recorded."""
        entry = _at(self.recording.compute if "C" in kinds else self.recording.graphics, self._clock())
        if entry is None:
            raise NvmlFault(NOT_SUPPORTED)
        return [RunningProcess(pid, used) for pid, used in entry[1]]

    def process_samples(self, handle: Any, gpu: Any, timeStamp: int, now: float) -> list[ProcessSample]:
        """nvmlDeviceGetProcessUtilization: the recorded entries newer than `timeStamp`, back to
        the oldest GPU sample kept."""
        recording, at = self.recording, self._clock()
        driver_now = _driver_now(recording, at)
        oldest = next(iter(_kept(recording.gpu, driver_now)), (driver_now,))[0]
        begin = bisect.bisect_left(recording.processes, (oldest,))
        end = bisect.bisect_right(recording.processes, (driver_now, 1 << 62))
        out = [
            ProcessSample(pid, stamp + self._shift, sm, mem, enc, dec)
            for stamp, pid, sm, mem, enc, dec in recording.processes[begin:end]
            if stamp + self._shift > timeStamp
        ]
        if not out:
            raise NvmlFault(NOT_FOUND)
        return out
