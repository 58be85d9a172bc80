#!/usr/bin/env python3
"""Record what NVML and the daemon report while known duty-cycle workloads run on a GPU.

    tests/gpu/calibrate.py [OUTDIR] [--reader nvml|sim] [--short] [--seconds N] [--only a,b]

OUTDIR defaults to $OUT.  For each workload (`WORKLOADS`: idle; one process busy
25 % of every 400 ms; one busy 50 % of every 2 s; two at 30 % and 60 % of every
500 ms, never at the same time) it starts the workload processes as children (own
pids), starts the installed daemon on a unique abstract socket, and records for
the seconds the workload runs, plus a lead-in and a tail:

- every ``nvmlDeviceGetSamples`` result (GPU and memory sample types) since the
  last returned timestamp, once a second, and the whole buffer at the end;
- ``nvmlDeviceGetProcessUtilization`` for windows of 0.2, 1 and 5 s, each asked
  both with the last timestamp it returned and with now minus the window on the
  driver's clock; ``nvmlDeviceGetProcessesUtilizationInfo`` where it exists;
- ``nvmlDeviceGetUtilizationRates`` five times a second; memory info v1 and v2;
  the compute and graphics process lists;
- the daemon's T and S replies once a second (the project's own client code);
- one ``nvidia-smi -q -x`` report in the middle of the workload;
- where the GPU has GPU Performance Monitoring (GPM, Hopper and later:
  ``nvmlGpmQueryDeviceSupport``), one GPM sample of the whole GPU once a second
  beside the sample buffer, and the metrics between each sample and the one
  before (graphics, SM, occupancy, tensor, DRAM, PCIe, NVLink); and where the
  GPU is already in MIG mode, the same for each of its GPU instances
  (``nvmlGpmMigSampleGet``).  The summary compares GPM's graphics activity
  with the truth and with the sample buffer.

Every call carries the wall, monotonic and boot-time clocks at the call.  Each
workload process records when each busy spell began and ended by those clocks,
so a reader of the recording knows the truth.  One JSON file per workload
(``<reader>-<workload>.json``) and ``summary.json`` are written; a short table
compares what each source reported with the truth.

Busy means back-to-back matrix products (PyTorch, else CuPy) for the busy part of
each period, then sleep (``CALIBRATE_BACKEND``: ``torch``, ``cupy``, or ``sleep``,
which runs nothing on the GPU).  Nothing here changes a GPU setting: MIG mode
is read, never set, and GPM's streaming state is neither read nor set (its
samples are taken on request).

``--reader sim`` (or ``CALIBRATE_READER=sim``) records the same way from the
simulator (`atopgpud_tw.sim.simulated_binding`), with a scenario whose timelines
match the workloads, and the workload processes only sleep: no GPU, no PyTorch.
Such a recording can be replayed by the simulator (a GPU's ``replay`` field).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[2]
try:
    import atopgpud_tw  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from atopgpud_tw.atopgpu import connection as client  # noqa: E402
from atopgpud_tw.readers.nvml.calls import error_name  # noqa: E402
from atopgpud_tw.sim.replay import FORMAT, driver_offset_us  # noqa: E402

#: seconds between the recorder's ticks (the rates call and the 0.2 s windows)
TICK = 0.2
#: process-utilization windows in seconds, asked every so many ticks
WINDOWS = ((0.2, 1), (1.0, 5), (5.0, 25))
#: C symbols looked up in the driver's library
SYMBOLS = (
    "nvmlInit_v2",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetProcessesUtilizationInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetRunningProcessDetailList",
    "nvmlDeviceGetConfComputeMemSizeInfo",
    "nvmlDeviceGetAccountingStats",
    "nvmlGpmMetricsGet",
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmSampleFree",
)
#: GPM metrics recorded: name -> NVML_GPM_METRIC_* id (nvidia-ml-py's pynvml.py)
GPM_METRICS = {
    "graphics": 1, "sm": 2, "sm_occupancy": 3, "tensor": 5, "dram": 10,
    "pcie_tx_mib_s": 20, "pcie_rx_mib_s": 21, "nvlink_rx_mib_s": 60, "nvlink_tx_mib_s": 61,
}
#: nvmlValueType_t -> the nvmlValue_t member that holds it
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
GPU_SAMPLES, MEMORY_SAMPLES = 1, 2


@dataclass(frozen=True)
class Load:
    """One workload process: busy during `spells` (offsets in s) of every `period`."""

    period: float
    spells: tuple[tuple[float, float], ...]

    @property
    def duty(self) -> float:
        return 100 * sum(b - a for a, b in self.spells) / self.period


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    loads: tuple[Load, ...]


WORKLOADS = (
    Workload("idle", "no work: does the driver keep samples of idle periods?", ()),
    Workload("a", "one process busy 25 % of every 400 ms", (Load(0.4, ((0.0, 0.1),)),)),
    Workload("b", "one process busy 50 % of every 2 s", (Load(2.0, ((0.0, 1.0),)),)),
    Workload(
        "c",
        "two processes, 30 % and 60 % of every 500 ms, never busy at the same time",
        (Load(0.5, ((0.02, 0.17),)), Load(0.5, ((0.2, 0.5),))),
    ),
)


@dataclass(frozen=True)
class Timing:
    """Seconds per workload: idle lead-in, busy, idle tail."""

    lead: float
    seconds: float
    tail: float
    idle_seconds: float


FULL = Timing(lead=4.0, seconds=60.0, tail=4.0, idle_seconds=12.0)
SHORT = Timing(lead=0.6, seconds=2.4, tail=0.6, idle_seconds=1.0)
#: the whole run stops starting workloads after this many seconds
BUDGET = 450.0


def clocks() -> list[float | None]:
    """[wall, monotonic, boot time] now, in seconds (boot time None where there is none)."""
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    return [
        round(time.time(), 6),
        round(time.monotonic(), 6),
        None if boot is None else round(time.clock_gettime(boot), 6),
    ]


def sleep_until(deadline: float) -> None:
    """Sleep until time.monotonic() reaches `deadline`."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


