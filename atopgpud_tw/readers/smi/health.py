"""The health and power figures of an ``nvidia-smi -q -x`` report: pure functions over its elements.

The same series as the NVML reader's (atopgpud_tw/readers/nvml/health.py), from the
report each poll already fetched: nothing more is run for them, and they are
parsed only when ``/metrics`` is fetched.  Element names differ across schema
versions (v9 to v13), so each figure is looked for under every name it has
had, newest first; docs/metrics.md has the table.  A value nvidia-smi cannot
give ("N/A", "Not Supported", ...), cannot be read, or is beyond what a GPU
can report (a garbled report) has no series.  The
report has no energy counter and no XID counts.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from atopgpud_tw.health import CLOCKS_EVENT_REASONS, CardHealth, Series
from atopgpud_tw.readers.smi.values import gpu_busid, not_available

_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z%]*)\s*$")
_PSTATE = re.compile(r"^\s*P(\d+)\s*$")
#: each figure's paths, newest schema first
_PLAIN: tuple[tuple[Series, float, tuple[str, ...]], ...] = (
    (("atopgpud_gpu_temperature_celsius", ()), 1, ("temperature/gpu_temp",)),
    (("atopgpud_gpu_memory_temperature_celsius", ()), 1, ("temperature/memory_temp",)),
    (("atopgpud_gpu_power_watts", ()), 1,
     ("gpu_power_readings/instant_power_draw", "gpu_power_readings/power_draw", "power_readings/power_draw")),
    (("atopgpud_gpu_power_limit_watts", ()), 1,
     ("gpu_power_readings/current_power_limit", "power_readings/enforced_power_limit")),
    (("atopgpud_gpu_clock_hertz", (("clock", "graphics"),)), 1e6, ("clocks/graphics_clock",)),
    (("atopgpud_gpu_clock_hertz", (("clock", "sm"),)), 1e6, ("clocks/sm_clock",)),
    (("atopgpud_gpu_clock_hertz", (("clock", "memory"),)), 1e6, ("clocks/mem_clock",)),
    (("atopgpud_gpu_fan_speed_percent", ()), 1, ("fan_speed",)),
    (("atopgpud_gpu_remapped_rows", (("cause", "correctable"),)), 1, ("remapped_rows/remapped_row_corr",)),
    (("atopgpud_gpu_remapped_rows", (("cause", "uncorrectable"),)), 1, ("remapped_rows/remapped_row_unc",)),
    (("atopgpud_gpu_pcie_replays_total", ()), 1, ("pci/replay_counter",)),
)
#: the most a figure can plausibly be; a report beyond it is garbled, and the figure left out
_MOST = {
    "atopgpud_gpu_temperature_celsius": 250.0,
    "atopgpud_gpu_memory_temperature_celsius": 250.0,
    "atopgpud_gpu_power_watts": 100_000.0,
    "atopgpud_gpu_power_limit_watts": 100_000.0,
    "atopgpud_gpu_clock_hertz": 100e9,
    "atopgpud_gpu_fan_speed_percent": 100.0,
}
_FLAGS = (
    ("atopgpud_gpu_row_remap_pending", "remapped_rows/remapped_row_pending"),
    ("atopgpud_gpu_row_remap_failed", "remapped_rows/remapped_row_failure"),
)
#: (error label, the parts summed in the sram_/dram_ layout, the old single/double-bit total)
_ECC = (
    ("corrected", (("sram_correctable",), ("dram_correctable",)), "single_bit/total"),
    ("uncorrected", (("sram_uncorrectable", "sram_uncorrectable_parity+sram_uncorrectable_secded"),
                     ("dram_uncorrectable",)), "double_bit/total"),
)


def read_cards_health(root: ET.Element) -> list[CardHealth]:
    """Every card's health figures in a parsed report, keyed by bus id."""
    readings = []
    for gpu in root.findall("gpu"):
        busid = gpu_busid(gpu)
        if busid:
            readings.append(card_health(gpu, busid))
    return readings


def card_health(gpu: ET.Element, busid: str) -> CardHealth:
    """One ``<gpu>`` element's figures."""
    uuid = _text(gpu, "uuid") or ""
    reading = CardHealth(busid, busid, _text(gpu, "product_name") or "", uuid="" if not_available(uuid) else uuid)
    values = reading.values
    for series, scale, paths in _PLAIN:
        value = _first_number(gpu, paths)
        if value is not None and value * scale <= _MOST.get(series[0], float("inf")):
            values[series] = value * scale
    for name, path in _FLAGS:
        flag = _yes_no(_text(gpu, path))
        if flag is not None:
            values[(name, ())] = flag
    state = _PSTATE.match(_text(gpu, "performance_state") or "")
    if state:
        values[("atopgpud_gpu_performance_state", ())] = float(state.group(1))
    reasons = gpu.find("clocks_event_reasons")
    prefix = "clocks_event_reason_"
    if reasons is None:
        reasons, prefix = gpu.find("clocks_throttle_reasons"), "clocks_throttle_reason_"
    if reasons is not None:
        for name, _ in CLOCKS_EVENT_REASONS:
            tag = prefix + ("display_clocks_setting" if name == "display_clock_setting" else name)
            active = _active(_text(reasons, tag))
            if active is not None:
                values[("atopgpud_gpu_clocks_event_active", (("reason", name),))] = active
    for counter in ("volatile", "aggregate"):
        errors = gpu.find(f"ecc_errors/{counter}")
        if errors is None:
            continue
        for label, parts, old in _ECC:
            count = _ecc_count(errors, parts, old)
            if count is not None:
                values[("atopgpud_gpu_ecc_errors_total", (("error", label), ("counter", counter)))] = count
    return reading


def _ecc_count(errors: ET.Element, parts: tuple[tuple[str, ...], ...], old: str) -> float | None:
    """An ECC count: the old layout's total, else the sum of the sram_/dram_ parts present."""
    if errors.find(old.split("/")[0]) is not None:
        return _number(_text(errors, old))
    found = []
    for names in parts:
        for name in names:
            value = _sum_of(errors, name.split("+"))
            if value is not None:
                found.append(value)
                break
    return sum(found) if found else None


def _sum_of(errors: ET.Element, names: list[str]) -> float | None:
    values = [_number(_text(errors, name)) for name in names]
    if any(value is None for value in values):
        return None
    return sum(value for value in values if value is not None)


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    if found is None or found.text is None or len(found):
        return None
    return found.text.strip()


def _number(text: str | None) -> float | None:
    """A number with an optional unit ("45 C", "250.50 W", "1410 MHz", "30 %"); None for N/A and the like."""
    if text is None:
        return None
    match = _NUMBER.match(text)
    if not match:
        return None
    value = float(match.group(1))
    return value if value >= 0 else None


def _first_number(gpu: ET.Element, paths: tuple[str, ...]) -> float | None:
    for path in paths:
        if gpu.find(path) is not None:
            return _number(_text(gpu, path))
    return None


def _yes_no(text: str | None) -> float | None:
    return {"yes": 1.0, "no": 0.0}.get((text or "").lower())


def _active(text: str | None) -> float | None:
    return {"active": 1.0, "not active": 0.0}.get((text or "").lower())
