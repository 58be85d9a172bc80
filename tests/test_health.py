"""Health and power series: read through NVML on the simulator, cached per scrape, bounded waits."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from daemon import free_port, run_daemon
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from atopgpud_tw.health import CardHealth
from atopgpud_tw.readers.nvml.health import read_card_health
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.nvml.support import HOLD_POLLS, HOLD_SECONDS
from atopgpud_tw.server.web.metrics import FAMILIES, HEALTH_WAIT, Families, HealthCache, health_families
from atopgpud_tw.sim import ScenarioError, parse_scenario, simulated_binding
from atopgpud_tw.sim.library_symbols import HEALTH_SYMBOLS

UNSUPPORTED_ALL = {
    "ecc_corrected_volatile": None, "ecc_corrected_aggregate": None,
    "ecc_uncorrected_volatile": None, "ecc_uncorrected_aggregate": None,
    "remapped_rows_correctable": None, "energy_start_j": None, "xid_events": None,
    "temperature_c": None, "fan_percent": None, "performance_state": None,
}
SCENARIO = {
    "gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "health": {
            "temperature_c": [50, 51], "memory_temperature_c": 61, "power_w": {"steps": [[0, 100], [10, 250]]},
            "power_limit_w": 700, "energy_start_j": 1000, "sm_clock_mhz": 1980, "memory_clock_mhz": 2619,
            "graphics_clock_mhz": 1755, "clocks_event_reasons": {"steps": [[0, 0], [5, 0x44]]},
            "performance_state": 2, "ecc_corrected_volatile": 3, "ecc_uncorrected_aggregate": 1,
            "remapped_rows_correctable": 2, "remapped_rows_pending": 1, "pcie_replays": 7,
            "xid_events": [[1, 13], [6, 79], [7, 79]],
        }},
        {"name": "NVIDIA GeForce RTX 3090", "health": {**UNSUPPORTED_ALL, "fan_percent": 42}},
    ]
}


def reader_at(t: list[float], scenario: dict = SCENARIO) -> NvmlReader:
    reader = NvmlReader(simulated_binding(parse_scenario(scenario), clock=lambda: t[0]), reactor=None)
    reader.open()
    return reader


def card(reading: CardHealth, name: str, **labels: str) -> float | None:
    for (metric, extra), value in reading.values.items():
        if metric == name and dict(extra) == labels:
            return value
    return None


def test_figures_are_read_as_the_scenario_plays_them():
    """Each figure reaches the series in base units: watts, joules, hertz, 0/1 reasons."""
    t = [12.0]
    reader = reader_at(t)
    h100 = read_card_health(reader._devices[0])
    assert card(h100, "atopgpud_gpu_temperature_celsius") == 50  # second 12 of the cycle [50, 51]
    assert card(h100, "atopgpud_gpu_memory_temperature_celsius") == 61
    assert card(h100, "atopgpud_gpu_power_watts") == 250
    assert card(h100, "atopgpud_gpu_power_limit_watts") == 700
    assert card(h100, "atopgpud_gpu_energy_joules_total") == pytest.approx(1000 + 100 * 10 + 250 * 2)
    assert card(h100, "atopgpud_gpu_clock_hertz", clock="sm") == 1980e6
    assert card(h100, "atopgpud_gpu_clock_hertz", clock="memory") == 2619e6
    assert card(h100, "atopgpud_gpu_clock_hertz", clock="graphics") == 1755e6
    assert card(h100, "atopgpud_gpu_clocks_event_active", reason="sw_power_cap") == 1
    assert card(h100, "atopgpud_gpu_clocks_event_active", reason="hw_thermal_slowdown") == 1
    assert card(h100, "atopgpud_gpu_clocks_event_active", reason="gpu_idle") == 0
    assert card(h100, "atopgpud_gpu_performance_state") == 2
    assert card(h100, "atopgpud_gpu_ecc_errors_total", error="corrected", counter="volatile") == 3
    assert card(h100, "atopgpud_gpu_ecc_errors_total", error="uncorrected", counter="aggregate") == 1
    assert card(h100, "atopgpud_gpu_remapped_rows", cause="correctable") == 2
    assert card(h100, "atopgpud_gpu_row_remap_pending") == 1
    assert card(h100, "atopgpud_gpu_pcie_replays_total") == 7
    assert card(h100, "atopgpud_gpu_fan_speed_percent") is None  # null by default: passively cooled
    assert not h100.lost and not h100.problems


def test_unsupported_figures_have_no_series_and_are_not_asked_again():
    """NOT_SUPPORTED from the library leaves the series out, and once that has held for
    HOLD_SECONDS and HOLD_POLLS polls the call is not made again (but at its long backoff)."""
    t = [1.0]
    reader = reader_at(t)
    rtx = reader._devices[1]
    first = read_card_health(rtx)
    calls = reader.nvml.nvmlLib.calls
    for second in range(2, 3 + max(HOLD_POLLS, int(HOLD_SECONDS))):
        t[0] = float(second)
        reader.read(t[0])
        read_card_health(rtx)
    before = calls["nvmlDeviceGetTotalEccErrors"], calls["nvmlDeviceGetTemperature"]
    for second in range(40, 50):
        t[0] = float(second)
        reader.read(t[0])
        second = read_card_health(rtx)
    assert (calls["nvmlDeviceGetTotalEccErrors"], calls["nvmlDeviceGetTemperature"]) == before
    for reading in (first, second):
        names = {metric for metric, _ in reading.values}
        assert "atopgpud_gpu_temperature_celsius" not in names
        assert "atopgpud_gpu_ecc_errors_total" not in names
        assert "atopgpud_gpu_remapped_rows" not in names
        assert "atopgpud_gpu_energy_joules_total" not in names
        assert "atopgpud_gpu_performance_state" not in names
        assert card(reading, "atopgpud_gpu_fan_speed_percent") == 42
        assert not any(value < 0 for value in reading.values.values())


def test_a_failing_figure_is_left_out_once_and_a_lost_card_has_none():
    """A call that fails leaves that figure out of that reading; GPU_IS_LOST empties the reading."""
    scenario = {"gpus": [{"faults": [
        {"call": "nvmlDeviceGetPowerUsage", "error": "NVML_ERROR_UNKNOWN", "from": 1, "until": 2},
        {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 3, "until": 4},
    ]}]}
    t = [1.0]
    reader = reader_at(t, scenario)
    device = reader._devices[0]
    failing = read_card_health(device)
    assert card(failing, "atopgpud_gpu_power_watts") is None
    assert card(failing, "atopgpud_gpu_temperature_celsius") == 40
    assert any("nvmlDeviceGetPowerUsage" in text for text in failing.problems.values())
    t[0] = 2.5
    assert card(read_card_health(device), "atopgpud_gpu_power_watts") == 60  # asked again, not unsupported
    t[0] = 3.5
    lost = read_card_health(device)
    assert lost.lost and lost.values == {}
    t[0] = 4.5
    assert card(read_card_health(device), "atopgpud_gpu_power_watts") == 60


def test_polls_make_no_health_calls():
    """A daemon nobody scrapes makes no health call: the poll reads none of them (start-up only
    registers the cards for XID events)."""
    t = [0.0]
    reader = reader_at(t)
    calls = reader.nvml.nvmlLib.calls
    at_start = {symbol: calls[symbol] for symbol in HEALTH_SYMBOLS}
    events = {"nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2"}
    assert {symbol for symbol, count in at_start.items() if count} <= events
    for second in range(1, 5):
        t[0] = float(second)
        reader.read(t[0])
    assert {symbol: calls[symbol] for symbol in HEALTH_SYMBOLS} == at_start


def test_xid_events_are_counted_from_registration_on():
    """Events due after registration are counted by card and XID; earlier ones are not delivered."""
    t = [2.0]
    reader = reader_at(t)
    counts, cards = reader._xid.drain(reader._devices)
    assert counts == {}  # the XID 13 at 1 s came before anyone registered
    assert cards == {reader._devices[0].key}  # the RTX cannot report XIDs
    t[0] = 6.5
    counts, _ = reader._xid.drain(reader._devices)
    assert counts == {(reader._devices[0].key, 79): 1}
    t[0] = 9.0
    counts, _ = reader._xid.drain(reader._devices)
    assert counts == {(reader._devices[0].key, 79): 2}


class FakeSource:
    """A reader whose health jobs the test fires."""

    watchdog: object = None

    def __init__(self) -> None:
        self.jobs: list[tuple[str, Deferred]] = []
        self.keys = ["GPU-a"]

    def health(self, wanted):
        fresh = [(key, Deferred()) for key in self.keys if wanted(key)]
        self.jobs += fresh
        return fresh

    def xid_counts(self):
        return None


def page_of(cache: HealthCache) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(lambda: health_families(cache)))
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_a_scrape_waits_a_bounded_time_and_then_says_stale():
    """A reading that does not answer within the bound leaves the last figures, marked stale; it is not asked again."""
    clock, source = Clock(), FakeSource()
    cache = HealthCache(source, clock)
    first = cache.refresh()
    reading = CardHealth("GPU-a", "00000000:17:00.0", "GPU", {("atopgpud_gpu_power_watts", ()): 100.0}, uuid="GPU-a")
    source.jobs[0][1].callback(reading)
    assert first.called
    labels = frozenset({("busid", "00000000:17:00.0"), ("type", "GPU"), ("uuid", "GPU-a")})
    assert page_of(cache)[("atopgpud_gpu_health_stale", labels)] == 0
    clock.advance(1)
    second = cache.refresh()  # this one hangs
    assert len(source.jobs) == 2 and not second.called
    clock.advance(HEALTH_WAIT)
    assert second.called
    page = page_of(cache)
    assert page[("atopgpud_gpu_health_stale", labels)] == 1
    assert page[("atopgpud_gpu_power_watts", labels)] == 100
    assert page[("atopgpud_gpu_health_age_seconds", labels)] == pytest.approx(1 + HEALTH_WAIT)
    cache.refresh()
    assert len(source.jobs) == 2  # not piled up behind the stuck call
    assert not clock.getDelayedCalls() or all(c.active() for c in clock.getDelayedCalls())
    clock.advance(HEALTH_WAIT)
    assert not clock.getDelayedCalls()


def test_a_fresh_reading_is_reused():
    """Two scrapes within FRESH seconds make one reading."""
    clock, source = Clock(), FakeSource()
    cache = HealthCache(source, clock)
    cache.refresh()
    source.jobs[0][1].callback(CardHealth("GPU-a", "b", "n"))
    assert cache.refresh().called
    assert len(source.jobs) == 1


def test_scenario_health_errors_name_the_field():
    """A bad health field is one line naming it."""
    bad = [
        ({"temperatur_c": 3}, "gpus[0].health.temperatur_c is not a known field"),
        ({"fan_percent": 120}, "gpus[0].health.fan_percent must be a number from 0 to 100"),
        ({"power_w": {"steps": [[5, 1], [2, 3]]}}, "gpus[0].health.power_w.steps[1] must come after"),
        ({"xid_events": [[1, "x"]]}, "gpus[0].health.xid_events[0] must be [time, xid]"),
        ({"power_w": []}, "gpus[0].health.power_w must not be an empty list"),
    ]
    for health, message in bad:
        with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_scenario({"gpus": [{"health": health}]})


@pytest.mark.e2e
def test_daemon_serves_health_and_marks_a_hung_call_stale(tmp_path):
    """Over HTTP: the figures are there, and while a health call hangs the scrape still answers, stale."""
    port = free_port()
    scenario = {"gpus": [{"health": {"power_w": 250}, "faults": [
        {"call": "nvmlDeviceGetPcieReplayCounter", "error": "hang", "from": 4, "until": 40}]}]}
    args = ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1"]
    with run_daemon(tmp_path, args, scenario=scenario) as daemon:
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> dict:
            with urllib.request.urlopen(url, timeout=30) as response:
                text = response.read().decode()
            return {(s.name, frozenset(s.labels.items())): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        page = scrape()
        stale = [v for (name, _), v in page.items() if name == "atopgpud_gpu_health_stale"]
        assert stale == [0]
        assert [v for (name, _), v in page.items() if name == "atopgpud_gpu_power_watts"] == [250]
        assert [v for (name, _), v in page.items() if name == "atopgpud_gpu_xid_events_total"] == [0]
        daemon.wait_samples(9)  # past 4 s: the PCIe replay call hangs
        page = scrape()
        page = scrape()
        stale = [v for (name, _), v in page.items() if name == "atopgpud_gpu_health_stale"]
        assert stale == [1]
        assert [v for (name, _), v in page.items() if name == "atopgpud_gpu_power_watts"] == [250]


def test_every_health_series_is_documented():
    """docs/metrics.md lists every health series the collector makes."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    extra = ["atopgpud_gpu_xid_errors_total", "atopgpud_gpu_xid_events_total", "atopgpud_gpu_health_stale",
             "atopgpud_gpu_health_age_seconds"]
    for name in [*FAMILIES, *extra]:
        assert f"`{name}`" in text, name


