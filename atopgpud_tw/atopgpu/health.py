"""``atopgpu --health``: the daemon's health and power figures for one host, from its metrics page.

atop's protocol has no health figures, so these are fetched from the daemon's
``--metrics`` endpoint (``--metrics-url``) and read with prometheus_client's
parser of the text format.  The page is checked as a reply is: it must be a
metrics page of atopgpud (``atopgpud_build_info``), and every figure a number.
The JSON schema and the table are in docs/atopgpu.md.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from typing import Any

from atopgpud_tw.atopgpu.connection import BadReply, ClientError
from atopgpud_tw.codec import printable

DEFAULT_URL = "http://127.0.0.1:9445/metrics"
#: seconds to wait for the page (the daemon waits at most 2 s for a stuck NVML call)
FETCH_TIMEOUT = 10.0
_P = "atopgpud_gpu_"
_SIMPLE = {
    "temperature_celsius": "temperature_c",
    "memory_temperature_celsius": "memory_temperature_c",
    "power_watts": "power_w",
    "power_limit_watts": "power_limit_w",
    "energy_joules_total": "energy_j",
    "performance_state": "performance_state",
    "fan_speed_percent": "fan_percent",
    "pcie_replays_total": "pcie_replays",
    "row_remap_pending": "row_remap_pending",
    "row_remap_failed": "row_remap_failed",
    "health_age_seconds": "age_seconds",
}


def fetch(url: str, timeout: float = FETCH_TIMEOUT) -> str:
    """The metrics page at `url`; ClientError (exit status 1) when there is none, BadReply (3) when it is not one."""
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"{url}: not an http:// URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except urllib.error.HTTPError as error:
        raise BadReply(f"{url}: HTTP {error.code} {error.reason}") from None
    except urllib.error.URLError as error:
        reason = getattr(error.reason, "strerror", None) or str(error.reason)
        raise ClientError(f"{url}: {reason}; is atopgpud running with --metrics?") from None
    except (TimeoutError, OSError) as error:
        raise ClientError(f"{url}: {error.strerror or error}; is atopgpud running with --metrics?") from None
    except UnicodeDecodeError:
        raise BadReply(f"{url}: the page is not UTF-8 text") from None


def _samples(text: str, url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        found = [(s.name, dict(s.labels), float(s.value))
                 for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as error:
        raise BadReply(f"{url}: not a Prometheus text page ({error})") from None
    if not any(name == "atopgpud_build_info" for name, _, _ in found):
        raise BadReply(f"{url}: not an atopgpud metrics page (no atopgpud_build_info)")
    return found


def health_report(text: str, url: str) -> dict[str, Any]:
    """The JSON document: one object per card with health figures, null where the card has none."""
    cards: dict[str, dict[str, Any]] = {}

    def card(labels: dict[str, str]) -> dict[str, Any]:
        busid = labels.get("busid", "")
        if busid not in cards:
            cards[busid] = {
                "busid": busid, "type": labels.get("type", ""), "present": None, "stale": None,
                **{key: None for key in _SIMPLE.values()},
                "clocks_mhz": {"graphics": None, "sm": None, "memory": None},
                "clocks_event_reasons": [],
                "ecc_errors": {"corrected": {"volatile": None, "aggregate": None},
                               "uncorrected": {"volatile": None, "aggregate": None}},
                "remapped_rows": {"correctable": None, "uncorrectable": None},
                "xid_errors": {},
            }
        return cards[busid]

    present: dict[str, float] = {}
    for name, labels, value in _samples(text, url):
        if math.isnan(value) or not name.startswith(_P):
            continue
        short = name[len(_P):]
        if short == "present":
            present[labels.get("busid", "")] = value
            continue
        if short in _SIMPLE:
            card(labels)[_SIMPLE[short]] = _whole(value)
        elif short == "health_stale":
            card(labels)["stale"] = value == 1
        elif short == "clock_hertz" and labels.get("clock") in ("graphics", "sm", "memory"):
            card(labels)["clocks_mhz"][labels["clock"]] = _whole(value / 1e6)
        elif short == "clocks_event_active" and value == 1:
            card(labels)["clocks_event_reasons"].append(labels.get("reason", ""))
        elif short == "ecc_errors_total":
            errors = card(labels)["ecc_errors"].get(labels.get("error", ""))
            if errors is not None and labels.get("counter") in errors:
                errors[labels["counter"]] = _whole(value)
        elif short == "remapped_rows" and labels.get("cause") in ("correctable", "uncorrectable"):
            card(labels)["remapped_rows"][labels["cause"]] = _whole(value)
        elif short == "xid_errors_total":
            card(labels)["xid_errors"][labels.get("xid", "")] = _whole(value)
        elif short == "xid_events_total":
            card(labels)  # a card that reports XIDs, none yet: listed with {}
    for busid, found in cards.items():
        # a MIG card's instances share its bus id: it is present if any of them is
        values = [v for key, v in present.items() if key == busid or key.startswith(busid + "/")]
        found["present"] = bool(max(values)) if values else None
    return {
        "endpoint": url,
        "time": round(time.time(), 3),
        "gpus": sorted(cards.values(), key=lambda c: c["busid"]),
    }


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 3)


def _cell(value: Any, unit: str = "", decimals: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{decimals}f}{unit}"


_HEADER = ("BUSID", "TYPE", "TEMP", "MEMTEMP", "POWER", "LIMIT", "ENERGY", "SM", "MEM", "PSTATE", "FAN",
           "ECC-C", "ECC-U", "XID", "THROTTLE")


def render_health(doc: dict[str, Any]) -> str:
    """The report as text: one row per card, `-` where the card has no such figure."""
    from atopgpud_tw.atopgpu.cli import _columns

    rows = []
    for gpu in doc["gpus"]:
        ecc = gpu["ecc_errors"]
        xids = ",".join(f"{code}x{count}" for code, count in sorted(gpu["xid_errors"].items())) or "-"
        throttle = ",".join(r for r in gpu["clocks_event_reasons"] if r != "gpu_idle") or "-"
        flags = [flag for flag, on in (("stale", gpu["stale"]), ("gone", gpu["present"] is False)) if on]
        rows.append([
            gpu["busid"], gpu["type"].replace(" ", "_") + (f" ({','.join(flags)})" if flags else ""),
            _cell(gpu["temperature_c"], "C"), _cell(gpu["memory_temperature_c"], "C"),
            _cell(gpu["power_w"], "W", 1), _cell(gpu["power_limit_w"], "W"),
            _cell(None if gpu["energy_j"] is None else gpu["energy_j"] / 1000, "kJ", 1),
            _cell(gpu["clocks_mhz"]["sm"], "MHz"), _cell(gpu["clocks_mhz"]["memory"], "MHz"),
            "-" if gpu["performance_state"] is None else f"P{gpu['performance_state']}",
            _cell(gpu["fan_percent"], "%"),
            _cell(ecc["corrected"]["volatile"]), _cell(ecc["uncorrected"]["volatile"]), xids, throttle,
        ])
    lines = [f"atopgpud health at {printable(doc['endpoint'])}"]
    lines.extend(_columns(_HEADER, rows, {0, 1, 13, 14}))
    if not doc["gpus"]:
        lines.append("(no health figures: no GPU, or a reader without them)")
    return "\n".join(lines)
