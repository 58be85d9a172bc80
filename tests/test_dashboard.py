"""etc/grafana/atopgpud.json, proven: every panel's query, its variables resolved as Grafana resolves them,
returns data from a real Prometheus scraping the daemon on the simulator, and names only series the page has.

The test is driven by the JSON: a panel added there is queried here with no change to this file.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon import free_port, run_daemon
from prometheus_server import Prometheus, needed, one_target

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "etc" / "grafana"
DASHBOARD = GRAFANA / "atopgpud.json"
#: what Grafana puts for its own variables, for a 1 s scrape interval and a span the test's data fills
BUILT_IN = {"$__rate_interval": "10s", "$__interval": "2s", "$__range": "1h"}
METRIC = re.compile(r"\b(atopgpud_[a-z0-9_]+)\b")
def ramp(per_second: float) -> dict[str, list[list[float]]]:
    """A cumulative figure (seconds throttled) that grows `per_second` each second, for ten minutes."""
    return {"steps": [[t, round(per_second * t, 3)] for t in range(601)]}


HEALTH = {"fan_percent": 40, "memory_temperature_c": 61, "pcie_replays": {"steps": [[0, 0], [3, 2]]},
          "clocks_event_reasons": {"steps": [[0, 0], [3, 4]]}, "power_w": 120,
          # throttling as time, engines, PCIe, NVLink, clock and temperature limits: NOT_SUPPORTED by default
          "clocks_event_sw_power_cap_s": ramp(0.25), "clocks_event_hw_thermal_slowdown_s": ramp(0.05),
          "violation_power_s": ramp(0.25), "violation_thermal_s": ramp(0.05),
          "encoder_percent": [20, 35], "decoder_percent": 10, "jpeg_percent": 0, "ofa_percent": 5,
          "pcie_tx_kib_s": 400_000, "pcie_rx_kib_s": [900_000, 1_100_000],
          "pcie_link_generation": 5, "pcie_link_width": 16,
          "nvlink": [{"tx_kib_per_s": 2_000_000, "rx_kib_per_s": 1_000_000,
                      "replay_errors": {"steps": [[0, 0], [4, 3]]}}, {"tx_kib_per_s": 500_000}, {"active": False}],
          "video_clock_mhz": 1590, "max_graphics_clock_mhz": 1980, "max_sm_clock_mhz": 1980,
          "max_memory_clock_mhz": 2619, "max_video_clock_mhz": 1755,
          "temperature_shutdown_c": 92, "temperature_slowdown_c": 89, "temperature_memory_max_c": 95,
          "temperature_gpu_max_c": 87}
#: GPU Performance Monitoring (Hopper and later), on both GPUs: the single-GPU choices query it too
GPM = {"tensor_share": 0.4, "fp32_share": 0.2, "fp16_share": 0.1, "pcie_tx_mib_s": 800, "pcie_rx_mib_s": 1200,
       "nvlink_tx_mib_s": 5000, "nvlink_rx_mib_s": 4000}
#: a process that ends (a workload's ended processes); its pid is no process here, so its workload is unknown
ENDED = {"pid": 4_000_001, "memory_mib": 128, "sm_util": 10, "mem_util": 2, "stop": 3}


def scenario(own_pid: int) -> dict[str, Any]:
    """Two Hopper GPUs; the first GPU's process is `own_pid`, a real process, so that its user, command and
    workload are read from /proc as a GPU process's are; the others are unknown."""
    return {
        "gpus": [
            {"name": "NVIDIA H100 80GB HBM3", "gpu_util": [20, 60], "mem_util": 10, "memory_used_mib": 2048,
             "processes": [{"pid": own_pid, "memory_mib": 1024, "sm_util": [15, 40], "mem_util": 5}, ENDED],
             "health": {**HEALTH, "xid_events": [[2, 79]]}, "gpm": GPM},
            {"name": "NVIDIA H100 PCIe", "gpu_util": 30, "mem_util": 6, "memory_used_mib": 512,
             "processes": [{"pid": 5151, "memory_mib": 256, "sm_util": 25, "mem_util": 3}],
             "health": {**HEALTH, "xid_events": [[3, 48]]}, "gpm": {**GPM, "tensor_share": 0.1}},
        ]
    }

