"""tests/gpu/calibrate.py records GPM beside the sample buffer, on the simulator today (docs/fidelity.md,
"Calibration on a real GPU"): the whole GPU, and each GPU instance where the card is in MIG mode."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from atopgpud_tw.sim import parse_scenario, simulated_binding

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def _calibrate() -> Any:
    """The calibration kit as a module (it is a script, not a test module)."""
    spec = importlib.util.spec_from_file_location("calibrate_kit", GPU_TESTS / "calibrate.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("calibrate_kit")
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["calibrate_kit"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def test_recorder_samples_gpm_per_gpu_instance_on_a_card_in_mig_mode_and_frees_its_buffers() -> None:
    """A card already in MIG mode: one GPM stream for the card and one per GPU instance, each a second's
    exact figures; nothing set on the card; every buffer freed at the end."""
    kit = _calibrate()
    scenario = parse_scenario({"gpus": [{"name": "NVIDIA H200", "gpm": True, "gpu_util": 30, "mig": [
        {"profile": "3g.71gb", "memory_total_mib": 70000, "gpu_instance": 2, "gpu_util": 60},
        {"profile": "1g.18gb", "memory_total_mib": 18000, "gpu_instance": 9, "gpu_util": 20}]}]})
    nvml = simulated_binding(scenario)  # on the monotonic clock, as the kit's own
    nvml.nvmlInit()
    recorder = kit.Recorder(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    for _ in range(3):
        recorder.gpm()
        time.sleep(0.15)  # GPM wants more than 100 ms between samples
    recorder.close()
    assert recorder.gpm_support["supported"] is True and recorder.gpm_support["mig_gpu_instances"] == [2, 9]
    figures = {(e["source"], e["at"] is not None): e["metrics"]["graphics"] for e in recorder.calls["gpm"]
               if "metrics" in e}
    assert figures == {("card", True): pytest.approx(30.0), ("gi 2", True): pytest.approx(60.0),
                       ("gi 9", True): pytest.approx(20.0)}
    assert nvml.nvmlLib.model.gpm_buffers == 0
    assert not any(name.startswith("nvmlGpmSet") or "Set" in name for name in nvml.nvmlLib.calls)


def test_recorder_notes_a_gpu_without_gpm_and_asks_once() -> None:
    """No GPM: said in the recording, no sample taken."""
    kit = _calibrate()
    nvml = simulated_binding(parse_scenario({"gpus": [{"gpu_util": 10}]}), clock=lambda: 1.0)
    nvml.nvmlInit()
    recorder = kit.Recorder(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    recorder.gpm()
    recorder.gpm()
    assert recorder.gpm_support["supported"] is False and recorder.calls["gpm"] == []
    assert nvml.nvmlLib.calls["nvmlGpmQueryDeviceSupport"] == 1


@pytest.mark.e2e
def test_calibration_on_the_simulator_records_gpm_beside_the_sample_buffer(tmp_path: Path) -> None:
    """calibrate.py --reader sim --short: GPM entries with metrics in the recording, and GPM's average in
    the summary near the truth of the busy spells."""
    result = subprocess.run(
        [sys.executable, str(GPU_TESTS / "calibrate.py"), "--reader", "sim", "--short", "--only", "c", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    recording = json.loads((tmp_path / "sim-c.json").read_text())
    assert recording["device"]["gpm"]["supported"] is True
    entries = [e for e in recording["calls"]["gpm"] if "metrics" in e]
    assert entries and all(e["source"] == "card" and e["span_s"] > 0.1 for e in entries)
    assert set(entries[0]["metrics"]) >= {"graphics", "sm", "sm_occupancy", "tensor", "dram"}
    (summary,) = json.loads((tmp_path / "summary.json").read_text())["workloads"]
    assert summary["gpm"] == pytest.approx(summary["truth_gpu"], abs=5)
    assert "GPM" in result.stdout
