"""The table of figures: one row per figure, for both readers, the page, atopgpu and the simulator.

The newer figures (throttling as time, engines, PCIe throughput and link,
NVLink per link, video and maximum clocks, temperature thresholds, the time
of the last XID) are read through NVML on the simulator beneath the real
binding, and from real nvidia-smi reports; NOT_SUPPORTED leaves a figure out
and is not asked again.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pynvml
import pytest
from daemon import free_port, run_daemon, smi_stand_in
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_server import promtool
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from atopgpud_tw import figures
from atopgpud_tw.atopgpu.health import gpm_report, health_report, render_gpm, render_health
from atopgpud_tw.counters import Counters
from atopgpud_tw.health import CardHealth
from atopgpud_tw.readers.nvml.gpm import metrics
from atopgpud_tw.readers.nvml.health import read_card_health
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.nvml.support import HOLD_POLLS, HOLD_SECONDS
from atopgpud_tw.readers.smi.health import read_cards_health
from atopgpud_tw.readers.smi.report import read_report
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import FAMILIES, GPM_SERIES, Families, HealthCache, gpm_families, health_families
from atopgpud_tw.sim import ScenarioError, parse_scenario, simulated_binding
from atopgpud_tw.sim.library_symbols import HEALTH_SYMBOLS
from atopgpud_tw.sim.nvml import GPM_PLAYED as PLAYED
from atopgpud_tw.sim.scenario import GPM_FIELDS, parse_gpm
from atopgpud_tw.sim.scenario import HEALTH_FIELDS as FIELDS
from atopgpud_tw.snapshot import DeviceSample, GpmFigures, Snapshot

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nvidia-smi"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
NEW = {
    "clocks_event_sw_power_cap_s": 12.5, "clocks_event_hw_thermal_slowdown_s": {"steps": [[0, 0], [5, 3]]},
    "violation_power_s": 2.25, "violation_thermal_s": 0,
    "encoder_percent": 35, "decoder_percent": 10, "jpeg_percent": 0,
    "pcie_tx_kib_s": 500, "pcie_rx_kib_s": 341, "pcie_link_generation": 4, "pcie_link_width": 16,
    "video_clock_mhz": 765, "max_sm_clock_mhz": 1980, "max_video_clock_mhz": 1545,
    "temperature_shutdown_c": 92, "temperature_slowdown_c": 89, "temperature_gpu_max_c": 87,
    "nvlink": [{"tx_kib_per_s": 1000, "rx_kib_per_s": 2000, "replay_errors": 3}, {"active": False},
               {"crc_flit_errors": None}],
}
SCENARIO = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "health": NEW}, {"name": "NVIDIA GeForce RTX 3090"}]}


def reader_at(t: list[float], scenario: dict = SCENARIO) -> NvmlReader:
    reader = NvmlReader(simulated_binding(parse_scenario(scenario), clock=lambda: t[0]), reactor=None)
    reader.open()
    return reader


def value(reading: CardHealth, name: str, **labels: str) -> float | None:
    for (metric, extra), found in reading.values.items():
        if metric == name and dict(extra) == labels:
            return found
    return None


def corpus(name: str) -> CardHealth:
    if not CORPUS.is_dir():
        pytest.skip(f"the shared nvidia-smi corpus is not at {CORPUS}")
    root, _ = read_report((CORPUS / name).read_bytes())
    return read_cards_health(root)[0]


def test_every_row_is_one_series_with_its_familys_labels():
    """No two rows are one series; each row's labels are its family's (a per-link row's but ``link``)."""
    seen = set()
    for figure in figures.FIGURES:
        assert figure.series not in seen, figure.series
        seen.add(figure.series)
        names = tuple(name for name, _ in figure.labels)
        per_link = bool(figure.nvml and figure.nvml.per_link)
        assert names == tuple(n for n in figure.family.labels if n != "link" or not per_link), figure.series
        assert figure.family.kind in ("gauge", "counter")
        assert figure.family.name.endswith("_total") == (figure.family.kind == "counter"), figure.family.name
    assert list(FAMILIES) == list(figures.families())


def test_the_derived_tables_come_from_the_rows():
    """The page's families, the simulator's fields and symbols are the table's."""
    assert set(FAMILIES) == {figure.family.name for figure in figures.FIGURES}
    assert set(FIELDS) == set(figures.played_fields())
    for figure in figures.FIGURES:
        if figure.nvml is not None:
            assert figure.nvml.function in HEALTH_SYMBOLS


def test_every_figure_is_documented_with_its_nvml_call():
    """docs/metrics.md names every family, and every NVML function the table calls."""
    text = DOCS.read_text()
    for figure in figures.FIGURES:
        assert f"`{figure.family.name}`" in text, figure.family.name
        if figure.nvml is not None:
            assert figure.nvml.function in text, figure.nvml.function
    assert "`atopgpud_gpu_xid_last_seconds`" in text
    assert "docs.nvidia.com/deploy/nvml-api" in text


def test_new_figures_through_nvml_on_the_simulator():
    """Each new figure reaches its series in base units: seconds, percent, bytes, hertz, degrees."""
    t = [10.0]
    reader = reader_at(t)
    h100 = read_card_health(reader._devices[0])
    assert not h100.problems and not reader.nvml.nvmlLib.errors
    assert value(h100, "atopgpud_gpu_clocks_event_seconds_total", reason="sw_power_cap") == 12.5
    assert value(h100, "atopgpud_gpu_clocks_event_seconds_total", reason="hw_thermal_slowdown") == 3
    assert value(h100, "atopgpud_gpu_clocks_event_seconds_total", reason="sync_boost") is None
    assert value(h100, "atopgpud_gpu_violation_seconds_total", policy="power") == 2.25
    assert value(h100, "atopgpud_gpu_violation_seconds_total", policy="thermal") == 0
    assert value(h100, "atopgpud_gpu_violation_seconds_total", policy="reliability") is None
    assert value(h100, "atopgpud_gpu_engine_busy_percent", engine="encoder") == 35
    assert value(h100, "atopgpud_gpu_engine_busy_percent", engine="decoder") == 10
    assert value(h100, "atopgpud_gpu_engine_busy_percent", engine="jpeg") == 0
    assert value(h100, "atopgpud_gpu_engine_busy_percent", engine="ofa") is None
    assert value(h100, "atopgpud_gpu_pcie_throughput_bytes_per_second", direction="tx") == 500 * 1024
    assert value(h100, "atopgpud_gpu_pcie_throughput_bytes_per_second", direction="rx") == 341 * 1024
    assert value(h100, "atopgpud_gpu_pcie_link_generation") == 4
    assert value(h100, "atopgpud_gpu_pcie_link_width") == 16
    assert value(h100, "atopgpud_gpu_clock_hertz", clock="video") == 765e6
    assert value(h100, "atopgpud_gpu_clock_max_hertz", clock="sm") == 1980e6
    assert value(h100, "atopgpud_gpu_clock_max_hertz", clock="video") == 1545e6
    assert value(h100, "atopgpud_gpu_clock_max_hertz", clock="memory") is None
    assert value(h100, "atopgpud_gpu_temperature_threshold_celsius", threshold="shutdown") == 92
    assert value(h100, "atopgpud_gpu_temperature_threshold_celsius", threshold="slowdown") == 89
    assert value(h100, "atopgpud_gpu_temperature_threshold_celsius", threshold="gpu_max") == 87
    # NVLink: counters of the active links only (link 1 is down), their throughput the played rate's integral
    assert value(h100, "atopgpud_gpu_nvlink_bytes_total", direction="tx", link="0") == 1000 * 1024 * 10
    assert value(h100, "atopgpud_gpu_nvlink_bytes_total", direction="rx", link="0") == 2000 * 1024 * 10
    assert value(h100, "atopgpud_gpu_nvlink_errors_total", error="replay", link="0") == 3
    assert value(h100, "atopgpud_gpu_nvlink_errors_total", error="crc_flit", link="2") is None
    assert value(h100, "atopgpud_gpu_nvlink_errors_total", error="crc_data", link="2") == 0
    links = {dict(labels).get("link") for name, labels in h100.values if name.startswith("atopgpud_gpu_nvlink")}
    assert links == {"0", "2"}
    t[0] = 20.0
    later = read_card_health(reader._devices[0])
    assert value(later, "atopgpud_gpu_nvlink_bytes_total", direction="tx", link="0") == 1000 * 1024 * 20


def test_new_figures_not_supported_are_left_out_and_not_asked_again():
    """A card without them (every new figure null, no NVLink) has none of their series, and once
    NOT_SUPPORTED has held, their calls are not made again."""
    t = [1.0]
    reader = reader_at(t)
    rtx = reader._devices[1]
    first = read_card_health(rtx)
    new = {"atopgpud_gpu_clocks_event_seconds_total", "atopgpud_gpu_violation_seconds_total",
           "atopgpud_gpu_engine_busy_percent", "atopgpud_gpu_pcie_throughput_bytes_per_second",
           "atopgpud_gpu_pcie_link_generation", "atopgpud_gpu_pcie_link_width", "atopgpud_gpu_nvlink_bytes_total",
           "atopgpud_gpu_nvlink_errors_total", "atopgpud_gpu_clock_max_hertz",
           "atopgpud_gpu_temperature_threshold_celsius"}
    assert not {name for name, _ in first.values} & new
    assert not first.problems
    for second in range(2, 3 + max(HOLD_POLLS, int(HOLD_SECONDS))):
        t[0] = float(second)
        reader.read(t[0])
        read_card_health(rtx)
    calls = reader.nvml.nvmlLib.calls
    asked = ("nvmlDeviceGetViolationStatus", "nvmlDeviceGetOfaUtilization", "nvmlDeviceGetNvLinkState",
             "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperatureThreshold",
             "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetFieldValues", "nvmlDeviceGetEncoderUtilization")
    before = {name: calls[name] for name in asked}
    for second in range(40, 50):
        t[0] = float(second)
        reader.read(t[0])
        last = read_card_health(rtx)
    assert {name: calls[name] for name in asked} == before
    assert not {name for name, _ in last.values} & new
    assert value(last, "atopgpud_gpu_temperature_celsius") == 40  # the older figures still read


def test_a_binding_without_the_functions_leaves_their_figures_out():
    """A driver lacking a function leaves its figures out, nothing else; the clocks-event flags come
    through the older name (ThrottleReasons) where the newer one is missing."""
    t = [1.0]
    reader = reader_at(t)
    device = reader._devices[0]
    for name in ("nvmlDeviceGetViolationStatus", "nvmlDeviceGetNvLinkState"):
        device.session._bound[name] = None
        device.missing.add(name)
    for variant in [f"nvmlDeviceGetViolationStatus {p}" for p in ("power", "thermal")] + [
            f"nvmlDeviceGetNvLinkState link {n}" for n in range(3)]:
        device.missing.add(variant)
    device.missing.add("nvmlDeviceGetCurrentClocksEventReasons")
    calls = reader.nvml.nvmlLib.calls
    reading = read_card_health(device)
    assert calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1
    assert value(reading, "atopgpud_gpu_clocks_event_active", reason="gpu_idle") == 0
    assert value(reading, "atopgpud_gpu_violation_seconds_total", policy="power") is None
    assert not any(name.startswith("atopgpud_gpu_nvlink") for name, _ in reading.values)
    assert value(reading, "atopgpud_gpu_engine_busy_percent", engine="encoder") == 35


def test_scenario_nvlink_errors_name_the_field():
    """A bad NVLink entry is one line naming it."""
    bad = [
        ({"nvlink": {"tx_kib_per_s": 1}}, "gpus[0].health.nvlink must be null or a list"),
        ({"nvlink": [{"tx_kib": 1}]}, "gpus[0].health.nvlink[0].tx_kib is not a known field"),
        ({"nvlink": [{"active": 1}]}, "gpus[0].health.nvlink[0].active must be true or false"),
        ({"encoder_percent": 101}, "gpus[0].health.encoder_percent must be a number from 0 to 100"),
    ]
    for health, message in bad:
        with pytest.raises(ScenarioError, match=re.escape(message)):
            parse_scenario({"gpus": [{"health": health}]})


@pytest.mark.parametrize("name, expected", [
    ("geforce-rtx-2070-x2-590.44.01.xml", {  # v13: the clocks-event counters, in microseconds
        ("atopgpud_gpu_clocks_event_seconds_total", (("reason", "sw_power_cap"),)): 306115.317789,
        ("atopgpud_gpu_clocks_event_seconds_total", (("reason", "hw_power_brake_slowdown"),)): 0,
        ("atopgpud_gpu_engine_busy_percent", (("engine", "ofa"),)): 0,
        ("atopgpud_gpu_pcie_link_generation", ()): 1,
        ("atopgpud_gpu_pcie_link_width", ()): 8,  # "8x"
        ("atopgpud_gpu_clock_max_hertz", (("clock", "video"),)): 1950e6,
        ("atopgpud_gpu_clock_hertz", (("clock", "video"),)): 540e6,
        ("atopgpud_gpu_temperature_threshold_celsius", (("threshold", "shutdown"),)): 94,
        ("atopgpud_gpu_temperature_threshold_celsius", (("threshold", "slowdown"),)): 91,
        ("atopgpud_gpu_temperature_threshold_celsius", (("threshold", "gpu_max"),)): 89,
    }),
    ("h100-80gb-hbm3-x8-570.86.15.xml", {  # v12: PCIe throughput in KB/s, JPEG and OFA
        ("atopgpud_gpu_pcie_throughput_bytes_per_second", (("direction", "tx"),)): 509 * 1024,
        ("atopgpud_gpu_pcie_throughput_bytes_per_second", (("direction", "rx"),)): 341 * 1024,
        ("atopgpud_gpu_pcie_link_generation", ()): 4,
        ("atopgpud_gpu_engine_busy_percent", (("engine", "jpeg"),)): 0,
        ("atopgpud_gpu_clock_max_hertz", (("clock", "sm"),)): 1980e6,
        ("atopgpud_gpu_clock_hertz", (("clock", "video"),)): 765e6,
    }),
    ("tesla-v100-sxm3-32gb-410.104.xml", {  # v10: encoder and decoder, no JPEG or OFA element
        ("atopgpud_gpu_engine_busy_percent", (("engine", "encoder"),)): 0,
        ("atopgpud_gpu_engine_busy_percent", (("engine", "decoder"),)): 0,
    }),
])
def test_new_figures_from_real_nvidia_smi_reports(name, expected):
    """Real reports give the new figures under each schema's names."""
    reading = corpus(name)
    for series, figure in expected.items():
        assert reading.values.get(series) == pytest.approx(figure), series


def test_smi_reports_without_an_element_have_no_series():
    """v10 has no JPEG/OFA utilization nor clocks-event counters; relative tlimit thresholds are not taken."""
    v100 = corpus("tesla-v100-sxm3-32gb-410.104.xml")
    assert ("atopgpud_gpu_engine_busy_percent", (("engine", "jpeg"),)) not in v100.values
    assert not any(name == "atopgpud_gpu_clocks_event_seconds_total" for name, _ in v100.values)
    ada = corpus("rtx-4000-sff-ada-595.84.xml")  # only *_tlimit_threshold names: degrees below the limit
    assert not any(name == "atopgpud_gpu_temperature_threshold_celsius" for name, _ in ada.values)
    assert not any(name.startswith("atopgpud_gpu_nvlink") or name == "atopgpud_gpu_violation_seconds_total"
                   for name, _ in ada.values)  # not in nvidia-smi's report


class XidSource:
    """A reader whose health jobs answer at once, and whose XID counts the test sets."""

    watchdog: object = None

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def health(self, wanted):
        return [("GPU-a", succeed(CardHealth("GPU-a", "00000000:17:00.0", "GPU", uuid="GPU-a")))]

    def xid_counts(self) -> Deferred:
        return succeed((dict(self.counts), {"GPU-a"}))


def page_text(cache: HealthCache) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(lambda: health_families(cache)))
    return generate_latest(registry).decode()