# -- the workload processes --


class SleepBackend:
    """Busy means sleeping: the simulator's workloads."""

    info: dict[str, Any] = {"backend": "sleep"}

    def busy_until(self, deadline: float) -> None:
        sleep_until(deadline)


class MatmulBackend:
    """Back-to-back matrix products, a batch of about 2 ms each, two batches queued ahead."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "torch":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            self.lib = torch
            self.a, self.b, self.c = (torch.randn(4096, 4096, device="cuda") for _ in range(3))
            version = torch.__version__
        else:
            import cupy

            self.lib = cupy
            self.a, self.b, self.c = (cupy.random.standard_normal((4096, 4096), dtype="float32") for _ in range(3))
            version = cupy.__version__
        self.count = 1
        self.sync()
        for _ in range(3):
            self.launch()
        self.sync()
        began = time.perf_counter()
        for _ in range(20):
            self.launch()
        self.sync()
        per = (time.perf_counter() - began) / 20
        self.count = max(1, round(0.002 / per))
        self.batch = per * self.count
        self.info = {"backend": kind, "version": version, "matmul_s": per, "per_batch": self.count}

    def launch(self) -> Any:
        for _ in range(self.count):
            if self.kind == "torch":
                self.lib.mm(self.a, self.b, out=self.c)
            else:
                self.lib.matmul(self.a, self.b, out=self.c)
        event = self.lib.cuda.Event()
        event.record()
        return event

    def sync(self) -> None:
        if self.kind == "torch":
            self.lib.cuda.synchronize()
        else:
            self.lib.cuda.runtime.deviceSynchronize()

    def busy_until(self, deadline: float) -> None:
        pending: collections.deque[Any] = collections.deque()
        while time.monotonic() + (len(pending) + 1) * self.batch <= deadline:
            pending.append(self.launch())
            while len(pending) > 2:
                pending.popleft().synchronize()
        self.sync()


def make_backend(kind: str) -> Any:
    if kind == "sleep":
        return SleepBackend()
    errors = []
    for name in ("torch", "cupy") if kind == "auto" else (kind,):
        try:
            return MatmulBackend(name)
        except Exception as error:  # ImportError, no device, a CUDA error
            errors.append(f"{name}: {type(error).__name__}: {error}")
    raise RuntimeError("; ".join(errors))


def worker_main(spec: dict[str, Any]) -> None:
    """A workload process: ready, wait for the start time, run the spells, report them."""
    try:
        backend = make_backend(spec["backend"])
    except Exception as error:
        print(json.dumps({"ready": False, "error": str(error)}), flush=True)
        return
    print(json.dumps({"ready": True, "pid": os.getpid(), **backend.info}), flush=True)
    start = float(json.loads(sys.stdin.readline())["start"])
    period, stop = float(spec["period"]), start + float(spec["seconds"])
    spells = []
    k = 0
    while start + k * period < stop:
        for a, b in spec["spells"]:
            begin, end = start + k * period + a, start + k * period + b
            if begin >= stop:
                break
            sleep_until(begin)
            began = clocks()
            backend.busy_until(end)
            spells.append([began, clocks()])
        k += 1
    print(json.dumps({"done": True, "spells": spells}), flush=True)


class Workers:
    """The workload processes of one workload."""

    def __init__(self, loads: Sequence[Load], seconds: float, backend: str) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.info: list[dict[str, Any]] = []
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        for load in loads:
            spec = {"period": load.period, "spells": load.spells, "seconds": seconds, "backend": backend}
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            ))

    def ready(self, timeout: float = 120.0) -> None:
        for proc in self.procs:
            line = _readline(proc, timeout)
            info = json.loads(line) if line else {"ready": False, "error": "no answer"}
            if not info.get("ready"):
                raise RuntimeError(f"workload process {proc.pid}: {info.get('error')}")
            self.info.append(info)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def start(self, at: float) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"start": at}) + "\n")
            proc.stdin.flush()

    def spells(self, timeout: float) -> list[list[Any]]:
        out = []
        for proc in self.procs:
            line = _readline(proc, timeout)
            out.append(json.loads(line)["spells"] if line else [])
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's next JSON line within `timeout`, or '' (read in a thread, so a stuck
    child cannot hang the run); other output (a library's chatter) is skipped."""
    got: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                got.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