def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def targets(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel, rows' panels included."""
    found = []
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


def variables(board: dict[str, Any]) -> list[dict[str, Any]]:
    return board["templating"]["list"]


# -- the file itself ----------------------------------------------------------------------------


def test_the_json_is_the_generators_output() -> None:
    """etc/grafana/atopgpud.json is what make_dashboard.py writes: panels are added there, not by hand."""
    spec = importlib.util.spec_from_file_location("make_dashboard", GRAFANA / "make_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert DASHBOARD.read_text() == module.text(), "run python3 etc/grafana/make_dashboard.py"


def test_the_dashboard_has_its_variables_and_a_datasource_for_every_query() -> None:
    """A datasource variable of type prometheus, host and GPU variables from label_values(); every panel and
    query on ${datasource}; ids unique; panels within the 24-column grid."""
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"] == "atopgpud"
    by_name = {variable["name"]: variable for variable in variables(board)}
    assert by_name["datasource"]["type"] == "datasource" and by_name["datasource"]["query"] == "prometheus"
    for name in ("instance", "gpu", "workload"):
        assert by_name[name]["type"] == "query" and by_name[name]["query"].startswith("label_values(")
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    titles = {title for title, _ in targets(board)}
    for wanted in ("GPU busy", "Memory used", "Temperature", "Power", "ECC errors",
                   "Clock event reasons, share of the time", "XID errors by code", "Energy", "Process GPU busy",
                   "Throttled time, by clock event reason", "Throttled time, by violation policy",
                   "Time since the last XID", "Engine busy", "PCIe throughput", "NVLink throughput",
                   "GPM graphics and SM activity", "GPUs busy per workload", "Energy share per workload"):
        assert wanted in titles


def test_every_query_selects_the_host_and_gpu_variables() -> None:
    """A query of a per-GPU series selects $instance and $gpu; of a workload's, $workload too; the daemon's own
    series, $instance."""
    for title, expr in targets(dashboard()):
        for selector in re.findall(r"(atopgpud_[a-z0-9_]+)\{([^}]*)\}", expr):
            metric, labels = selector
            assert 'instance=~"$instance"' in labels, (title, expr)
            if metric.startswith(("atopgpud_gpu_", "atopgpud_process_", "atopgpud_workload_")) \
                    and metric != "atopgpud_workload_series":
                assert 'uuid=~"$gpu"' in labels, (title, expr)
            if metric.startswith("atopgpud_workload_") and metric != "atopgpud_workload_series":
                assert 'workload=~"$workload"' in labels, (title, expr)


def test_process_legends_name_who_the_process_is() -> None:
    """The per-process panels name user, comm and workload in the legend (labels of --metrics-process-context),
    and never in the query, so that they work without it."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            if "atopgpud_process_" in target["expr"]:
                assert all(f"{{{{{label}}}}}" in target["legendFormat"] for label in ("pid", "user", "comm",
                                                                                    "workload")), panel["title"]
                assert not re.search(r"\b(user|comm|workload)\b", target["expr"]), panel["title"]


def test_the_provisioning_files_point_at_the_dashboard() -> None:
    provider = (GRAFANA / "provisioning" / "dashboards" / "atopgpud.yaml").read_text()
    assert "type: file" in provider and "path: " in provider
    source = (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert "type: prometheus" in source


# -- against a real Prometheus -------------------------------------------------------------------


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The daemon on the simulator with --metrics-processes, --metrics-process-context and --workloads unit,
    a Prometheus scraping it every second, and the page's text, once the span of a rate() is filled."""
    binary = needed("prometheus", "prometheus")
    tmp = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    sleeper = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
    try:
        with run_daemon(tmp, ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1",
                              "--metrics-processes", "--metrics-process-context", "--workloads", "unit"],
                        scenario=scenario(sleeper.pid)):
            server = Prometheus(binary, tmp, one_target(f"127.0.0.1:{port}"))
            try:
                server.wait_for("count_over_time(atopgpud_gpu_samples_total[1h]) > 12")
                server.wait_for("atopgpud_gpu_xid_errors_total")
                server.wait_for("count(atopgpud_gpu_xid_last_seconds) == 2")
                server.wait_for("atopgpud_workload_processes_ended_total > 0")
                server.wait_for("count(count by (uuid) (rate(atopgpud_workload_energy_joules_total[10s]) > 0)) == 2")
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                    page = response.read().decode()
                yield server, page
            finally:
                server.stop()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable as Grafana's Prometheus data source writes it into a regex matcher."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value) for value in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, chosen: dict[str, str]) -> str:
    for name, value in {**BUILT_IN, **{f"${k}": v for k, v in chosen.items()}}.items():
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    return expr


def label_values(server: Prometheus, query: str) -> list[str]:
    """What Grafana's label_values(selector, label) gives: the label's values among the selector's series."""
    found = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", query.strip())
    assert found, query
    selector, label = found.groups()
    now = time.time()
    series = server.api("series", **{"match[]": selector, "start": str(now - 3600), "end": str(now)})
    return sorted({item[label] for item in series if label in item})


def resolve(server: Prometheus, board: dict[str, Any], single: dict[str, int] | None = None) -> dict[str, str]:
    """Each query variable resolved in order by its own label_values() (earlier ones substituted): all of
    its values, or the one `single` picks."""
    chosen: dict[str, str] = {}
    for variable in variables(board):
        if variable["type"] != "query":
            continue
        values = label_values(server, substitute(variable["query"], chosen))
        assert values, f"variable {variable['name']}: {variable['query']} has no values"
        pick = (single or {}).get(variable["name"])
        chosen[variable["name"]] = grafana_regex(values if pick is None else [values[pick % len(values)]])
    return chosen


def page_series(page: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and not line.startswith("#")}


def test_no_query_names_a_series_the_page_lacks(scraped) -> None:
    """Every atopgpud_* name in a query has samples on the daemon's page."""
    _, page = scraped
    exposed = page_series(page)
    named = {name for _, expr in targets(dashboard()) for name in METRIC.findall(expr)}
    named |= {name for variable in variables(dashboard()) for name in METRIC.findall(str(variable.get("query")))}
    assert named - exposed == set()


@pytest.mark.parametrize("choice", ["all", "first GPU", "second GPU"])
def test_every_panel_query_returns_data(scraped, choice: str) -> None:
    """With the variables resolved (all hosts and GPUs, or one GPU), each panel's query is non-empty."""
    server, _ = scraped
    board = dashboard()
    single = {"all": None, "first GPU": {"gpu": 0}, "second GPU": {"gpu": 1}}[choice]
    chosen = resolve(server, board, single)
    empty = []
    for title, expr in targets(board):
        query = substitute(expr, chosen)
        assert "$" not in query, (title, query)
        if not server.query(query):
            empty.append(f"{title}: {query}")
    assert not empty, "empty panels:\n" + "\n".join(empty)