def samples(text: str) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_xid_last_seconds_is_when_the_count_last_went_up():
    """Absent until the first XID; then the time of day of the reading that saw it; kept while no new one."""
    wall = [1_700_000_000.0]
    source = XidSource()
    clock = Clock()
    cache = HealthCache(source, clock, wall=lambda: wall[0])
    cache.refresh()
    labels = frozenset({("busid", "00000000:17:00.0"), ("type", "GPU"), ("uuid", "GPU-a")})
    assert ("atopgpud_gpu_xid_last_seconds", labels) not in samples(page_text(cache))
    source.counts = {("GPU-a", 79): 1}
    wall[0] += 60
    clock.advance(1)
    cache.refresh()
    assert samples(page_text(cache))[("atopgpud_gpu_xid_last_seconds", labels)] == 1_700_000_060
    wall[0] += 60
    clock.advance(1)
    cache.refresh()  # no new XID: the time stays
    assert samples(page_text(cache))[("atopgpud_gpu_xid_last_seconds", labels)] == 1_700_000_060
    source.counts = {("GPU-a", 79): 1, ("GPU-a", 48): 1}
    wall[0] += 5
    clock.advance(1)
    cache.refresh()
    assert samples(page_text(cache))[("atopgpud_gpu_xid_last_seconds", labels)] == 1_700_000_125