# -- the simulator's stand-in for the workloads --


def _shifted(spells: Iterable[tuple[float, float]], period: float, lead: float) -> list[list[float]]:
    """Spells moved later by `lead` within their period (split where they wrap)."""
    out = []
    for a, b in spells:
        start = (a + lead) % period
        end = start + (b - a)
        pieces = [(start, min(end, period))] + ([(0.0, end - period)] if end > period else [])
        out.extend([round(x, 9), round(y, 9)] for x, y in pieces if y - x > 1e-9)
    return sorted(out)


def sim_scenario(workload: Workload, pids: Sequence[int], timing: Timing, seconds: float,
                 for_daemon: bool = False) -> dict[str, Any]:
    """A scenario whose timelines are the workload's: busy at 100 %, memory at 40 %.

    The simulator's time 0 is when recording begins, `timing.lead` before the
    busy spells; the daemon's simulator starts at its own time, so its copy keeps
    the spells unshifted and its processes alive throughout.
    """
    lead = 0.0 if for_daemon else timing.lead
    period = workload.loads[0].period if workload.loads else 1.0
    assert all(load.period == period for load in workload.loads), "one period per workload"
    union = _shifted([s for load in workload.loads for s in load.spells], period, lead)
    processes = []
    for load, pid in zip(workload.loads, pids):
        busy = _shifted(load.spells, period, lead)
        proc: dict[str, Any] = {
            "pid": pid, "memory_mib": 200,
            "sm_timeline": {"period": period, "busy": busy},
            "mem_timeline": {"period": period, "busy": busy, "level": 40},
        }
        if not for_daemon:
            proc.update(start=lead, stop=lead + seconds)
        processes.append(proc)
    return {"gpus": [{
        "name": "NVIDIA Simulated GPU", "busid": "00000000:17:00.0",
        "uuid": "GPU-5111a7ed-0000-4000-8000-000000000000", "memory_total_mib": 81559,
        "memory_used_mib": 512 + 200 * len(pids),
        "gpu_timeline": {"period": period, "busy": union},
        "mem_timeline": {"period": period, "busy": union, "level": 40},
        "processes": processes,
        "gpm": {"sm_share": 0.8, "tensor_share": 0.5},
    }]}


# -- recording NVML --


def _error(error: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"error": error_name(error)}
    value = getattr(error, "value", None)
    if isinstance(value, int):
        out["code"] = value
    else:
        out["message"] = str(error)
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace").rstrip("\0") if isinstance(value, bytes) else str(value)


