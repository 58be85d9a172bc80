"""What one poll of the GPUs saw: the immutable hand-over from a reader to the counters.

Readers (NVML, nvidia-smi, the simulator through NVML) build one `Snapshot` per poll
and know nothing of counters or sockets.  Values follow one convention throughout:

- a percentage is an ``int`` from 0 to 100; `UNSUPPORTED` (-1) when the device cannot
  report it at all (it stays -1 for ever); ``None`` when reading it failed in this
  poll only (the counters then skip this poll for that device or process);
- memory is in KiB; ``None`` when it could not be read in this poll; a process's
  memory is `UNSUPPORTED` (-1) when the driver cannot tell it (WDDM, some vGPU
  guests: NVML's usedGpuMemory is "not available", nvidia-smi prints N/A).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

UNSUPPORTED = -1

#: task-support bits of the ``T`` reply
TASK_COMPUTE = 1
TASK_GRAPHICS = 2
#: the digit's third bit: the device's busy figure is GPM's graphics activity (a MIG
#: instance's; docs/mig.md), where without it a MIG instance sends -1
TASK_BUSY_GPM = 4


class ProcessSample(NamedTuple):
    """One process on one device in one poll (a named tuple: many are made every poll)."""

    pid: int
    #: "C" (compute), "G" (graphics) or "C+G" (both lists named it)
    kind: str = "C"
    memory_kib: int | None = 0
    gpu_busy: int | None = 0
    mem_busy: int | None = 0
    #: the process's start time (Linux: ``/proc/PID/stat`` field 22, clock ticks
    #: since boot), which tells a reused pid from the process that had it; None
    #: where it cannot be seen (docs/fidelity.md, "A pid reused")
    started: int | None = None


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What a device is, read once when it is discovered: text, empty where it cannot be read
    (labels of ``atopgpud_gpu_info``).  `uuid` is a card's ``GPU-...`` or a MIG instance's
    ``MIG-...``; the MIG fields (``atopgpud_mig_info``) are empty for a whole card."""

    uuid: str = ""
    serial: str = ""
    vbios: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    mig_profile: str = ""
    parent_uuid: str = ""
    gpu_instance: str = ""
    compute_instance: str = ""


NO_INFO = DeviceInfo()


