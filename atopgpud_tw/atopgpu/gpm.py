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
from atopgpud_tw.figures import GPM_FIGURES, Show

_P = "atopgpud_gpu_gpm_"
#: the table's GPM rows (figures.GPM_FIGURES), each with its metric and its view
_ROWS = tuple((f.gpm, f.show) for f in GPM_FIGURES if f.gpm is not None and f.show is not None)
#: series (without the prefix and ``_total``) -> the figure's name: percent-seconds, then bytes
_PERCENTS = {f.family.name[len(_P):].removesuffix("_total"): f.gpm.name
             for f in GPM_FIGURES if f.gpm is not None and not f.gpm.rate}
_BYTES = {f.family.name[len(_P):]: f.gpm.name for f in GPM_FIGURES if f.gpm is not None and f.gpm.rate}

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
        for gpm, show in _ROWS:
            rate = None
            if span > 0 and gpm.name in now:
                rate = round((now[gpm.name] - then.get(gpm.name, 0.0)) / span / show.per, 2)
            entry[show.key[0]] = rate
        gpus.append(entry)
    return {"endpoint": url, "time": round(time.time(), 3), "gpus": gpus}


_SHOWN = tuple(show for _, show in _ROWS if show.column is not None)
_HEADER = ("BUSID", "TYPE", *(str(show.column) for show in _SHOWN))


def render_gpm(doc: dict[str, Any]) -> str:
    """The report as text: one row per device, `-` where it has no such figure."""
    def cell(value: Any, show: Show) -> str:
        return "-" if value is None else f"{value:.{show.decimals}f}{show.unit}"

    rows = [
        [gpu["busid"], gpu["type"].replace(" ", "_"), *(cell(gpu[show.key[0]], show) for show in _SHOWN)]
        for gpu in doc["gpus"]
    ]
    lines = [f"atopgpud GPM at {printable(doc['endpoint'])}"]
    lines.extend(columns(_HEADER, rows, {0, 1}))
    if not doc["gpus"]:
        lines.append("(no GPM figures: no GPU with GPM, Hopper or later)")
    return "\n".join(lines)