class Recorder:
    """Every NVML call of one workload, with the clocks at the call."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.calls: dict[str, list[dict[str, Any]]] = {
            "samples": [], "process_utilization": [], "processes_utilization_info": [],
            "rates": [], "memory": [], "processes": [], "gpm": [],
        }
        #: GPM: None until asked; then per source ("card", or "gi <id>") its [previous, spare, at]
        self.gpm_sources: dict[str, list[Any]] | None = None
        self.gpm_support: dict[str, Any] = {}
        #: the newest timestamp each stream got back (the lastSeenTimeStamp it asks with next)
        self.seen: dict[str, int] = collections.defaultdict(int)

    def _call(self, fn: Callable[[], Any], entry: dict[str, Any]) -> Any:
        entry["at"] = clocks()
        began = time.perf_counter()
        try:
            result = fn()
        except Exception as error:
            entry.update(_error(error))
            result = None
        entry["took"] = round(time.perf_counter() - began, 6)
        return result

    def driver_now_us(self) -> int | None:
        """Now on the driver's sample clock, from the smallest delay seen so far."""
        offset = driver_offset_us(self.calls["samples"])
        return None if offset is None else int(time.time() * 1_000_000) - offset

    def samples(self, kind: int, stream: str = "last_seen") -> None:
        name = "gpu" if kind == GPU_SAMPLES else "memory"
        since = self.seen[f"samples {name}"] if stream == "last_seen" else 0
        entry: dict[str, Any] = {"type": name, "stream": stream, "since": since}
        result = self._call(lambda: self.nvml.nvmlDeviceGetSamples(self.handle, kind, since), entry)
        if result is not None:
            value_type, found = result
            member = VALUE_MEMBERS.get(value_type, "uiVal")
            entry["value_type"] = value_type
            entry["samples"] = [
                [int(s.timeStamp), getattr(s.sampleValue, member, getattr(s.sampleValue, "uiVal", None))]
                for s in found
            ]
            if entry["samples"] and stream == "last_seen":
                self.seen[f"samples {name}"] = max(self.seen[f"samples {name}"],
                                                   max(s for s, _ in entry["samples"]))
        self.calls["samples"].append(entry)

    def process_utilization(self, window: float, mode: str) -> None:
        key = f"process {window}"
        if mode == "last_seen":
            since = self.seen[key]
        else:
            now = self.driver_now_us()
            if now is None:
                return
            since = now - int(window * 1_000_000)
        entry: dict[str, Any] = {"window": window, "mode": mode, "since": since}
        found = self._call(lambda: self.nvml.nvmlDeviceGetProcessUtilization(self.handle, since), entry)
        if found is not None:
            entry["samples"] = [
                [int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil), int(s.encUtil), int(s.decUtil)]
                for s in found
            ]
            if entry["samples"] and mode == "last_seen":
                self.seen[key] = max(self.seen[key], max(s[1] for s in entry["samples"]))
        self.calls["process_utilization"].append(entry)

    def processes_utilization_info(self) -> None:
        function = getattr(self.nvml, "nvmlDeviceGetProcessesUtilizationInfo", None)
        if function is None:
            return
        since = self.seen["info"]
        entry: dict[str, Any] = {"window": 1.0, "mode": "last_seen", "since": since}
        found = self._call(lambda: function(self.handle, since), entry)
        if found is not None:
            entry["samples"] = [
                [int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil), int(s.encUtil), int(s.decUtil),
                 int(s.jpgUtil), int(s.ofaUtil)]
                for s in found
            ]
            if entry["samples"]:
                self.seen["info"] = max(since, max(s[1] for s in entry["samples"]))
        self.calls["processes_utilization_info"].append(entry)

    def _gpm_setup(self) -> None:
        """Ask once whether the GPU has GPM and, read only, which GPU instances it is carved into."""
        self.gpm_sources = {}
        query = getattr(self.nvml, "nvmlGpmQueryDeviceSupport", None)
        if query is None:
            self.gpm_support = {"supported": False, "why": "the binding has no GPM"}
            return
        entry: dict[str, Any] = {}
        found = self._call(lambda: query(self.handle), entry)
        self.gpm_support = entry
        if found is None or not int(found.isSupportedDevice):
            entry["supported"] = False
            return
        entry["supported"] = True
        self.gpm_sources["card"] = [None, None, None]
        try:
            mig = int(self.nvml.nvmlDeviceGetMigMode(self.handle)[0]) == 1
        except Exception:
            mig = False
        instances = []
        if mig:
            for slot in range(int(self.nvml.nvmlDeviceGetMaxMigDeviceCount(self.handle))):
                try:
                    child = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(self.handle, slot)
                    instances.append(int(self.nvml.nvmlDeviceGetGpuInstanceId(child)))
                except Exception:
                    continue
        entry["mig_gpu_instances"] = sorted(set(instances))
        for gpu_instance in entry["mig_gpu_instances"]:
            self.gpm_sources[f"gi {gpu_instance}"] = [None, None, None]

    def gpm(self) -> None:
        """One GPM sample per source, and the metrics since the source's previous one."""
        if self.gpm_sources is None:
            self._gpm_setup()
        for source, state in (self.gpm_sources or {}).items():
            entry: dict[str, Any] = {"source": source}
            if state[1] is None:
                state[1] = self._call(self.nvml.nvmlGpmSampleAlloc, {})
                if state[1] is None:
                    continue
            if source == "card":
                taken = self._call(lambda b=state[1]: self.nvml.nvmlGpmSampleGet(self.handle, b), entry)
            else:
                gpu_instance = int(source.split()[1])
                taken = self._call(
                    lambda b=state[1], g=gpu_instance: self.nvml.nvmlGpmMigSampleGet(self.handle, g, b), entry)
            if taken is None:
                self.calls["gpm"].append(entry)
                continue
            at = entry["at"][1]
            if state[0] is not None and at - state[2] > 0.1:
                entry["span_s"] = round(at - state[2], 6)
                entry["metrics"] = self._gpm_metrics(state[0], state[1])
            if state[0] is None or "metrics" in entry:
                state[0], state[1], state[2] = state[1], state[0], at
            self.calls["gpm"].append(entry)

    def _gpm_metrics(self, first: Any, second: Any) -> dict[str, Any]:
        nvml = self.nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        for index, metric in enumerate(GPM_METRICS.values()):
            request.metrics[index].metricId = metric
        try:
            nvml.nvmlGpmMetricsGet(request)
        except Exception as error:
            return _error(error)
        out: dict[str, Any] = {}
        for index, name in enumerate(GPM_METRICS):
            entry = request.metrics[index]
            code = int(entry.nvmlReturn)
            out[name] = round(float(entry.value), 4) if code == 0 else {"code": code}
        return out

    def close(self) -> None:
        """Free the GPM sample buffers."""
        for state in (self.gpm_sources or {}).values():
            for buffer in state[:2]:
                if buffer is not None:
                    try:
                        self.nvml.nvmlGpmSampleFree(buffer)
                    except Exception:
                        pass
            state[0] = state[1] = None

    def rates(self) -> None:
        entry: dict[str, Any] = {}
        found = self._call(lambda: self.nvml.nvmlDeviceGetUtilizationRates(self.handle), entry)
        if found is not None:
            entry.update(gpu=int(found.gpu), memory=int(found.memory))
        self.calls["rates"].append(entry)

    def memory(self) -> None:
        entry: dict[str, Any] = {}
        v1: dict[str, Any] = {}
        found = self._call(lambda: self.nvml.nvmlDeviceGetMemoryInfo(self.handle), v1)
        if found is not None:
            v1.update(total=int(found.total), used=int(found.used), free=int(found.free))
        entry["at"], entry["v1"] = v1.pop("at"), v1
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        v2: dict[str, Any] = {}
        if version is None:
            v2["error"] = "the binding has no nvmlMemory_v2"
        else:
            found = self._call(lambda: self.nvml.nvmlDeviceGetMemoryInfo(self.handle, version=version), v2)
            if found is not None:
                v2.update({f: int(getattr(found, f)) for f in ("total", "reserved", "used", "free")})
        entry["v2"] = v2
        self.calls["memory"].append(entry)

    def processes(self) -> None:
        entry: dict[str, Any] = {"at": clocks()}
        for key, function in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("compute_v2", "nvmlDeviceGetComputeRunningProcesses_v2"),
        ):
            bound = getattr(self.nvml, function, None)
            if bound is None:
                continue
            part: dict[str, Any] = {}
            found = self._call(lambda bound=bound: bound(self.handle), part)
            if found is None:
                entry[key] = {k: v for k, v in part.items() if k != "at"}
            else:
                entry[key] = [[int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)]
                              for p in found]
        self.calls["processes"].append(entry)


