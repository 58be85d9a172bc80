"""A real Prometheus server scraping the daemon on the simulator, with etc/prometheus's rules loaded.

It checks, through Prometheus's HTTP API, that the busy rate over a span is
atop's arithmetic on the two scraped counters, that the energy counter grows
by the simulated power times the time, that the scenario's XID fires its
alert, and that a GPU lost and back keeps its counters monotonic.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemon import free_port, run_daemon
from prometheus_server import Prometheus, needed, one_target

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "etc" / "prometheus" / "atopgpud-rules.yml"
POWER = 250
SCENARIO = {
    "gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "gpu_util": [20, 60, 35], "mem_util": 10,
         "health": {"power_w": POWER, "xid_events": [[6, 79]]}},
        {"name": "NVIDIA A10", "gpu_util": 30,
         "faults": [{"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 4, "until": 7}]},
    ]
}
SPAN = "10s"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """The daemon on the simulator and a Prometheus scraping it with the rules loaded, once the A10 was lost
    and is back."""
    binary = needed("prometheus", "prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    with run_daemon(tmp, ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1"],
                    scenario=SCENARIO):
        server = Prometheus(binary, tmp, one_target(f"127.0.0.1:{port}"), rule_files=[str(RULES)])
        try:
            # the A10 was lost (4 s to 7 s) and is back, and a span has passed since
            server.wait_for('min_over_time(atopgpud_gpu_present{busid="00000000:18:00.0"}[1h]) == 0')
            server.wait_for('atopgpud_gpu_present{busid="00000000:18:00.0"} == 1 '
                            'and min_over_time(atopgpud_gpu_present{busid="00000000:18:00.0"}[1h]) == 0')
            server.wait_for('count_over_time(atopgpud_gpu_samples_total{busid="00000000:17:00.0"}[1h]) > 16')
            yield server
        finally:
            server.stop()


def raw(server: Prometheus, metric: str, at: float, span: str = "1h") -> list[tuple[float, float]]:
    result = server.query(f"{metric}[{span}]", time=str(at))
    assert len(result) == 1, result
    return [(float(t), float(v)) for t, v in result[0]["values"]]


def rule_expr(record: str) -> str:
    """A recording rule's ``expr: |`` block, read from the rules file (no YAML library needed)."""
    lines = RULES.read_text().splitlines()
    start = lines.index(f"      - record: {record}")
    assert lines[start + 1].strip() == "expr: |"
    block = []
    for line in lines[start + 2:]:
        if not line.startswith("          "):
            break
        block.append(line.strip())
    return " ".join(block)


def latest_at(points: list[tuple[float, float]], when: float) -> tuple[float, float]:
    return [p for p in points if p[0] <= when + 1e-9][-1]


def test_busy_rate_over_a_span_is_atops_arithmetic(prometheus):
    """The recording rule's expression over a span equals Δgpuperccum / Δgpusamples from the scraped counters,
    and a GPU at a constant 30 % is exactly 30 %."""
    expr = rule_expr("atopgpud:gpu_busy_percent:1m")
    at = time.time() - 1
    result = prometheus.query(expr.replace("offset 1m", f"offset {SPAN}"), time=str(at))
    got = {r["metric"]["busid"]: float(r["value"][1]) for r in result}
    selector = '{busid="00000000:17:00.0"}'
    busy = raw(prometheus, f"atopgpud_gpu_busy_percent_sum_total{selector}", at)
    samples = raw(prometheus, f"atopgpud_gpu_samples_total{selector}", at)
    span = float(SPAN.rstrip("s"))
    b1, b0 = latest_at(busy, at)[1], latest_at(busy, at - span)[1]
    s1, s0 = latest_at(samples, at)[1], latest_at(samples, at - span)[1]
    atop = (b1 - b0) / (s1 - s0)  # Δgpuperccum / Δgpusamples
    assert got["00000000:17:00.0"] == pytest.approx(atop, abs=1e-9)
    assert 20 <= atop <= 60
    assert got["00000000:18:00.0"] == pytest.approx(30, abs=1e-9)
    # and the rules themselves are loaded and evaluate without error
    groups = prometheus.api("rules")["groups"]
    health = {rule["name"]: rule["health"] for group in groups for rule in group["rules"]}
    assert health["atopgpud:gpu_busy_percent:1m"] == "ok"
    assert set(health.values()) == {"ok"}


