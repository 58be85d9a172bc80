"""The nvidia-smi reader's health series: the same as NVML's, from every schema's element names."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from daemon import free_port, run_daemon, smi_stand_in
from prometheus_client.parser import text_string_to_metric_families

from atopgpud_tw.health import CardHealth
from atopgpud_tw.readers.smi.health import read_cards_health
from atopgpud_tw.readers.smi.report import read_report
from atopgpud_tw.server.web.metrics import FAMILIES

FIXTURE = Path(__file__).with_name("fixtures") / "smi" / "health-v13.xml"
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nvidia-smi"


def readings(path: Path) -> list[CardHealth]:
    root, _ = read_report(path.read_bytes())
    return read_cards_health(root)


def value(reading: CardHealth, name: str, **labels: str) -> float | None:
    for (metric, extra), found in reading.values.items():
        if metric == name and dict(extra) == labels:
            return found
    return None


def corpus(name: str) -> Path:
    if not CORPUS.is_dir():
        pytest.skip(f"the shared nvidia-smi corpus is not at {CORPUS}")
    return CORPUS / name


def test_own_fixture_gives_every_figure_the_report_has():
    """v13 names: instant power, current limit, event reasons, sram/dram ECC sums, remapped rows."""
    h100, rtx = readings(FIXTURE)
    assert value(h100, "atopgpud_gpu_temperature_celsius") == 67
    assert value(h100, "atopgpud_gpu_memory_temperature_celsius") == 71
    assert value(h100, "atopgpud_gpu_power_watts") == pytest.approx(612.40)
    assert value(h100, "atopgpud_gpu_power_limit_watts") == 700
    assert value(h100, "atopgpud_gpu_clock_hertz", clock="sm") == 1755e6
    assert value(h100, "atopgpud_gpu_clock_hertz", clock="memory") == 2619e6
    assert value(h100, "atopgpud_gpu_clocks_event_active", reason="sw_power_cap") == 1
    assert value(h100, "atopgpud_gpu_clocks_event_active", reason="hw_thermal_slowdown") == 1
    assert value(h100, "atopgpud_gpu_clocks_event_active", reason="gpu_idle") == 0
    assert value(h100, "atopgpud_gpu_clocks_event_active", reason="display_clock_setting") == 0
    assert value(h100, "atopgpud_gpu_clocks_event_active", reason="sync_boost") is None  # not in the report
    assert value(h100, "atopgpud_gpu_performance_state") == 2
    assert value(h100, "atopgpud_gpu_ecc_errors_total", error="corrected", counter="volatile") == 7
    assert value(h100, "atopgpud_gpu_ecc_errors_total", error="uncorrected", counter="volatile") == 2
    assert value(h100, "atopgpud_gpu_ecc_errors_total", error="corrected", counter="aggregate") is None
    assert value(h100, "atopgpud_gpu_remapped_rows", cause="correctable") == 3
    assert value(h100, "atopgpud_gpu_row_remap_pending") == 1
    assert value(h100, "atopgpud_gpu_row_remap_failed") == 0
    assert value(h100, "atopgpud_gpu_pcie_replays_total") == 12
    assert value(h100, "atopgpud_gpu_fan_speed_percent") is None
    # the old names, and values nvidia-smi cannot give
    assert value(rtx, "atopgpud_gpu_fan_speed_percent") == 41
    assert value(rtx, "atopgpud_gpu_power_watts") is None  # "Unknown Error"
    assert value(rtx, "atopgpud_gpu_power_limit_watts") == 350
    assert value(rtx, "atopgpud_gpu_clocks_event_active", reason="gpu_idle") == 1
    assert value(rtx, "atopgpud_gpu_performance_state") is None
    assert not any(metric == "atopgpud_gpu_ecc_errors_total" for metric, _ in rtx.values)
    assert not any(metric == "atopgpud_gpu_remapped_rows" for metric, _ in rtx.values)


@pytest.mark.parametrize("name, figures", [
    ("tesla-v100-sxm3-32gb-410.104.xml", {  # v10, single_bit/double_bit ECC, throttle reasons
        ("atopgpud_gpu_ecc_errors_total", (("error", "corrected"), ("counter", "volatile"))): 1,
        ("atopgpud_gpu_ecc_errors_total", (("error", "corrected"), ("counter", "aggregate"))): 291,
        ("atopgpud_gpu_ecc_errors_total", (("error", "uncorrected"), ("counter", "aggregate"))): 7627,
        ("atopgpud_gpu_power_watts", ()): 50.6,
        ("atopgpud_gpu_clocks_event_active", (("reason", "gpu_idle"),)): 1,
    }),
    ("tesla-p100-pcie-16gb-510.47.03.xml", {  # v11, sram/dram ECC
        ("atopgpud_gpu_ecc_errors_total", (("error", "corrected"), ("counter", "aggregate"))): 3,
        ("atopgpud_gpu_temperature_celsius", ()): 38,
    }),
    ("quadro-p2000-525.125.06.xml", {  # v12 in the old layout
        ("atopgpud_gpu_power_watts", ()): 4.61,
        ("atopgpud_gpu_power_limit_watts", ()): 75,
        ("atopgpud_gpu_performance_state", ()): 8,
    }),
    ("h100-80gb-hbm3-x8-570.86.15.xml", {  # v12 new layout, power_draw under gpu_power_readings
        ("atopgpud_gpu_power_watts", ()): 70.93,
        ("atopgpud_gpu_power_limit_watts", ()): 700,
        ("atopgpud_gpu_remapped_rows", (("cause", "correctable"),)): 0,
        ("atopgpud_gpu_row_remap_pending", ()): 0,
    }),
    ("geforce-rtx-2070-x2-590.44.01.xml", {  # v13: instant_power_draw
        ("atopgpud_gpu_power_watts", ()): 9.23,
        ("atopgpud_gpu_power_limit_watts", ()): 175,
    }),
])
def test_corpus_reports_give_their_figures(name, figures):
    """Real reports of v10 to v13 give the figures under each schema's names."""
    first = readings(corpus(name))[0]
    for series, expected in figures.items():
        assert first.values.get(series) == pytest.approx(expected), series


