"""What atop prints with ``-P GPU,PRE``, parsed, and what it must say given the scenario a test ran.

Shared by tests/test_atop.py; the figures atop derives (per-interval sums, cut
ids, E lines) are described in docs/atop.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest

#: atop keeps the last this-many characters of a bus id and of a type name
ATOP_ID_CHARS = 12
#: what atop writes when a reply is longer than it accepts
LENGTH_ERROR = "unexpected response length"
#: the fields that follow ``(name)`` on a PRE line
_PRE_TAIL = 9
MIB = 1024  # KiB


# -- parsing -----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuLine:
    """A ``GPU`` line of ``atop -P GPU``."""

    index: int
    busid: str
    type: str
    gpu_now: int
    mem_now: int
    mem_total_kib: int
    mem_used_kib: int
    samples: int
    gpu_cum: int
    mem_cum: int
    mem_used_cum_kib: int


@dataclass(frozen=True)
class ProcessLine:
    """A ``PRE`` line of ``atop -P PRE``: one process's GPU figures."""

    pid: int
    name: str
    state: str
    gpu_state: str
    nrgpus: int
    gpulist: int
    gpu_busy: int
    mem_busy: int
    mem_now_kib: int
    mem_cum_kib: int
    samples: int
    #: atop 2.13 and later only: whether the line is of a process (``y``) or a thread
    #: (``n``), and the process's GPU type (``C``, ``G``, ``U``)
    is_process: bool | None = None
    gpu_type: str | None = None


@dataclass
class Sample:
    """One interval of atop's output; the first one covers the time since boot."""

    interval: int
    gpus: list[GpuLine] = field(default_factory=list)
    processes: dict[int, ProcessLine] = field(default_factory=dict)


def parse_gpu(fields: list[str]) -> GpuLine:
    """``GPU host epoch date time interval index busid type`` and eight numbers."""
    numbers = [int(f) for f in fields[9:17]]
    return GpuLine(int(fields[6]), fields[7], fields[8], *numbers)


def parse_pre(line: str) -> ProcessLine:
    """``PRE host epoch date time interval pid (name)`` and nine fields; names may hold spaces.

    atop 2.13 adds two: ``y`` (a process) or ``n`` (a thread), and the GPU type.
    """
    fields = line.split()
    extra = 2 if len(fields) >= 7 + _PRE_TAIL + 2 and fields[-2] in ("y", "n") else 0
    head, tail = fields[:7], fields[len(fields) - _PRE_TAIL - extra:]
    name = line.split(" ", 7)[7].rsplit(" ", _PRE_TAIL + extra)[0]
    state, gpu_state, nrgpus, gpulist, *numbers = tail[:_PRE_TAIL]
    more = (tail[-2] == "y", tail[-1]) if extra else (None, None)
    return ProcessLine(
        int(head[6]), name.strip("()"), state, gpu_state, int(nrgpus), int(gpulist, 16),
        *(int(n) for n in numbers), *more,
    )


def parse_output(text: str) -> list[Sample]:
    """atop's parseable output cut into samples at each ``SEP``."""
    samples: list[Sample] = []
    current: Sample | None = None
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] == "RESET":
            continue
        if fields[0] == "SEP":
            samples.append(current or Sample(interval=-1))
            current = None
            continue
        if current is None:
            current = Sample(interval=int(fields[5]))
        if fields[0] == "GPU":
            current.gpus.append(parse_gpu(fields))
        elif fields[0] == "PRE":
            proc = parse_pre(line)
            kept = current.processes.get(proc.pid)
            # atop 2.13 lists a thread of the same id after its process: keep the process
            if kept is None or kept.is_process is not True:
                current.processes[proc.pid] = proc
    return samples


@dataclass
class AtopRun:
    """What one run of atop printed."""

    stdout: str
    stderr: str
    returncode: int

    @property
    def samples(self) -> list[Sample]:
        return parse_output(self.stdout)

    def __str__(self) -> str:
        return f"atop exit status {self.returncode}\n--- stdout (GPU lines)\n" + "\n".join(
            line for line in self.stdout.splitlines() if not line.startswith("PRE")
        ) + f"\n--- stderr\n{self.stderr}"


# -- expectations ------------------------------------------------------------------


def atop_id(text: str) -> str:
    """A bus id or type name as atop keeps it (the daemon sends names with _ for spaces)."""
    return text.replace(" ", "_")[-ATOP_ID_CHARS:]


