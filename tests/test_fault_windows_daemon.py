"""Fault windows through the installed daemon: once a fault passes, atop's arithmetic is the load again.

One daemon on the simulator (the real pynvml over the simulated library),
polling every 0.5 s, with a GPU per fault: a call failing with an error for
one poll or for ten.  A client connected from the start asks ``S`` at every
poll (it would hear of every exit); after the last fault, atop's arithmetic
over a few seconds must be the constant load on every GPU and for every
process, ``T`` must say task support 3 everywhere, and only a lost GPU's
processes may have ended.
"""

from __future__ import annotations

import time

import pytest
from daemon import run_daemon

from atopgpud_tw import codec

INTERVAL = 0.5
FROM = 3.0
#: (call, error, polls)
FAULTS = [
    *((call, error, 10) for call in (
        "nvmlDeviceGetSamples", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetMemoryInfo",
    ) for error in ("NOT_SUPPORTED", "UNKNOWN")),
    *((call, error, 1) for call in ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization")
      for error in ("TIMEOUT", "NOT_FOUND", "GPU_IS_LOST")),
]
GPU_BUSY, MEM_BUSY = 40, 10
#: pid offset per GPU -> (kind, SM busy)
PROCESSES = {0: ("C", 30), 1: ("G", 20)}


def scenario() -> dict:
    gpus = []
    for index, (call, error, polls) in enumerate([*FAULTS, ("none", "none", 0)]):
        faults = [] if call == "none" else [{
            "call": call, "error": f"NVML_ERROR_{error}", "from": FROM, "until": FROM + polls * INTERVAL - 0.1,
        }]
        gpus.append({
            "busid": f"00000000:{0x10 + index:02X}:00.0",
            "gpu_util": GPU_BUSY,
            "mem_util": MEM_BUSY,
            "memory_used_mib": 2048,
            "samples_supported": call != "nvmlDeviceGetUtilizationRates",
            "processes": [
                {"pid": 1000 * (index + 1) + offset, "type": kind, "memory_mib": 64, "sm_util": sm, "mem_util": 2}
                for offset, (kind, sm) in PROCESSES.items()
            ],
            "faults": faults,
        })
    return {"gpus": gpus}


@pytest.mark.e2e
def test_faults_leave_nothing_behind_through_the_daemon(tmp_path):
    cards = scenario()["gpus"]
    with run_daemon(tmp_path, ["--interval", str(INTERVAL)], scenario={"gpus": cards}) as daemon:
        client = daemon.client()
        started = time.monotonic()
        exits: list[tuple[int, int]] = []

        def ask() -> list[codec.DeviceStats]:
            stats = client.stats()
            exits.extend((index, p.pid) for index, d in enumerate(stats) for p in d.processes if p.state == "E")
            return stats

        ask()
        end = FROM + 10 * INTERVAL
        while time.monotonic() - started < end + 1.5:
            time.sleep(INTERVAL / 2)
            ask()
        first = ask()
        while time.monotonic() - started < end + 5.5:
            time.sleep(INTERVAL / 2)
            ask()
        last = ask()
        types = client.types()
        client.close()
        log = daemon.log()
    assert len(first) == len(last) == len(cards) == len(types)
    lost = {index for index, (_, error, _) in enumerate(FAULTS) if error == "GPU_IS_LOST"}
    assert {index for index, _ in exits} <= lost, f"false exits {exits}"
    for index, (before, after) in enumerate(zip(first, last)):
        where = f"GPU {index}: {(FAULTS + [('none', '', 0)])[index]}"
        assert types[index].task_support == 3, where
        samples = after.samples - before.samples
        assert samples >= 6, where
        assert abs((after.gpu_busy_cum - before.gpu_busy_cum) / samples - GPU_BUSY) <= 1, where
        assert abs((after.mem_busy_cum - before.mem_busy_cum) / samples - MEM_BUSY) <= 1, where
        earlier = {p.pid: p for p in before.processes if p.state == "A"}
        active = [p for p in after.processes if p.state == "A"]
        assert sorted(p.pid for p in active) == [1000 * (index + 1) + offset for offset in PROCESSES], where
        for proc in active:
            old = earlier[proc.pid]
            busy = (proc.gpu_busy - old.gpu_busy) / (proc.samples - old.samples)
            assert abs(busy - PROCESSES[proc.pid % 1000][1]) <= 1, f"{where}: pid {proc.pid} at {busy}"
    assert "Traceback" not in log
    assert "taken as not supported" not in log  # no fault here lasted long enough to be believed
