#!/usr/bin/env python3
"""Writes etc/grafana/atopgpud.json, the Grafana dashboard of atopgpud's /metrics, from the table below.

A panel is one `Panel(...)` line in `ROWS`: a title, a unit, and its PromQL
queries (``$sel`` stands for the host and GPU selector, ``$wl`` for it and the
workload).  A new row or panel is
a line here and a run of this script (``python3 etc/grafana/make_dashboard.py``);
tests/test_dashboard.py checks that the JSON is this script's output and runs
every query against a real Prometheus.  The file is Grafana's classic dashboard
model (https://grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).with_name("atopgpud.json")
#: the classic model's schema version of Grafana 12
SCHEMA_VERSION = 41
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: the host and GPU variables, as every per-GPU query selects them
SEL = 'instance=~"$instance", uuid=~"$gpu"'
HOST = 'instance=~"$instance"'
#: the selector of the workload series: the host, GPU and workload variables
WORKLOAD = SEL + ', workload=~"$workload"'
GPU_LEGEND = "{{instance}} {{busid}}"
#: a process: its pid, and who it is where --metrics-process-context labels it (empty otherwise)
PROCESS_LEGEND = "{{instance}} {{busid}} pid {{pid}} {{user}} {{comm}} {{workload}}"
WORKLOAD_LEGEND = "{{instance}} {{kind}} {{workload}}"
#: the labels a workload's series are summed by, over its GPUs
BY_WORKLOAD = "sum by (instance, kind, workload) "


@dataclass
class Panel:
    title: str
    unit: str
    queries: list[tuple[str, str]]  # (expression, legend)
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8
    options: dict = field(default_factory=dict)


def q(expr: str, legend: str = GPU_LEGEND) -> tuple[str, str]:
    return expr.replace("$sel", SEL).replace("$wl", WORKLOAD).replace("$host", HOST), legend


def gpm(family: str, legend: str) -> tuple[str, str]:
    """A GPM counter's rate over that of the seconds GPM covered: its exact average over the covered time."""
    return q(f"rate(atopgpud_gpu_gpm_{family}_total{{$sel}}[$__rate_interval]) "
             "/ rate(atopgpud_gpu_gpm_seconds_total{$sel}[$__rate_interval])", f"{GPU_LEGEND} {legend}")


