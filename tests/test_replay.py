"""Calibration recordings: the script that makes them, and the simulator replaying them.

Every recording in tests/gpu/recordings/ is replayed through the NVML reader on a
simulated clock; the reader must report the known duty cycles of its workload,
for the GPU and per process.  Those of the simulator are made by
``tests/gpu/calibrate.py --reader sim``; one recorded on a real GPU is replayed
the same way once it is committed there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clocked import ClockedReader
from twisted.internet.task import Clock

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.sim import ScenarioError, load_scenario, parse_scenario, simulated_binding
from atopgpud_tw.sim.replay import FORMAT, load_recording

GPU_TESTS = Path(__file__).parent / "gpu"
RECORDINGS = sorted(
    path for path in (GPU_TESTS / "recordings").glob("*.json")
    if json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT
)
#: how far the reader's per-interval average may be from the truth, in percentage points
TOLERANCE = 2.0


def truth(recording: dict[str, Any], begin: float, end: float) -> dict[int, float]:
    """Per pid, the busy percentage over (begin, end] seconds after the start, from its spells."""
    start = recording["schedule"]["start"][0]
    out = {}
    for proc in recording["schedule"]["processes"]:
        busy = sum(
            max(0.0, min(stop[0] - start, end) - max(spell[0] - start, begin)) for spell, stop in proc["spells"]
        )
        out[proc["pid"]] = 100 * busy / (end - begin)
    return out


def test_there_is_a_recording_of_each_workload():
    """The simulator's recordings are committed, one per workload, small enough to keep."""
    names = {json.loads(p.read_text())["workload"]["name"] for p in RECORDINGS if p.name.startswith("sim-")}
    assert names == {"idle", "a", "b", "c"}
    assert sum(p.stat().st_size for p in RECORDINGS if p.name.startswith("sim-")) < 1_000_000


def replayed(path: Path) -> tuple[dict[str, Any], list[tuple[float, int, int, dict[int, tuple[int, int]]]]]:
    """The recording, and the board's counters before each poll a second apart (the first at 0.5 s)."""
    recording = json.loads(path.read_text(encoding="utf-8"))
    seconds = recording["schedule"]["seconds"]
    clock = Clock()
    clock.advance(0.5)
    board = Board()
    poller = PollerService(ClockedReader({"gpus": [{"replay": str(path)}]}, clock), board, 1.0, clock)
    poller.startService()
    seen = []
    while clock.seconds() < seconds:
        device = board.counters.devices[0]
        procs = {pid: (p.gpu_busy_cum, p.samples) for pid, p in device.processes.items()}
        seen.append((clock.seconds(), device.gpu_busy_total, device.samples, procs))
        clock.advance(1.0)
    poller.stopService()
    return recording, seen


def span(seen: list[Any]) -> tuple[Any, Any]:
    """From the first poll a second into the spells to the last within them."""
    return next(s for s in seen if s[0] >= 1.0), seen[-1]


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.name for p in RECORDINGS])
def test_replay_reports_the_gpus_duty_cycle(path):
    """Polled once a second, the reader's per-interval GPU average is the workload's duty cycle."""
    recording, seen = replayed(path)
    first, last = span(seen)
    expected = sum(truth(recording, first[0], last[0]).values())
    gpu = (last[1] - first[1]) / (last[2] - first[2])
    assert abs(gpu - expected) <= TOLERANCE, (gpu, expected)


#: real recordings whose per-process figures miss the truth, and why (docs/fidelity.md,
#: "Recorded on an NVIDIA H200"); strict: one that passes again fails here until it is taken off
PER_PROCESS_MISSES = {
    "h200-c.json": "the H200's own per-process samples give two processes alternating within one "
                   "200 ms sample 33.0 % and 51.3 % where they ran 29.5 % and 59.6 %",
    "h200-a.json": "replayed 22.7 % where the daemon on the GPU said 24.5 % (truth 24.8 %): not yet explained",
}


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.xfail(reason=PER_PROCESS_MISSES[path.name], strict=True))
    if path.name in PER_PROCESS_MISSES else path
    for path in RECORDINGS
], ids=[p.name for p in RECORDINGS])
def test_replay_reports_each_processs_duty_cycle(path):
    """Polled once a second, the reader's per-interval average of each workload process is its duty cycle."""
    recording, seen = replayed(path)
    first, last = span(seen)
    for pid, busy in truth(recording, first[0], last[0]).items():
        (cum_a, n_a), (cum_b, n_b) = first[3][pid], last[3][pid]
        figure = (cum_b - cum_a) / (n_b - n_a)
        assert abs(figure - busy) <= TOLERANCE, (pid, figure, busy)


def test_replay_answers_on_the_recordings_own_timestamps():
    """Samples come back with the recording's spacing, shifted onto the simulator's clock, once due."""
    path = next(p for p in RECORDINGS if p.name == "sim-c.json")
    recording = load_recording(path)
    clock = Clock()
    nvml = simulated_binding(parse_scenario({"gpus": [{"replay": str(path)}]}), clock=clock.seconds)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(3.0)
    _, samples = nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    model = nvml.nvmlLib.model  # the simulated driver beneath the binding
    shift = model._sample_base_us(model.scenario.gpus[0]) - recording.origin_us
    due = [(stamp + shift, value) for stamp, value in recording.gpu if stamp <= recording.origin_us + 3_000_000]
    assert [(s.timeStamp, s.sampleValue.uiVal) for s in samples] == due[-100:]
    newest = samples[-1].timeStamp
    with pytest.raises(nvml.NVMLError) as raised:
        nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, newest)
    assert raised.value.value == 6  # NOT_FOUND: nothing newer yet
    clock.advance(1.0)
    _, later = nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, newest)
    assert later and all(s.timeStamp > newest for s in later)
    assert {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)} == {
        proc["pid"] for proc in json.loads(path.read_text())["schedule"]["processes"]
    }
    assert nvml.nvmlDeviceGetName(handle) == recording.name
    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    expected = [entry for entry in recording.memory_v2 if entry[0] <= 4.0][-1]
    assert (v2.total, v2.used, v2.free, v2.reserved) == expected[1:]


