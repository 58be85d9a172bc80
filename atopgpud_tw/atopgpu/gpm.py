"""``atopgpu --gpm``: what each GPU and MIG instance really did, from GPM's counters on the metrics page.

GPM (GPU Performance Monitoring, Hopper and later) is on the daemon's
``--metrics`` page as exact cumulative counters (docs/metrics.md,
"GPM series").  A figure over a span is the increase of its counter divided
by the increase of ``atopgpud_gpu_gpm_seconds``: the page is fetched twice,
``--watch`` seconds apart (1 s without it), and every report after that is over
the time since the one before.  A device without GPM is not listed.
"""

from __future__ import annotations

import math
import time
from typing import Any

from atopgpud_tw.atopgpu.health import _samples
from atopgpud_tw.atopgpu.table import columns
from atopgpud_tw.codec import printable

MIB = 1048576
#: series suffix -> the report's key; percent-seconds, then bytes
_PERCENTS = {
    "graphics_percent_seconds": "graphics", "sm_active_percent_seconds": "sm",
    "sm_occupancy_percent_seconds": "sm_occupancy", "tensor_active_percent_seconds": "tensor",
    "dram_bandwidth_percent_seconds": "dram", "fp64_active_percent_seconds": "fp64",
    "fp32_active_percent_seconds": "fp32", "fp16_active_percent_seconds": "fp16",
}
_BYTES = {
    "pcie_transmit_bytes_total": "pcie_tx", "pcie_receive_bytes_total": "pcie_rx",
    "nvlink_transmit_bytes_total": "nvlink_tx", "nvlink_receive_bytes_total": "nvlink_rx",
}
_P = "atopgpud_gpu_gpm_"

Counters = dict[tuple[str, str], dict[str, float]]


def gpm_counters(text: str, url: str) -> Counters:
    """The GPM counters of a metrics page, by device (bus id, type)."""
    found: Counters = {}
    for name, labels, value in _samples(text, url):
        if not name.startswith(_P) or math.isnan(value):
            continue
        short = name[len(_P):]
        key = "seconds" if short == "seconds_total" else _PERCENTS.get(short.removesuffix("_total"), _BYTES.get(short))
        if key is not None:
            found.setdefault((labels.get("busid", ""), labels.get("type", "")), {})[key] = value
    return found


def gpm_report(before: Counters, after: Counters, url: str) -> dict[str, Any]:
    """The JSON document: per device, each figure's average between two readings (null where it has none)."""
    gpus = []
    for (busid, kind), now in sorted(after.items()):
        then = before.get((busid, kind), {})
        span = now.get("seconds", 0.0) - then.get("seconds", 0.0)
        entry: dict[str, Any] = {"busid": busid, "type": kind, "seconds": round(span, 3)}
        for key in (*_PERCENTS.values(), *_BYTES.values()):
            rate = None
            if span > 0 and key in now:
                rate = (now[key] - then.get(key, 0.0)) / span
                rate = round(rate / MIB if key in _BYTES.values() else rate, 2)
            entry[key if key not in _BYTES.values() else f"{key}_mib_s"] = rate
        gpus.append(entry)
    return {"endpoint": url, "time": round(time.time(), 3), "gpus": gpus}


_HEADER = ("BUSID", "TYPE", "GRACT", "SMACT", "SMOCC", "TENSOR", "DRAM", "PCIE-TX", "PCIE-RX", "NVL-TX", "NVL-RX")


def render_gpm(doc: dict[str, Any]) -> str:
    """The report as text: one row per device, `-` where it has no such figure."""
    def cell(value: Any, unit: str) -> str:
        return "-" if value is None else f"{value:.1f}{unit}"

    rows = [
        [gpu["busid"], gpu["type"].replace(" ", "_"),
         *(cell(gpu[key], "%") for key in ("graphics", "sm", "sm_occupancy", "tensor", "dram")),
         *(cell(gpu[f"{key}_mib_s"], "MiB/s") for key in ("pcie_tx", "pcie_rx", "nvlink_tx", "nvlink_rx"))]
        for gpu in doc["gpus"]
    ]
    lines = [f"atopgpud GPM at {printable(doc['endpoint'])}"]
    lines.extend(columns(_HEADER, rows, {0, 1}))
    if not doc["gpus"]:
        lines.append("(no GPM figures: no GPU with GPM, Hopper or later)")
    return "\n".join(lines)