# -- the daemon --


class DaemonWatch:
    """The installed daemon on a unique abstract socket, and its replies."""

    def __init__(self, reader: str, workdir: Path, scenario: dict[str, Any] | None) -> None:
        self.name = f"atopgpud-calibrate-{uuid.uuid4().hex[:10]}"
        installed = Path(sys.executable).with_name("atopgpud")
        command = [str(installed)] if installed.exists() else [sys.executable, "-m", "atopgpud_tw"]
        args = ["--reader", reader, "--listen", f"unix:@{self.name}"]
        if scenario is not None:
            path = workdir / f"{self.name}.json"
            path.write_text(json.dumps(scenario))
            args += ["--scenario", str(path)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
        self.command = command + args
        self.log_path = workdir / f"{self.name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        self.connection: client.Connection | None = None
        self.replies: list[dict[str, Any]] = []

    def wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with client.Connection(client.parse_endpoint(f"unix:@{self.name}")) as probe:
                    probe.ask("T", 2)
                return True
            except client.ClientError:
                time.sleep(0.05)
        return False

    def fetch(self) -> None:
        entry: dict[str, Any] = {"at": clocks()}
        try:
            if self.connection is None:
                self.connection = client.Connection(client.parse_endpoint(f"unix:@{self.name}"))
            reading = client.take_reading(self.connection, 2)
            entry["types"] = [asdict(t) for t in reading.types]
            entry["stats"] = [asdict(s) for s in reading.stats]
        except client.ClientError as error:
            entry["error"] = str(error)
            if self.connection is not None:
                self.connection.close()
            self.connection = None
        self.replies.append(entry)

    def stop(self) -> dict[str, Any]:
        if self.connection is not None:
            self.connection.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        log = self.log_path.read_text(errors="replace")
        return {"command": self.command, "exit_status": self.proc.returncode,
                "log": log[-20000:], "replies": self.replies}


class Smi:
    """One ``nvidia-smi -q -x`` in the background (None on the simulator or without it)."""

    def __init__(self, reader: str) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.reason = "the simulator" if reader == "sim" else "nvidia-smi is not installed"
        self.at: list[float | None] | None = None

    def start(self) -> None:
        tool = shutil.which("nvidia-smi")
        if self.reason == "the simulator" or tool is None:
            return
        self.at = clocks()
        self.proc = subprocess.Popen([tool, "-q", "-x"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result(self) -> dict[str, Any]:
        if self.proc is None:
            return {"report": None, "why": self.reason}
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            return {"at": self.at, "report": out, "why": "timed out after 30 s"}
        return {"at": self.at, "report": out, "exit_status": self.proc.returncode}


# -- one workload --


def host_info(nvml: Any, reader: str) -> dict[str, Any]:
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "reader": reader, "clocks": clocks(), "python": sys.version.split()[0],
        "platform": platform.platform(), "kernel": platform.release(),
        "packages": {p: version(p) for p in ("nvidia-ml-py", "torch", "cupy-cuda13x", "cupy-cuda12x", "twisted")},
    }
    for key, function in (("driver", "nvmlSystemGetDriverVersion"), ("nvml", "nvmlSystemGetNVMLVersion"),
                          ("cuda_driver", "nvmlSystemGetCudaDriverVersion"), ("device_count", "nvmlDeviceGetCount")):
        bound = getattr(nvml, function, None)
        if bound is not None:
            try:
                info[key] = _text(bound())
            except Exception as error:
                info[key] = _error(error)
    pointer = getattr(nvml, "_nvmlGetFunctionPointer", None)
    symbols: dict[str, bool] = {}
    for name in SYMBOLS:
        if pointer is None:
            symbols[name] = hasattr(nvml, name)
        else:
            try:
                pointer(name)
                symbols[name] = True
            except Exception:
                symbols[name] = False
    info["symbols"] = symbols
    if pointer is None:
        info["symbols_from"] = "the binding's attributes"
    else:
        info["symbols_from"] = "the simulated library" if reader == "sim" else "the driver's library"
    return info


def device_info(nvml: Any, handle: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0}
    for key, call in (("name", lambda: _text(nvml.nvmlDeviceGetName(handle))),
                      ("uuid", lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
                      ("busid", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
                      ("memory_total", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total)),
                      ("mig_mode", lambda: list(nvml.nvmlDeviceGetMigMode(handle)))):
        try:
            out[key] = call()
        except Exception as error:
            out[key] = None
            out[f"{key}_error"] = _error(error)
    return out


def record_workload(workload: Workload, reader: str, timing: Timing, seconds: float,
                    host: dict[str, Any], workdir: Path, nvml_module: Any) -> dict[str, Any]:
    """Run one workload and record it; the recording as a JSON-ready dict."""
    backend = "sleep" if reader == "sim" else os.environ.get("CALIBRATE_BACKEND", "auto")
    workers = Workers(workload.loads, seconds, backend)
    daemon = None
    try:
        workers.ready()
        daemon_scenario = sim_scenario(workload, workers.pids, timing, seconds, True) if reader == "sim" else None
        daemon = DaemonWatch(reader, workdir, daemon_scenario)
        daemon_ready = daemon.wait_ready()
        begin = time.monotonic()
        if reader == "sim":
            from atopgpud_tw.sim import parse_scenario, simulated_binding

            nvml = simulated_binding(parse_scenario(sim_scenario(workload, workers.pids, timing, seconds)),
                                     clock=lambda: time.monotonic() - begin)
            nvml.nvmlInit()
        else:
            nvml = nvml_module
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        recorder = Recorder(nvml, handle)
        start_at = begin + timing.lead
        end_at = start_at + seconds
        until = end_at + timing.tail
        workers.start(start_at)
        smi = Smi(reader)
        start_clocks = end_clocks = None
        k = 0
        while True:
            due = begin + k * TICK
            if due > until:
                break
            sleep_until(due)
            if start_clocks is None and time.monotonic() >= start_at:
                start_clocks = clocks()
            if end_clocks is None and time.monotonic() >= end_at:
                end_clocks = clocks()
            if smi.proc is None and smi.at is None and time.monotonic() >= start_at + seconds / 2:
                smi.start()
            if k % 5 == 0:
                recorder.samples(GPU_SAMPLES)
                recorder.samples(MEMORY_SAMPLES)
                recorder.memory()
                recorder.processes()
                recorder.processes_utilization_info()
                recorder.gpm()
                if daemon_ready:
                    daemon.fetch()
            recorder.rates()
            for window, every in WINDOWS:
                if k % every == 0:
                    recorder.process_utilization(window, "last_seen")
                    recorder.process_utilization(window, "now_minus_window")
            # a slow call must not make the ticks pile up: go on at the next one due
            k = max(k + 1, int((time.monotonic() - begin) / TICK) + 1)
        recorder.samples(GPU_SAMPLES, "buffer")
        recorder.samples(MEMORY_SAMPLES, "buffer")
        recorder.close()
        spells = workers.spells(timeout=30)
        done = clocks()
        mono_offset = time.time() - time.monotonic()
        schedule = {
            "lead": timing.lead, "seconds": seconds, "tail": timing.tail,
            "recording_began": [round(begin + mono_offset, 6), round(begin, 6), None],
            "start": start_clocks or _planned(start_at), "end": end_clocks or _planned(end_at),
            "recorded_until": done,
            "planned": {"start_monotonic": round(start_at, 6), "end_monotonic": round(end_at, 6)},
            "processes": [
                {"pid": pid, "period": load.period, "spells_offsets": load.spells, "duty": round(load.duty, 6),
                 "worker": info, "spells": spell}
                for pid, load, info, spell in zip(workers.pids, workload.loads, workers.info, spells)
            ],
        }
        return {
            "format": FORMAT, "reader": reader, "host": host,
            "device": {**device_info(nvml, handle), "gpm": recorder.gpm_support},
            "workload": {"name": workload.name, "description": workload.description},
            "schedule": schedule,
            "driver_offset_us": driver_offset_us(recorder.calls["samples"]),
            "calls": recorder.calls,
            "daemon": {"ready": daemon_ready, **daemon.stop()},
            "nvidia_smi": smi.result(),
            "clock_fields": "at: [wall, monotonic, boot time] seconds at the call; took: seconds",
        }
    finally:
        workers.stop()
        if daemon is not None and daemon.proc.poll() is None:
            daemon.stop()


def _planned(at: float) -> list[float | None]:
    return [round(at + time.time() - time.monotonic(), 6), round(at, 6), None]


# -- what the recording says against the truth --


def summarise(recording: dict[str, Any]) -> dict[str, Any]:
    """Busy percentages over the busy spells' span from each source, against the truth."""
    schedule = recording["schedule"]
    start, end = schedule["start"][0], schedule["end"][0]
    offset = recording.get("driver_offset_us") or 0
    span = max(1e-9, end - start)

    def in_span(stamp_us: int) -> bool:
        wall = (stamp_us + offset) / 1e6
        return start < wall <= end

    gpu: dict[int, float] = {}
    for call in recording["calls"]["samples"]:
        if call["type"] == "gpu":
            gpu.update({s: v for s, v in call.get("samples") or () if in_span(s)})
    stamps = sorted(gpu)
    periods = len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    answers = recording["calls"]["process_utilization"]
    listing = process_listing(answers)
    per_pid: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for call in answers:
        for pid, stamp, sm, *_ in call.get("samples") or ():
            if in_span(stamp):
                per_pid[pid][stamp] = sm
    # a driver that answers once per process and call: its 1 s windows' figures, averaged
    windows = [c for c in answers if c["window"] == 1.0 and c["mode"] == "now_minus_window"
               and start < c["at"][0] <= end and ("samples" in c or c.get("error") == "NVML_ERROR_NOT_FOUND")]
    rates = [c["gpu"] for c in recording["calls"]["rates"] if "gpu" in c and start < c["at"][0] <= end]
    replies = [r for r in recording["daemon"]["replies"] if r.get("stats")]
    first = next((r for r in replies if r["at"][0] >= start), None)
    last = next((r for r in reversed(replies) if r["at"][0] <= end), None)

    def daemon_average(pick: Callable[[dict[str, Any]], tuple[int, int] | None]) -> float | None:
        if first is None or last is None:
            return None
        a, b = pick(first), pick(last)
        if a is None or b is None or b[1] <= a[1]:
            return None
        return round((b[0] - a[0]) / (b[1] - a[1]), 2)

    def device_pick(reply: dict[str, Any]) -> tuple[int, int]:
        stats = reply["stats"][0]
        return stats["gpu_busy_cum"], stats["samples"]

    def process_pick(pid: int) -> Callable[[dict[str, Any]], tuple[int, int] | None]:
        def pick(reply: dict[str, Any]) -> tuple[int, int] | None:
            for proc in reply["stats"][0]["processes"]:
                if proc["pid"] == pid:
                    return proc["gpu_busy"], proc["samples"]
            return None
        return pick

    gpm = _gpm_means(recording["calls"].get("gpm") or (), start, end)
    processes = []
    truth_gpu = 0.0
    for proc in schedule["processes"]:
        busy = sum(max(0.0, min(e[0], end) - max(b[0], start)) for b, e in proc["spells"])
        truth = 100 * busy / span
        truth_gpu += truth
        samples = per_pid.get(proc["pid"], {})
        processes.append({
            "pid": proc["pid"], "duty": round(proc["duty"], 2), "truth": round(truth, 2),
            "nvml_samples": (
                round(sum(samples.values()) / periods, 2) if periods and listing != "per-call"
                else _window_mean(windows, proc["pid"])
            ),
            "daemon": daemon_average(process_pick(proc["pid"])),
        })
    return {
        "workload": recording["workload"]["name"], "seconds": round(span, 3),
        "truth_gpu": round(truth_gpu, 2),
        "nvml_samples": round(sum(gpu.values()) / periods, 2) if periods else None,
        "sample_period_s": round(min(gaps) / 1e6, 4) if gaps else None,
        "samples": periods,
        "process_listing": listing,
        "rates": round(sum(rates) / len(rates), 2) if rates else None,
        "daemon": daemon_average(device_pick),
        "gpm": gpm.get("card"),
        "gpm_instances": {k: v for k, v in gpm.items() if k != "card"},
        "processes": processes,
    }


def _gpm_means(entries: Iterable[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """Per GPM source, its graphics activity over the busy span: each metric's figure
    weighed by the seconds it covers, for the samples taken within the span (their
    previous sample too: the first second of the span is left out)."""
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for entry in entries:
        metrics, span = entry.get("metrics"), entry.get("span_s")
        if not isinstance(metrics, dict) or not span or not isinstance(metrics.get("graphics"), float):
            continue
        if start < entry["at"][0] - span and entry["at"][0] <= end:
            sums[entry["source"]][0] += metrics["graphics"] * span
            sums[entry["source"]][1] += span
    return {source: round(total / seconds, 2) for source, (total, seconds) in sums.items() if seconds}


def process_listing(answers: Sequence[dict[str, Any]]) -> str | None:
    """How the driver listed process utilization: ``per-period`` (a pid at several
    timestamps in one answer), ``per-call`` (never), or None (no process listed)."""
    listed = False
    for call in answers:
        stamps: dict[int, set[int]] = collections.defaultdict(set)
        for pid, stamp, *_ in call.get("samples") or ():
            stamps[pid].add(stamp)
        if any(len(found) > 1 for found in stamps.values()):
            return "per-period"
        listed = listed or bool(stamps)
    return "per-call" if listed else None


def _window_mean(windows: Sequence[dict[str, Any]], pid: int) -> float | None:
    """The mean of a pid's figure over answers for 1 s windows (0 where it is not listed)."""
    if not windows:
        return None
    figures = [max((s[2] for s in c.get("samples") or () if s[0] == pid), default=0) for c in windows]
    return round(sum(figures) / len(figures), 2)


def table(summaries: Sequence[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = [f"{'workload':9} {'what':11} {'truth':>6} {'samples':>8} {'rates':>6} {'daemon':>7} {'GPM':>6}  "
             "period  listing"]
    for s in summaries:
        lines.append(f"{s['workload']:9} {'GPU':11} {cell(s['truth_gpu']):>6} {cell(s['nvml_samples']):>8} "
                     f"{cell(s['rates']):>6} {cell(s['daemon']):>7} {cell(s.get('gpm')):>6}  "
                     f"{s['sample_period_s'] or '-':<6}  {s['process_listing'] or '-'}")
        for source, value in sorted((s.get("gpm_instances") or {}).items()):
            lines.append(f"{'':9} {'GPM ' + source:11} {'':>6} {'':>8} {'':>6} {'':>7} {cell(value):>6}")
        for p in s["processes"]:
            lines.append(f"{'':9} {'pid ' + str(p['pid']):11} {cell(p['truth']):>6} {cell(p['nvml_samples']):>8} "
                         f"{'':>6} {cell(p['daemon']):>7}")
    return "\n".join(lines)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """JSON with one call per line: small, and readable in a diff."""
    def dump(value: Any, depth: int) -> str:
        if isinstance(value, dict) and depth < 2:
            inner = ",\n".join(f"{json.dumps(k)}: {dump(v, depth + 1)}" for k, v in value.items())
            return "{\n" + inner + "\n}"
        if isinstance(value, list) and depth == 2 and value and isinstance(value[0], dict):
            return "[\n" + ",\n".join(json.dumps(v, separators=(",", ":")) for v in value) + "\n]"
        return json.dumps(value, separators=(",", ":"))

    path.write_text(dump(data, 0) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT"), help="output folder (default: $OUT)")
    parser.add_argument("--reader", choices=("nvml", "sim"), default=os.environ.get("CALIBRATE_READER", "nvml"))
    parser.add_argument("--short", action="store_true", help="seconds per workload, not a minute (tests)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per busy workload")
    parser.add_argument("--only", default=None, help="workloads to run, e.g. a,c")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return 0
    if not args.out:
        parser.error("name an output folder, or set OUT")
    # stopped from outside (a timeout): the workload processes and the daemon go too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timing = SHORT if args.short else FULL
    chosen = [w for w in WORKLOADS if args.only is None or w.name in args.only.split(",")]
    began = time.monotonic()
    if args.reader == "sim":
        from atopgpud_tw.sim import demo_scenario, simulated_binding

        nvml_module = None
        probe = simulated_binding(demo_scenario())
        probe.nvmlInit()
        host = host_info(probe, "sim")
    else:
        import pynvml

        nvml_module = pynvml
        pynvml.nvmlInit()
        host = host_info(pynvml, "nvml")
    summaries = []
    with tempfile.TemporaryDirectory(prefix="calibrate-") as workdir:
        for workload in chosen:
            seconds = timing.idle_seconds if not workload.loads else args.seconds or timing.seconds
            if time.monotonic() - began + seconds + timing.lead + timing.tail + 30 > BUDGET:
                print(f"{workload.name}: skipped, the run would pass {BUDGET:.0f} s", flush=True)
                continue
            print(f"{workload.name}: {workload.description} ({seconds:g} s)", flush=True)
            try:
                recording = record_workload(workload, args.reader, timing, seconds, host, Path(workdir),
                                            nvml_module)
            except Exception as error:
                print(f"{workload.name}: failed: {type(error).__name__}: {error}", flush=True)
                summaries.append({"workload": workload.name, "error": f"{type(error).__name__}: {error}"})
                continue
            write_json(out / f"{args.reader}-{workload.name}.json", recording)
            summaries.append(summarise(recording))
    write_json(out / "summary.json", {"format": "atopgpud-calibration-summary/1", "host": host,
                                      "workloads": summaries})
    print(table([s for s in summaries if "error" not in s]), flush=True)
    print(f"written to {out} in {time.monotonic() - began:.0f} s", flush=True)
    return 0 if all("error" not in s for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