def test_a_scenario_names_its_recording_relative_to_itself(tmp_path):
    """``replay`` is found beside the scenario file; the recording's name and memory stand."""
    recording = tmp_path / "rec.json"
    recording.write_text((GPU_TESTS / "recordings" / "sim-a.json").read_text())
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"gpus": [{"replay": "rec.json", "busid": "00000000:65:00.0"}]}))
    gpu = load_scenario(scenario).gpus[0]
    assert gpu.replay is not None and gpu.busid == "00000000:65:00.0"
    assert gpu.name == gpu.replay.name and gpu.memory_total_mib * 1048576 == gpu.replay.memory_total


@pytest.mark.parametrize(
    "gpu, message",
    [
        ({"replay": 7}, "gpus[0].replay must be the path of a recording"),
        ({"replay": "missing.json"}, "gpus[0].replay: "),
        ({"replay": "RECORDING", "processes": []}, "gpus[0].processes cannot be given with replay"),
        ({"replay": "RECORDING", "gpu_timeline": None}, "gpus[0].gpu_timeline cannot be given with replay"),
        ({"replay": "RECORDING", "sample_jitter_ms": 1}, "gpus[0].sample_jitter_ms cannot be given with replay"),
        ({"replay": "NOT_A_RECORDING"}, "not a calibration recording"),
    ],
)
def test_a_bad_replay_names_the_field(tmp_path, gpu, message):
    """The replay field is checked like the others: one line naming it."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"gpus": []}))
    if gpu["replay"] == "RECORDING":
        gpu["replay"] = str(RECORDINGS[0])
    elif gpu["replay"] == "NOT_A_RECORDING":
        gpu["replay"] = str(other)
    with pytest.raises(ScenarioError) as raised:
        parse_scenario({"gpus": [gpu]}, base=tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.e2e
def test_the_calibration_script_records_on_the_simulator(tmp_path):
    """calibrate.py --reader sim --short: the files, the schedule, every stream and the daemon's replies."""
    result = subprocess.run(
        [sys.executable, str(GPU_TESTS / "calibrate.py"), "--reader", "sim", "--short", "--only", "c", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim-c.json", "summary.json"]
    recording = json.loads((tmp_path / "sim-c.json").read_text())
    assert recording["format"] == FORMAT and recording["reader"] == "sim"
    schedule = recording["schedule"]
    assert [round(p["duty"]) for p in schedule["processes"]] == [30, 60]
    for proc in schedule["processes"]:
        assert proc["spells"] and all(len(spell) == 2 and len(spell[0]) == 3 for spell in proc["spells"])
    calls = recording["calls"]
    assert {c["type"] for c in calls["samples"] if c.get("samples")} == {"gpu", "memory"}
    assert any(c["stream"] == "buffer" for c in calls["samples"])
    streams = {(c["window"], c["mode"]) for c in calls["process_utilization"]}
    # the 5 s window is asked once in a short run, maybe before any sample has shown the driver's clock
    assert streams >= {(w, m) for w in (0.2, 1.0) for m in ("last_seen", "now_minus_window")} | {(5.0, "last_seen")}
    pids = {p["pid"] for p in schedule["processes"]}
    assert {s[0] for c in calls["process_utilization"] for s in c.get("samples") or ()} == pids
    assert calls["rates"] and calls["memory"] and calls["processes"]
    assert all(len(c["at"]) == 3 for c in calls["rates"])
    replies = [r for r in recording["daemon"]["replies"] if r.get("stats")]
    assert replies and {p["pid"] for p in replies[-1]["stats"][0]["processes"]} == pids
    assert recording["host"]["symbols"]["nvmlDeviceGetSamples"] is True
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workloads"][0]["workload"] == "c"
    load_recording(tmp_path / "sim-c.json")  # replayable


def test_a_sample_returned_again_on_a_moved_stamp_is_replayed_once():
    """A real driver (an H200) gives a sample already returned on a stamp a few µs away when
    asked again; the replay keeps it once, so the GPU is not counted busy twice."""
    from atopgpud_tw.sim.replay import parse_recording

    data = json.loads((GPU_TESTS / "recordings" / "sim-b.json").read_text(encoding="utf-8"))
    plain = parse_recording(data)
    for call in data["calls"]["samples"]:
        if call.get("since") == 0 and call.get("samples"):  # the whole buffer, read again
            call["samples"] = [[stamp + 7, value] for stamp, value in call["samples"]]
    for call in data["calls"]["process_utilization"]:
        call["samples"] = [[pid, stamp - 3, *rest] for pid, stamp, *rest in call.get("samples") or ()] \
            + (call.get("samples") or [])
    moved = parse_recording(data)
    assert len(moved.gpu) == len(plain.gpu)
    assert len(moved.mem) == len(plain.mem)
    assert len(moved.processes) == len(plain.processes)