ROWS: list[tuple[str, list[Panel]]] = [
    ("Overview", [
        Panel("GPUs present", "none", [q("sum(atopgpud_gpu_present{$sel})", "present")], kind="stat", width=4,
              height=5, description="GPUs read in the last poll (a lost GPU counts 0)."),
        Panel("Busy now (average)", "percent", [q("avg(rate(atopgpud_gpu_busy_percent_seconds_total{$sel}"
                                                  "[$__rate_interval]))", "busy")], kind="stat", width=4, height=5),
        Panel("Energy in range", "kwatth", [q("sum(increase(atopgpud_gpu_energy_joules_total{$sel}[$__range])) "
                                              "/ 3.6e6", "energy")], kind="stat", width=4, height=5),
        Panel("XIDs in range", "none", [q("sum(increase(atopgpud_gpu_xid_events_total{$sel}[$__range]))", "XIDs")],
              kind="stat", width=4, height=5, description="XID critical errors the driver reported."),
        Panel("Inventory", "none", [q("atopgpud_gpu_info{$sel}", "")], kind="table", width=24, height=6,
              description="What each GPU is: join any series on uuid."),
    ]),
    ("Busy", [
        Panel("GPU busy", "percent", [q("rate(atopgpud_gpu_busy_percent_seconds_total{$sel}[$__rate_interval])")],
              description="Average of every driver sample over the span (atop's figure, over real time)."),
        Panel("Memory controller busy", "percent",
              [q("rate(atopgpud_gpu_memory_busy_percent_seconds_total{$sel}[$__rate_interval])")]),
    ]),
    ("Memory", [
        Panel("Memory used", "bytes", [q("atopgpud_gpu_memory_used_bytes{$sel}"),
                                       q("atopgpud_gpu_memory_total_bytes{$sel}", "{{instance}} {{busid}} total"),
                                       q("atopgpud_gpu_memory_reserved_bytes{$sel}",
                                         "{{instance}} {{busid}} reserved")],
              description="Used leaves out what the driver reserves (shown apart where the driver reports it)."),
        Panel("Memory used, share", "percent",
              [q("100 * atopgpud_gpu_memory_used_bytes{$sel} / atopgpud_gpu_memory_total_bytes{$sel}")]),
    ]),
    ("Health", [
        Panel("Temperature", "celsius", [q("atopgpud_gpu_temperature_celsius{$sel}"),
                                         q("atopgpud_gpu_memory_temperature_celsius{$sel}",
                                           "{{instance}} {{busid}} memory")], width=8),
        Panel("Power", "watt", [q("atopgpud_gpu_power_watts{$sel}"),
                                q("atopgpud_gpu_power_limit_watts{$sel}", "{{instance}} {{busid}} limit")], width=8),
        Panel("Clocks", "hertz", [q("atopgpud_gpu_clock_hertz{$sel}", "{{instance}} {{busid}} {{clock}}")], width=8),
        Panel("Fan speed", "percent", [q("atopgpud_gpu_fan_speed_percent{$sel}")], width=8),
        Panel("Performance state", "none", [q("atopgpud_gpu_performance_state{$sel}")], width=8,
              description="P0 (0) is the highest."),
        Panel("Health figures' age", "s", [q("atopgpud_gpu_health_age_seconds{$sel}")], width=8,
              description="Seconds since the health figures shown were read."),
        Panel("ECC errors", "none", [q("sum by (instance, busid, uuid, error) "
                                       "(increase(atopgpud_gpu_ecc_errors_total{$sel, counter=\"volatile\"}"
                                       "[$__rate_interval]))", "{{instance}} {{busid}} {{error}}")], width=8),
        Panel("Remapped rows", "none", [q("atopgpud_gpu_remapped_rows{$sel}", "{{instance}} {{busid}} {{cause}}"),
                                        q("atopgpud_gpu_row_remap_pending{$sel}", "{{instance}} {{busid}} pending"),
                                        q("atopgpud_gpu_row_remap_failed{$sel}", "{{instance}} {{busid}} failed")],
              width=8),
        Panel("PCIe replays", "ops", [q("rate(atopgpud_gpu_pcie_replays_total{$sel}[$__rate_interval])")], width=8),
    ]),
    ("Throttling", [
        Panel("Throttled time, by clock event reason", "percentunit",
              [q("rate(atopgpud_gpu_clocks_event_seconds_total{$sel}[$__rate_interval])",
                 "{{instance}} {{busid}} {{reason}}")],
              description="The share of the time each reason held the clocks down: the driver's own counters, "
                          "exact whatever the scrape interval."),
        Panel("Throttled time, by violation policy", "percentunit",
              [q("rate(atopgpud_gpu_violation_seconds_total{$sel}[$__rate_interval])",
                 "{{instance}} {{busid}} {{policy}}")],
              description="The share of the time each performance policy held the clocks down "
                          "(nvmlDeviceGetViolationStatus)."),
        Panel("Clock event reasons, share of the time", "percentunit",
              [q("avg_over_time(atopgpud_gpu_clocks_event_active{$sel}[$__rate_interval])",
                 "{{instance}} {{busid}} {{reason}}")], width=24,
              description="The share of scrapes that saw each reason active (gpu_idle is no throttling)."),
    ]),
    ("XIDs", [
        Panel("XID errors by code", "none", [q("increase(atopgpud_gpu_xid_errors_total{$sel}[$__rate_interval])",
                                               "{{instance}} {{busid}} XID {{xid}}")], kind="timeseries",
              width=8, options={"drawStyle": "bars"}),
        Panel("XID errors since start", "none", [q("atopgpud_gpu_xid_events_total{$sel}")], width=8),
        Panel("Time since the last XID", "s", [q("time() - atopgpud_gpu_xid_last_seconds{$sel}")], width=8,
              description="Since the daemon last saw the GPU's XID count go up (no series before the first XID)."),
    ]),
    ("Engines and links", [
        Panel("Engine busy", "percent", [q("atopgpud_gpu_engine_busy_percent{$sel}",
                                           "{{instance}} {{busid}} {{engine}}")], width=8,
              description="Encoder, decoder, JPEG and OFA busy over the driver's sampling period."),
        Panel("PCIe throughput", "Bps", [q("atopgpud_gpu_pcie_throughput_bytes_per_second{$sel}",
                                           "{{instance}} {{busid}} {{direction}}")], width=8,
              description="Bytes per second over the driver's 20 ms window (a reading of one instant)."),
        Panel("PCIe link", "none", [q("atopgpud_gpu_pcie_link_generation{$sel}", "{{instance}} {{busid}} generation"),
                                    q("atopgpud_gpu_pcie_link_width{$sel}", "{{instance}} {{busid}} lanes")],
              width=8, description="The link's current generation and width (lanes)."),
        Panel("NVLink throughput", "Bps",
              [q("sum by (instance, busid, uuid, direction) "
                 "(rate(atopgpud_gpu_nvlink_bytes_total{$sel}[$__rate_interval]))",
                 "{{instance}} {{busid}} {{direction}}")],
              description="Bytes per second over every active link."),
        Panel("NVLink errors", "none",
              [q("sum by (instance, busid, uuid, error) "
                 "(increase(atopgpud_gpu_nvlink_errors_total{$sel}[$__rate_interval]))",
                 "{{instance}} {{busid}} {{error}}")],
              description="Errors per span over every active link, per kind."),
    ]),
    ("Limits", [
        Panel("Clocks, share of their maximum", "percentunit",
              [q("atopgpud_gpu_clock_hertz{$sel} / atopgpud_gpu_clock_max_hertz{$sel}",
                 "{{instance}} {{busid}} {{clock}}")], width=8),
        Panel("Maximum clocks", "hertz", [q("atopgpud_gpu_clock_max_hertz{$sel}",
                                            "{{instance}} {{busid}} {{clock}}")], width=8),
        Panel("Temperature and its thresholds", "celsius",
              [q("atopgpud_gpu_temperature_celsius{$sel}"),
               q("atopgpud_gpu_temperature_threshold_celsius{$sel}", "{{instance}} {{busid}} {{threshold}}")],
              width=8, description="gpu_max is the maximum operating temperature; slowdown and shutdown "
                                   "the driver's limits."),
    ]),
    ("GPM (Hopper and later)", [
        Panel("GPM graphics and SM activity", "percent",
              [gpm("graphics_percent_seconds", "graphics"), gpm("sm_active_percent_seconds", "SM active"),
               gpm("sm_occupancy_percent_seconds", "SM occupancy")],
              description="GPU Performance Monitoring, exact averages over the time it covered."),
        Panel("GPM tensor and pipe activity", "percent",
              [gpm("tensor_active_percent_seconds", "tensor"), gpm("fp64_active_percent_seconds", "FP64"),
               gpm("fp32_active_percent_seconds", "FP32"), gpm("fp16_active_percent_seconds", "FP16")]),
        Panel("GPM DRAM bandwidth", "percent", [gpm("dram_bandwidth_percent_seconds", "DRAM")], width=8,
              description="DRAM bandwidth used, of the most."),
        Panel("GPM PCIe bytes", "Bps", [gpm("pcie_transmit_bytes", "tx"), gpm("pcie_receive_bytes", "rx")],
              width=8),
        Panel("GPM NVLink bytes", "Bps", [gpm("nvlink_transmit_bytes", "tx"), gpm("nvlink_receive_bytes", "rx")],
              width=8),
        Panel("GPM coverage", "percentunit",
              [q("rate(atopgpud_gpu_gpm_seconds_total{$sel}[$__rate_interval])")], width=24, height=5,
              description="The share of the time GPM's figures covered (1 while every sample works)."),
    ]),
    ("Energy", [
        Panel("Power from the energy counter", "watt",
              [q("rate(atopgpud_gpu_energy_joules_total{$sel}[$__rate_interval])")],
              description="The driver's energy counter: exact between any two scrapes."),
        Panel("Energy", "kwatth", [q("increase(atopgpud_gpu_energy_joules_total{$sel}[$__rate_interval]) / 3.6e6")]),
    ]),
    ("Workloads (--workloads)", [
        Panel("GPUs busy per workload", "none",
              [q(BY_WORKLOAD + "(rate(atopgpud_workload_busy_percent_seconds_total{$wl}[$__rate_interval])) / 100",
                 WORKLOAD_LEGEND)],
              description="GPUs its processes kept busy (1: one GPU all the time), the ended ones included."),
        Panel("Memory held per workload", "bytes",
              [q(BY_WORKLOAD + "(rate(atopgpud_workload_memory_used_byte_seconds_total{$wl}[$__rate_interval]))",
                 WORKLOAD_LEGEND)],
              description="The average GPU memory its processes held: rate() of the byte-seconds."),
        Panel("Processes per workload", "none",
              [q(BY_WORKLOAD + "(increase(atopgpud_workload_processes_total{$wl}[$__rate_interval]))",
                 "{{instance}} {{kind}} {{workload}} seen"),
               q(BY_WORKLOAD + "(increase(atopgpud_workload_processes_ended_total{$wl}[$__rate_interval]))",
                 "{{instance}} {{kind}} {{workload}} ended")],
              description="Processes seen on its GPUs, and those that ended, per span."),
        Panel("Energy share per workload", "watt",
              [q(BY_WORKLOAD + "(rate(atopgpud_workload_energy_joules_total{$wl}[$__rate_interval]))",
                 WORKLOAD_LEGEND)],
              description="The GPU's energy shared out by busy time: an estimate (docs/metrics.md, Workloads)."),
    ]),
    ("Processes (--metrics-processes)", [
        Panel("Process GPU busy", "percent",
              [q("rate(atopgpud_process_busy_percent_seconds_total{$sel}[$__rate_interval])", PROCESS_LEGEND)],
              width=8, description="User, command and workload in the legend with --metrics-process-context."),
        Panel("Process memory busy", "percent",
              [q("rate(atopgpud_process_memory_busy_percent_seconds_total{$sel}[$__rate_interval])",
                 PROCESS_LEGEND)], width=8),
        Panel("Process memory used", "bytes", [q("atopgpud_process_memory_used_bytes{$sel}", PROCESS_LEGEND)],
              width=8),
    ]),
    ("The daemon", [
        Panel("Polls", "ops", [q("rate(atopgpud_polls_total{$host}[$__rate_interval])", "{{instance}}")], width=6),
        Panel("atop clients connected", "none", [q("atopgpud_clients_connected{$host}", "{{instance}}")], width=6),
        Panel("NVML call running", "s", [q("atopgpud_nvml_call_seconds{$host}", "{{instance}}")], width=6,
              description="Seconds the NVML call in progress has run (0: none)."),
        Panel("Workload series", "none", [q("atopgpud_workload_series{$host}", "{{instance}} series"),
                                          q("increase(atopgpud_workloads_expired_total{$host}[$__rate_interval])",
                                            "{{instance}} expired")], width=6,
              description="Workload series on the page (--workload-limit), and those that left it per span."),
    ]),
]


