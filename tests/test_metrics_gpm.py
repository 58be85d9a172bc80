"""GPM on ``/metrics`` (exact cumulative counters per GPU and per MIG instance) and ``atopgpu --gpm``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from typing import Any

import pytest
from daemon import free_port, run_daemon
from prometheus_client.parser import text_string_to_metric_families

from atopgpud_tw.atopgpu import cli
from atopgpud_tw.atopgpu.health import gpm_report, render_gpm
from atopgpud_tw.counters import Counters
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import gpm_families
from atopgpud_tw.snapshot import DeviceSample, GpmFigures, Snapshot

SCENARIO = {"gpus": [
    {"name": "NVIDIA H200", "gpu_timeline": {"period": 0.2, "busy": [[0, 0.05]]}, "mem_util": 40,
     "samples_supported": False,
     "gpm": {"sm_share": 0.8, "tensor_share": 0.5, "pcie_tx_mib_s": 400, "nvlink_rx_mib_s": 100}},
    {"name": "NVIDIA H200", "gpm": True, "mig": [
        {"profile": "3g.71gb", "memory_total_mib": 70000, "gpu_instance": 2, "gpu_util": 60}]},
    {"name": "NVIDIA A100", "gpu_util": 10},
]}


def _board(*figures: GpmFigures | None) -> Board:
    counters = Counters()
    devices = tuple(DeviceSample(f"k{i}", f"0000:{i:02X}:00.0", "H200", gpm=f) for i, f in enumerate(figures))
    counters.fold(Snapshot(devices), 1.0, 0.0)
    board = Board.__new__(Board)
    board.counters = counters
    return board


def test_collector_has_no_families_on_a_host_without_gpm() -> None:
    """A host without GPM: not one GPM family (the page stays as it was)."""
    assert list(gpm_families(_board(None, None))) == []


def test_collector_exports_sums_of_devices_with_gpm_only() -> None:
    """Percent-seconds and bytes per device with GPM; a device without has no series."""
    families = {f.name: f for f in gpm_families(_board(
        GpmFigures(2.0, (("graphics", 50.0), ("pcie_tx", 1.0))), None))}
    assert [s.value for s in families["atopgpud_gpu_gpm_seconds"].samples] == [2.0]
    assert [s.value for s in families["atopgpud_gpu_gpm_graphics_percent_seconds"].samples] == [100.0]
    assert [s.value for s in families["atopgpud_gpu_gpm_pcie_transmit_bytes"].samples] == [2.0 * 1048576]
    assert families["atopgpud_gpu_gpm_sm_active_percent_seconds"].samples == []


def test_report_divides_the_increases_by_the_seconds_covered() -> None:
    """atopgpu --gpm's figures: increase of each counter over that of the seconds."""
    before = {("b", "t"): {"seconds": 10.0, "graphics": 200.0, "pcie_tx": 0.0}}
    after = {("b", "t"): {"seconds": 12.0, "graphics": 260.0, "pcie_tx": 4.0 * 1048576}}
    (gpu,) = gpm_report(before, after, "u")["gpus"]
    assert (gpu["graphics"], gpu["pcie_tx_mib_s"], gpu["sm"]) == (30.0, 2.0, None)
    assert "30.0%" in render_gpm(gpm_report(before, after, "u"))


def test_gpm_view_usage_and_no_daemon() -> None:
    """--gpm with --health is bad usage (2); no metrics page is exit status 1."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--gpm", "--health"])
    assert stopped.value.code == 2
    assert cli.main(["--gpm", "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics"]) == 1


def _page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _values(text: str, name: str) -> dict[str, float]:
    return {s.labels["busid"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


@pytest.mark.e2e
def test_gpm_counters_on_metrics_and_atopgpu_gpm_against_known_timelines(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The installed daemon on the simulator: rate() of the GPM counters is the timelines' average
    (25 % busy, SM 0.8 of it, PCIe 400 MiB/s while busy, the MIG instance 60 %); no series for the A100;
    atopgpu --gpm shows the same."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with run_daemon(tmp_path, ["--interval", "0.25", "--metrics", f"tcp:{port}:interface=127.0.0.1"],
                    scenario=SCENARIO) as daemon:
        daemon.wait_samples(4)
        first = _page(url)
        daemon.wait_samples(12)
        second = _page(url)
        assert cli.main(["--gpm", "--json", "--watch", "1", "--count", "1", "--metrics-url", url]) == 0
        doc = json.loads(capsys.readouterr().out)
    seconds = {k: v - _values(first, "atopgpud_gpu_gpm_seconds_total")[k]
               for k, v in _values(second, "atopgpud_gpu_gpm_seconds_total").items()}
    assert set(seconds) == {"00000000:17:00.0", "00000000:18:00.0/2.0"}
    assert all(span > 1.0 for span in seconds.values()), seconds

    def rate(name: str, busid: str) -> float:
        return (_values(second, name)[busid] - _values(first, name)[busid]) / seconds[busid]

    card, instance = "00000000:17:00.0", "00000000:18:00.0/2.0"
    assert rate("atopgpud_gpu_gpm_graphics_percent_seconds_total", card) == pytest.approx(25.0, abs=1.5)
    assert rate("atopgpud_gpu_gpm_sm_active_percent_seconds_total", card) == pytest.approx(20.0, abs=1.2)
    assert rate("atopgpud_gpu_gpm_dram_bandwidth_percent_seconds_total", card) == pytest.approx(40.0)
    assert rate("atopgpud_gpu_gpm_pcie_transmit_bytes_total", card) / 1048576 == pytest.approx(100.0, abs=6)
    assert rate("atopgpud_gpu_gpm_graphics_percent_seconds_total", instance) == pytest.approx(60.0)
    by_bus = {g["busid"]: g for g in doc["gpus"]}
    assert set(by_bus) == {card, instance}
    assert by_bus[instance]["graphics"] == pytest.approx(60.0, abs=0.1)
    assert by_bus[card]["graphics"] == pytest.approx(25.0, abs=3)
    assert by_bus[card]["nvlink_rx_mib_s"] == pytest.approx(25.0, abs=3)
    promtool = shutil.which("promtool")
    if promtool is not None or os.environ.get("CI") == "true":
        assert promtool is not None, "promtool is not installed (Debian package prometheus)"
        checked = subprocess.run([promtool, "check", "metrics"], input=second.encode(), capture_output=True,
                                 timeout=30)
        assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()