def test_atopgpu_health_shows_the_new_figures_as_json_keys():
    """The client's keys are the table's: per-link figures by link, engines and thresholds by name."""
    t = [10.0]
    reader = reader_at(t)
    cache = HealthCache(None, Clock())  # type: ignore[arg-type]
    cache.readings["a"] = read_card_health(reader._devices[0])
    cache.read_at["a"] = 0
    page = "# TYPE atopgpud_build_info gauge\natopgpud_build_info{version=\"0\"} 1\n" + page_text(cache)
    gpu = health_report(page, "http://h/metrics")["gpus"][0]
    assert gpu["engine_busy_percent"] == {"encoder": 35, "decoder": 10, "jpeg": 0, "ofa": None}
    assert gpu["pcie_kib_per_second"] == {"tx": 500, "rx": 341}
    assert gpu["pcie_link_generation"] == 4 and gpu["pcie_link_width"] == 16
    assert gpu["video_clock_mhz"] == 765 and gpu["max_clocks_mhz"]["sm"] == 1980
    assert gpu["clocks_mhz"] == {"graphics": 1410, "sm": 1410, "memory": 1215}
    assert gpu["temperature_threshold_c"]["slowdown"] == 89
    assert gpu["clocks_event_seconds"]["sw_power_cap"] == 12.5
    assert gpu["violation_seconds"]["power"] == 2.25
    assert gpu["nvlink_bytes"]["tx"] == {"0": 10240000, "2": 0}
    assert gpu["nvlink_errors"]["replay"] == {"0": 3, "2": 0}
    table = render_health({"endpoint": "http://h/metrics", "gpus": [gpu]})
    assert table.splitlines()[1].split() == ["BUSID", "TYPE", "TEMP", "MEMTEMP", "POWER", "LIMIT", "ENERGY", "SM",
                                             "MEM", "PSTATE", "FAN", "ECC-C", "ECC-U", "XID", "THROTTLE"]