class HungWatchdog:
    """A reader's watchdog that says a call has run for `seconds`."""

    after = 10.0

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def running_seconds(self) -> float:
        return self.seconds


def test_a_scrape_does_not_wait_behind_a_call_already_hung():
    """While the reader's thread is in a call running longer than the bound, the page goes out at once."""
    clock, source = Clock(), FakeSource()
    source.watchdog = HungWatchdog(HEALTH_WAIT + 1)
    cache = HealthCache(source, clock)
    assert cache.refresh().called
    assert len(source.jobs) == 1 and cache.stale("GPU-a")  # asked, queued behind it
    source.watchdog = HungWatchdog(0.0)
    assert not cache.refresh().called  # nothing hung: the scrape waits for the reading


def test_a_reading_that_raises_is_logged_once_and_the_next_scrape_asks_again():
    """A job that fails (a binding bug) is logged once, leaves the figures out, and is asked again next time."""
    from twisted.logger import globalLogPublisher

    clock, source = Clock(), FakeSource()
    cache = HealthCache(source, clock)
    seen: list[dict] = []
    globalLogPublisher.addObserver(seen.append)
    try:
        for _ in range(2):
            done = cache.refresh()
            source.jobs[-1][1].errback(RuntimeError("binding bug"))
            assert done.called
            clock.advance(1)
    finally:
        globalLogPublisher.removeObserver(seen.append)
    assert len(source.jobs) == 2
    assert sum(1 for event in seen if "log_failure" in event) == 1
    assert cache.readings == {}


def test_a_mig_card_has_its_figures_once_on_the_card():
    """In MIG mode the figures are read with the card's handle, once, whatever the instances."""
    scenario = {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "health": {"power_w": 180},
                          "mig": [{"profile": "3g.40gb", "memory_total_mib": 40192},
                                  {"profile": "3g.40gb", "gpu_instance": 2, "memory_total_mib": 40192}]}]}
    t = [1.0]
    reader = reader_at(t, scenario)
    reader.read(t[0])
    assert len(reader._devices) == 1
    reading = read_card_health(reader._devices[0])
    assert reading.busid == "00000000:17:00.0"
    assert card(reading, "atopgpud_gpu_power_watts") == 180