@dataclass(frozen=True, slots=True)
class GpmFigures:
    """What GPU Performance Monitoring measured over one poll (readers/nvml/gpm.py): each figure
    the exact average over `seconds` (between two GPM samples), a percentage or MiB per
    second; one the device does not report is left out of `values`."""

    seconds: float
    values: tuple[tuple[str, float], ...] = ()

    def get(self, name: str) -> float | None:
        """One figure by name; None where the device does not report it."""
        return next((value for key, value in self.values if key == name), None)


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One device (a whole card or a MIG instance) in one poll; `key` identifies it across polls
    and re-discoveries (UUID, else the bus id).  `processes` None: the list could not be read
    (they neither count nor end); `present` False: known but unreadable (lost, driver gone),
    shown with -1 percentages, its processes end."""

    key: str
    busid: str
    name: str
    task_support: int = TASK_COMPUTE | TASK_GRAPHICS
    gpu_busy: int | None = UNSUPPORTED
    mem_busy: int | None = UNSUPPORTED
    memory_total_kib: int | None = 0
    memory_used_kib: int | None = 0
    #: free and reserved memory as the driver reports them (None: not read, or not reported)
    memory_free_kib: int | None = None
    memory_reserved_kib: int | None = None
    processes: tuple[ProcessSample, ...] | None = ()
    present: bool = True
    #: what the device is (its UUID, serial, versions): read once, carried by every sample
    info: DeviceInfo = NO_INFO
    #: GPM's figures over this poll (None: no GPM, or none this poll)
    gpm: GpmFigures | None = None

    def read(self) -> bool:
        """Whether anything of it was read in this poll (-1, a figure it cannot report, was read)."""
        return self.present and (
            self.gpu_busy is not None or self.mem_busy is not None or self.memory_used_kib is not None
            or self.processes is not None
        )

    def absent(self) -> DeviceSample:
        return DeviceSample(self.key, self.busid, self.name, self.task_support, present=False, info=self.info)


#: how processes are grouped into workloads (``--workloads``); "auto" is the most
#: specific of them a process has (what ``atopgpu`` shows)
GROUPINGS = ("unit", "container", "pod", "job", "user", "off")
#: ``--workload-limit`` and ``--workload-expiry`` by default (workloads.py): here, with the
#: groupings, so that the options can name them without loading the workloads' module
DEFAULT_WORKLOAD_LIMIT = 500
DEFAULT_WORKLOAD_EXPIRY = 3600.0
#: by grouping, the fields of a `ProcessContext` looked at in turn: the first one a
#: process has names its workload (a service's process has no pod)
_WORKLOAD_ORDER = {
    "auto": ("pod", "container", "job", "unit", "slice", "user"),
    "pod": ("pod", "container", "job", "unit", "slice", "user"),
    "container": ("container", "job", "unit", "slice", "user"),
    "job": ("job", "container", "unit", "slice", "user"),
    "unit": ("unit", "slice", "user"),
    "user": ("user",),
}


@dataclass(frozen=True, slots=True)
class CgroupWorkload:
    """What a process's cgroup path says of it (readers/cgroups.py; empty: it says nothing):
    the innermost systemd unit (a user manager's as ``user@UID.service/NAME``) and slice,
    a container id (``docker://ID``, ...; bare where the layout does not say the runtime),
    a Kubernetes pod uid, a Slurm job id."""

    cgroup: str = ""
    unit: str = ""
    slice: str = ""
    container: str = ""
    pod: str = ""
    job: str = ""


@dataclass(frozen=True, slots=True)
class ProcessContext(CgroupWorkload):
    """Who a GPU process is, read from ``/proc`` once per process (readers/procinfo.py); text
    empty where not known.  `known` False: gone (or hidden) before it was read ("unknown")."""

    known: bool = True
    uid: int = -1
    user: str = ""
    comm: str = ""
    cmdline: str = ""
    #: ``/proc/PID/stat``'s start time when it was read (None: not read)
    started: int | None = None

    def workload(self, grouping: str = "auto") -> tuple[str, str]:
        if not self.known:
            return "unknown", "unknown"
        for kind in _WORKLOAD_ORDER.get(grouping, _WORKLOAD_ORDER["auto"]):
            value = self.user_name if kind == "user" else getattr(self, kind)
            if value:
                return kind, value
        return "unknown", "unknown"

    @property
    def user_name(self) -> str:
        """The user's name, else the uid as a number, else empty."""
        return self.user or (str(self.uid) if self.uid >= 0 else "")


#: a process gone, or not visible, before it could be read
UNKNOWN_CONTEXT = ProcessContext(known=False)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every device of one poll, in the order the reader discovered them; `contexts`, by pid,
    the processes read so far (a few new ones per poll: one may lack it for a poll or two)."""

    devices: tuple[DeviceSample, ...] = field(default_factory=tuple)
    contexts: Mapping[int, ProcessContext] = field(default_factory=dict)


#: process kinds: compute, graphics, and both (a pid that both lists name)
KINDS = ("C", "G", "C+G")
#: how a card in MIG mode is shown: each instance a device, or the card as one
MIG_MODES = ("instances", "card")


def mig_mode(value: str) -> str:
    """`value` if it is one of `MIG_MODES`; ValueError naming them if not."""
    if value not in MIG_MODES:
        raise ValueError(f"mig must be one of {', '.join(MIG_MODES)}, not {value!r}")
    return value


def merge_kind(first: str, second: str) -> str:
    """The kind of a pid listed as `first` and as `second`: "C+G" when they differ."""
    return "C+G" if first != second and first in KINDS and second in KINDS else first


def merge_processes(samples: Iterable[ProcessSample], memory: str = "first") -> tuple[ProcessSample, ...]:
    """One sample per pid, in the order pids are first listed; its kind merged, its busy
    figures the first entry's, its memory by `memory`: ``first``, ``max`` (one allocation
    listed under both kinds) or ``sum`` (a pid on two MIG instances holds memory on both)."""
    return tuple(merge_by_pid(samples, memory).values())


def merge_by_pid(samples: Iterable[ProcessSample], memory: str = "first") -> dict[int, ProcessSample]:
    """`merge_processes`, by pid (in the same order)."""
    found: dict[int, ProcessSample] = {}
    for sample in samples:
        seen = found.get(sample.pid)
        if seen is None:
            found[sample.pid] = sample
            continue
        if memory == "first" and seen.kind == sample.kind:
            continue
        held, more = seen.memory_kib, sample.memory_kib
        if memory == "sum":
            held = add_memory(held, more)
        elif memory == "max":
            held = None if held is None or more is None else max(held, more)
        found[sample.pid] = seen._replace(kind=merge_kind(seen.kind, sample.kind), memory_kib=held)
    return found


def fold_instances(
    key: str,
    busid: str,
    name: str,
    instances: Iterable[DeviceSample],
    task_support: int = TASK_COMPUTE | TASK_GRAPHICS,
    info: DeviceInfo = NO_INFO,
) -> DeviceSample:
    """A card in MIG mode shown as one device (``--mig card``): its instances' memory
    summed, their processes merged (a pid on two instances holds memory on both),
    no utilization of its own.  An instance that is not present no longer counts;
    if one's process list could not be read, neither can the card's."""
    parts = [part for part in instances if part.present]
    total = total_of([part.memory_total_kib for part in parts])
    lists = [part.processes for part in parts]
    return DeviceSample(
        key,
        busid,
        name,
        task_support,  # no utilization of its own: gpu_busy and mem_busy UNSUPPORTED
        memory_total_kib=total,
        memory_used_kib=total_of([part.memory_used_kib for part in parts]),
        # free and reserved: summed where every instance reports them
        memory_free_kib=total_of([part.memory_free_kib for part in parts]) if total else None,
        memory_reserved_kib=total_of([part.memory_reserved_kib for part in parts]) if total else None,
        processes=None if None in lists else merge_processes([p for ps in lists for p in ps or ()], "sum"),
        info=info,
    )


def total_of(values: Sequence[int | None]) -> int | None:
    """The sum of figures; None (failed) if any of them is."""
    known = [value for value in values if value is not None]
    return None if len(known) < len(values) else sum(known)


def add_memory(first: int | None, second: int | None) -> int | None:
    """Two memory figures of one process added: failed (None) or unknown (-1) if either is."""
    if first is None or second is None:
        return None
    if first == UNSUPPORTED or second == UNSUPPORTED:
        return UNSUPPORTED
    return first + second


def clamp_percent(value: int | float | None) -> int | None:
    """A percentage from a reader as an int in 0..100 (drivers have reported more:
    docs/fidelity.md), rounded, not truncated; ``None`` stays ``None``."""
    if value is None:
        return None
    if value < 0:
        return UNSUPPORTED
    return min(100, int(round(value)))