def test_every_corpus_report_gives_only_known_series_and_no_fake_values():
    """No report gives a negative value or a series the page does not list; a 1-GPU report gives one card."""
    for path in sorted(corpus(".").glob("*.xml")):
        found = readings(path)
        assert found, path.name
        for reading in found:
            assert reading.busid and not reading.lost
            for (metric, _), figure in reading.values.items():
                assert metric in FAMILIES, (path.name, metric)
                assert figure >= 0, (path.name, metric)


@pytest.mark.e2e
def test_daemon_on_nvidia_smi_serves_the_health_series(tmp_path):
    """--reader nvidia-smi: /metrics has the report's health figures, with no XID series."""
    port = free_port()
    binary = smi_stand_in(tmp_path, FIXTURE)
    with run_daemon(tmp_path, ["--reader", "nvidia-smi", "--nvidia-smi", str(binary), "--interval", "0.5",
                    "--metrics", f"tcp:{port}:interface=127.0.0.1"]) as daemon:
        daemon.wait_samples(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
        page = {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}
        h100 = frozenset({("busid", "00000000:17:00.0"), ("type", "NVIDIA H100 80GB HBM3"),
                          ("uuid", "GPU-11111111-2222-3333-4444-555555555555")})
        assert page[("atopgpud_gpu_power_watts", h100)] == pytest.approx(612.40)
        assert page[("atopgpud_gpu_health_stale", h100)] == 0
        assert not any(name.startswith("atopgpud_gpu_xid") for name, _ in page)


def test_implausible_values_are_left_out():
    """A garbled report (a temperature of 10^6 C, a fan at 250 %) gives no series for those figures."""
    text = FIXTURE.read_text().replace("<gpu_temp>67 C</gpu_temp>", "<gpu_temp>1000000 C</gpu_temp>")
    text = text.replace("<fan_speed>41 %</fan_speed>", "<fan_speed>250 %</fan_speed>")
    root, _ = read_report(text.encode())
    h100, rtx = read_cards_health(root)
    assert value(h100, "atopgpud_gpu_temperature_celsius") is None
    assert value(h100, "atopgpud_gpu_power_watts") == pytest.approx(612.40)
    assert value(rtx, "atopgpud_gpu_fan_speed_percent") is None