def variables() -> list[dict]:
    def query(name: str, label: str, expr: str) -> dict:
        return {
            "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": expr,
            "definition": expr, "refresh": 2, "sort": 1, "multi": True, "includeAll": True,
            "current": {"text": ["All"], "value": ["$__all"]}, "options": [],
        }

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1},
        query("instance", "Host", "label_values(atopgpud_build_info, instance)"),
        query("gpu", "GPU", 'label_values(atopgpud_gpu_info{instance=~"$instance"}, uuid)'),
        query("workload", "Workload",
              f"label_values(atopgpud_workload_busy_percent_seconds_total{{{SEL}}}, workload)"),
    ]


def panel_json(panel: Panel, ident: int, x: int, y: int) -> dict:
    targets = [
        {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + n),
         **({"instant": True, "format": "table"} if panel.kind == "table" else {"range": True})}
        for n, (expr, legend) in enumerate(panel.queries)
    ]
    body: dict = {
        "id": ident, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []}, "targets": targets,
    }
    if panel.kind == "timeseries":
        body["fieldConfig"]["defaults"]["custom"] = {"drawStyle": panel.options.get("drawStyle", "line"),
                                                     "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        body["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                           "tooltip": {"mode": "multi", "sort": "desc"}}
    elif panel.kind == "stat":
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                           "colorMode": "value", "graphMode": "area"}
    elif panel.kind == "table":
        body["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True,
                                                                                     "__name__": True}}}]
    return body


def dashboard() -> dict:
    panels: list[dict] = []
    ident = 1
    y = 0
    for title, row in ROWS:
        panels.append({"id": ident, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        ident += 1
        y += 1
        x, line_height = 0, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + line_height
                line_height = 0
            panels.append(panel_json(panel, ident, x, y))
            ident += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": "atopgpud", "title": "atopgpud: NVIDIA GPUs", "tags": ["atopgpud", "gpu", "nvidia"],
        "description": "GPU busy, memory, health, throttling, XIDs, engines, links, GPM, energy, workloads and "
                       "processes from atopgpud's /metrics.",
        "editable": True, "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "annotations": {"list": []}, "links": [], "templating": {"list": variables()}, "panels": panels,
    }


def text() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(text())
    print(f"wrote {OUT}")