@pytest.mark.e2e
def test_daemon_serves_the_new_figures_and_promtool_accepts_the_page(tmp_path):
    """Over HTTP from the installed daemon on the simulator: the new series, and a page promtool passes."""
    port = free_port()
    with run_daemon(tmp_path, ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1"],
                    scenario=SCENARIO) as daemon:
        daemon.wait_samples(2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
    page = samples(text)
    names = {name for name, _ in page}
    for name in ("atopgpud_gpu_clocks_event_seconds_total", "atopgpud_gpu_violation_seconds_total",
                 "atopgpud_gpu_engine_busy_percent", "atopgpud_gpu_pcie_throughput_bytes_per_second",
                 "atopgpud_gpu_pcie_link_generation", "atopgpud_gpu_pcie_link_width",
                 "atopgpud_gpu_nvlink_bytes_total", "atopgpud_gpu_nvlink_errors_total",
                 "atopgpud_gpu_clock_max_hertz", "atopgpud_gpu_temperature_threshold_celsius"):
        assert name in names, name
    encoder = [v for (name, labels), v in page.items()
               if name == "atopgpud_gpu_engine_busy_percent" and ("engine", "encoder") in labels]
    assert encoder == [35]
    promtool("check", "metrics", input=text.encode(), timeout=30)


@pytest.mark.e2e
def test_daemon_on_nvidia_smi_serves_the_new_figures_of_a_real_report(tmp_path):
    """--reader nvidia-smi on a real H100 report: engines, PCIe throughput and link, clocks, on the page."""
    if not CORPUS.is_dir():
        pytest.skip(f"the shared nvidia-smi corpus is not at {CORPUS}")
    port = free_port()
    binary = smi_stand_in(tmp_path, CORPUS / "h100-80gb-hbm3-x8-570.86.15.xml")
    with run_daemon(tmp_path, ["--reader", "nvidia-smi", "--nvidia-smi", str(binary), "--interval", "0.5",
                    "--metrics", f"tcp:{port}:interface=127.0.0.1"]) as daemon:
        daemon.wait_samples(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            page = samples(response.read().decode())
    first = {labels for name, labels in page if name == "atopgpud_gpu_pcie_link_width"}
    assert len(first) == 8  # one per card
    tx = [v for (name, labels), v in page.items() if name == "atopgpud_gpu_pcie_throughput_bytes_per_second"
          and ("direction", "tx") in labels and ("busid", "00000000:04:00.0") in labels]
    assert tx == [509 * 1024]
    assert any(name == "atopgpud_gpu_clock_max_hertz" for name, _ in page)
    assert not any(name.startswith("atopgpud_gpu_nvlink") for name, _ in page)


def test_the_gpm_lists_come_from_the_gpm_rows():
    """The GPM families, the metric ids asked, the sums' units, atopgpu --gpm's keys and columns, and the
    simulator's fields and metrics are the GPM rows of the table, in its order."""
    rows = figures.GPM_FIGURES
    gpms = [row.gpm for row in rows]
    assert all(gpm is not None for gpm in gpms) and not any(row.gpm for row in figures.FIGURES)
    names = [gpm.name for gpm in gpms if gpm]
    assert len(set(names)) == len(names) and len({gpm.metric for gpm in gpms if gpm}) == len(names)
    binding = {value for key, value in vars(pynvml).items() if key.startswith("NVML_GPM_METRIC_")}
    for row in rows:
        assert row.gpm and row.gpm.metric in binding and row.gpm.metric < pynvml.NVML_GPM_METRIC_MAX, row.gpm
        assert row.gpm.unit in (figures.PERCENT, figures.MIB_PER_SECOND), row.gpm
        assert row.family.kind == "counter" and row.family.name.endswith("_total"), row.family.name
        assert row.family.name.startswith("atopgpud_gpu_gpm_") and row.show is not None
        assert row.family.name.endswith("_bytes_total" if row.gpm.rate else "_percent_seconds_total")
        assert not figures.families().get(row.family.name), "a GPM family is not a health family"
    # the page: one family per row, in the table's order, after the seconds covered
    assert [name for name, _, _ in GPM_SERIES] == names
    assert [series + "_total" for _, series, _ in GPM_SERIES] == [row.family.name for row in rows]
    assert [text for _, _, text in GPM_SERIES] == [row.family.help for row in rows]
    counters = Counters()
    figures_of_all = GpmFigures(2.0, tuple((name, 1.0) for name in names))
    counters.fold(Snapshot((DeviceSample("k0", "0000:01:00.0", "H200", gpm=figures_of_all),)), 1.0, 0.0)
    # the sums: a percentage's percent-seconds, a rate's (MiB/s) bytes
    totals = counters.devices[0].gpm
    assert totals and totals.sums == {gpm.name: 2.0 * (figures.MIB if gpm.rate else 1) for gpm in gpms if gpm}
    board = Board.__new__(Board)
    board.counters = counters
    page = list(gpm_families(board))
    assert [family.name for family in page] == ["atopgpud_gpu_gpm_seconds"] + [
        row.family.name.removesuffix("_total") for row in rows]
    assert all(len(family.samples) == 1 for family in page)
    # the NVML reader asks each row's metric id, once
    assert metrics() == tuple((gpm.name, gpm.metric, gpm.rate) for gpm in gpms if gpm)
    # atopgpu --gpm: a JSON key per row, a column per row that has one
    before = {("b", "t"): {"seconds": 0.0}}
    after = {("b", "t"): {"seconds": 1.0, **{name: 0.0 for name in names}}}
    doc = gpm_report(before, after, "u")
    assert list(doc["gpus"][0])[3:] == [row.show.key[0] for row in rows if row.show]
    header = render_gpm(doc).splitlines()[1].split()
    assert header[2:] == [row.show.column for row in rows if row.show and row.show.column]
    # the simulator: each row's metric played, each Play a field of a scenario GPU's gpm object
    assert set(PLAYED) == {gpm.metric for gpm in gpms if gpm}
    assert GPM_FIELDS == {row.play.field: row.play for row in rows if row.play}
    for row in rows:
        assert row.gpm
        kind, field = PLAYED[row.gpm.metric]
        assert field == (row.play.field if row.play else None)
        assert kind == ("rate" if row.gpm.rate else row.play.follows if row.play else "gpu")
    assert parse_gpm(True, "gpm") == {name: float(play.default or 0) for name, play in GPM_FIELDS.items()}
    spec = parse_gpm({"sm_share": 0.25}, "gpm")
    assert spec is not None and spec["sm_share"] == 0.25 and spec["dram_share"] == 1.0