def test_energy_grows_by_power_times_time(prometheus):
    """The energy counter's increase between two scrapes is the simulated power times the time between them."""
    at = time.time() - 1
    points = raw(prometheus, 'atopgpud_gpu_energy_joules_total{busid="00000000:17:00.0"}', at)
    (t0, e0), (t1, e1) = points[0], points[-1]
    assert t1 - t0 > 5
    assert e1 - e0 == pytest.approx(POWER * (t1 - t0), rel=0.02)
    rate = prometheus.query('rate(atopgpud_gpu_energy_joules_total{busid="00000000:17:00.0"}[5s])',
                            time=str(at))
    assert float(rate[0]["value"][1]) == pytest.approx(POWER, rel=0.05)
    assert all(b[1] >= a[1] for a, b in zip(points, points[1:]))


def test_an_xid_in_the_scenario_fires_its_alert(prometheus):
    """The XID 79 at 6 s fires AtopgpudGpuXidCritical for the H100, with its code."""
    deadline = time.monotonic() + 30
    firing: list[dict] = []
    while time.monotonic() < deadline and not firing:
        alerts = prometheus.api("alerts")["alerts"]
        firing = [a for a in alerts if a["labels"]["alertname"] == "AtopgpudGpuXidCritical" and a["state"] == "firing"]
        time.sleep(0.5)
    assert firing, "AtopgpudGpuXidCritical did not fire"
    assert firing[0]["labels"]["xid"] == "79"
    assert firing[0]["labels"]["busid"] == "00000000:17:00.0"


def test_a_gpu_lost_and_back_keeps_its_counters_monotonic(prometheus):
    """Across the A10's loss every counter of it only grows, and its gauges leave and come back."""
    at = time.time() - 1
    selector = '{busid="00000000:18:00.0"}'
    present = raw(prometheus, f"atopgpud_gpu_present{selector}", at)
    assert 0 in [v for _, v in present] and present[-1][1] == 1
    for metric in ("atopgpud_gpu_samples_total", "atopgpud_gpu_busy_percent_seconds_total",
                   "atopgpud_gpu_memory_used_byte_seconds_total", "atopgpud_gpu_energy_joules_total"):
        points = raw(prometheus, metric + selector, at)
        assert all(b[1] >= a[1] for a, b in zip(points, points[1:])), metric
    resets = prometheus.query(f"resets(atopgpud_gpu_samples_total{selector}[1h])", time=str(at))
    assert float(resets[0]["value"][1]) == 0


def test_series_join_by_uuid_with_the_inventory_and_a_dcgm_style_page(prometheus):
    """atopgpud_gpu_info joins every per-GPU family by uuid; a series labelled UUID (dcgm-exporter's
    spelling) joins after label_replace, as docs/metrics.md shows."""
    at = str(time.time() - 1)
    info = prometheus.query("atopgpud_gpu_info", time=at)
    uuids = {r["metric"]["busid"]: r["metric"]["uuid"] for r in info}
    assert set(uuids) == {"00000000:17:00.0", "00000000:18:00.0"}
    assert all(uuid.startswith("GPU-") for uuid in uuids.values())
    assert all(r["metric"]["driver_version"] and r["metric"]["serial"] for r in info)
    joined = prometheus.query(
        "atopgpud_gpu_temperature_celsius * on (uuid) group_left (serial, driver_version) atopgpud_gpu_info", time=at
    )
    assert joined and {r["metric"]["uuid"] for r in joined} <= set(uuids.values())
    assert all(r["metric"]["serial"] for r in joined)
    # a stand-in for DCGM_FI_DEV_GPU_UTIL{UUID=...}: the doc's join, by the other exporter's label name
    dcgm = 'label_replace(atopgpud_gpu_busy_percent, "UUID", "$1", "uuid", "(.+)")'
    both = prometheus.query(
        f'{dcgm} * on (UUID) group_left (serial) label_replace(atopgpud_gpu_info, "UUID", "$1", "uuid", "(.+)")',
        time=at,
    )
    assert {r["metric"]["UUID"] for r in both} == set(uuids.values())