def window_sums(values: Any, count: int) -> set[int]:
    """Every sum of `count` consecutive samples of a constant or cycled scenario value."""
    cycle = values if isinstance(values, list) else [values]
    return {sum(cycle[(start + i) % len(cycle)] for i in range(count)) for start in range(len(cycle))}


def check_gpu(line: GpuLine, spec: dict[str, Any], where: str) -> None:
    """One GPU line against its scenario entry, for any number of samples."""
    assert line.busid == atop_id(spec["busid"]), where
    assert line.type == atop_id(spec["name"]), where
    assert line.mem_total_kib == spec["memory_total_mib"] * MIB, where
    assert line.samples >= 1, where
    used = spec["memory_used_mib"]
    assert line.mem_used_cum_kib in {s * MIB for s in window_sums(used, line.samples)}, where
    assert line.mem_used_kib in {u * MIB for u in (used if isinstance(used, list) else [used])}, where
    for now, cum, key in ((line.gpu_now, line.gpu_cum, "gpu_util"), (line.mem_now, line.mem_cum, "mem_util")):
        value = spec[key]
        if value is None:
            assert (now, cum) == (-1, -1), f"{where}: {key} unsupported"
        else:
            assert now in (value if isinstance(value, list) else [value]), f"{where}: {key} now"
            assert cum in window_sums(value, line.samples), f"{where}: {key} sum of {line.samples}"


def check_gpus(sample: Sample, specs: Sequence[dict[str, Any]], where: str) -> None:
    """Every GPU of the scenario, in order, with its figures."""
    assert [g.index for g in sample.gpus] == list(range(len(specs))), where
    for line, spec in zip(sample.gpus, specs):
        check_gpu(line, spec, f"{where}, GPU {line.index}")


def no_length_error(run: AtopRun) -> None:
    assert LENGTH_ERROR not in run.stdout + run.stderr, str(run)


def process_lines(samples: Sequence[Sample], pid: int) -> list[ProcessLine]:
    """A pid's PRE line in each sample (it must be in all of them)."""
    lines = []
    for number, sample in enumerate(samples):
        assert pid in sample.processes, f"pid {pid} missing from sample {number}"
        lines.append(sample.processes[pid])
    return lines


def gpu_states(samples: Sequence[Sample], pid: int) -> list[str]:
    """A pid's GPU state in each sample: A, E, N, or - when atop does not list it."""
    return [s.processes[pid].gpu_state if pid in s.processes else "-" for s in samples]


def check_end(
    samples: Sequence[Sample], pid: int, spec: dict[str, Any], gpu_bit: int, total: int
) -> tuple[ProcessLine, list[str]]:
    """Active, then E once with the polls before its end; the E line and the states after it.

    `total` is the process's sample count in the daemon: atop's per-interval counts
    add up to it.
    """
    states = gpu_states(samples, pid)
    assert "E" in states, f"pid {pid} never shown as ended: {states}"
    end = states.index("E")
    assert end >= 1 and states[:end] == ["A"] * end, states
    lines = [s.processes[pid] for s in samples[: end + 1]]
    for sample, line in zip(samples, lines):
        assert (line.nrgpus, line.gpulist) == (1, gpu_bit), line
        assert (line.gpu_busy, line.mem_busy) == (spec["sm_util"], spec["mem_util"]), line
        assert line.mem_now_kib == spec["memory_mib"] * MIB, line
        assert line.mem_cum_kib == line.samples * spec["memory_mib"] * MIB, line
        # whole intervals while active; in the last one, the polls before its end
        whole = sample.gpus[0].samples
        if line is lines[-1]:
            assert 0 <= line.samples <= whole, line
        else:
            assert line.samples == whole, line
    assert sum(line.samples for line in lines) == total, (lines, total)
    return lines[-1], states[end + 1:]


def pause_until(moment: float) -> None:
    """Sleep until `time.monotonic()` reaches `moment`."""
    time.sleep(max(0.0, moment - time.monotonic()))


def on_schedule(sample_times: Sequence[float], start: float, changes: Sequence[float], margin: float = 0.3) -> None:
    """Skip unless every scenario change fell well inside one of atop's intervals.

    The scenario's clock starts a little before the port answers (`start`), and
    the daemon notices a change at its next poll: a change too near one of atop's
    samples could land on either side of it, and then no figure can be expected.
    """
    offsets = [t - start for t in sample_times]
    for change in changes:
        if any(abs(offset - change) < margin for offset in offsets) or change > offsets[-1]:
            pytest.skip(f"this machine was too slow for the schedule: atop sampled at {offsets} s")
