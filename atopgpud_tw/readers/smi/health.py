"""The health and power figures of an ``nvidia-smi -q -x`` report: pure functions over its elements.

The NVML reader's series, from the report each poll already fetched, read only when
``/metrics`` is fetched.  Each figure is looked for under every name it has had
across schema versions, as the table of figures (atopgpud_tw/figures.py) lists
them.  A value nvidia-smi cannot give ("N/A", ...), cannot be read, or beyond what
a GPU can report has no series.  The report has no energy counter and no XID counts.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from atopgpud_tw.figures import FIGURES, Smi
from atopgpud_tw.health import CardHealth
from atopgpud_tw.readers.smi.values import gpu_busid, not_available

_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z%/]*)\s*$")
_PSTATE = re.compile(r"^\s*P(\d+)\s*$")
_WORDS = {"yes_no": {"yes": 1.0, "no": 0.0}, "active": {"active": 1.0, "not active": 0.0}}
#: the rows of the table of figures with nvidia-smi paths, the ECC counters volatile then aggregate
READ = tuple(sorted((figure for figure in FIGURES if figure.smi is not None),
                    key=lambda figure: dict(figure.labels).get("counter") == "aggregate"))


def read_cards_health(root: ET.Element) -> list[CardHealth]:
    """Every card's health figures in a parsed report, keyed by bus id."""
    return [card_health(gpu, busid) for gpu in root.findall("gpu") if (busid := gpu_busid(gpu))]


def card_health(gpu: ET.Element, busid: str) -> CardHealth:
    """One ``<gpu>`` element's figures."""
    uuid = _text(gpu, "uuid") or ""
    reading = CardHealth(busid, busid, _text(gpu, "product_name") or "", uuid="" if not_available(uuid) else uuid)
    for figure in READ:
        value = figure_value(gpu, figure.smi)  # type: ignore[arg-type]
        if value is not None:
            reading.values[figure.series] = value
    return reading


def figure_value(gpu: ET.Element, where: Smi) -> float | None:
    """One figure of a ``<gpu>`` element as its row says, or None where the report cannot give it."""
    for path in where.paths:
        if gpu.find(path) is not None:
            text = _text(gpu, path)
            break
    else:
        return _sum_of_parts(gpu, where.parts)
    if where.parse in _WORDS:
        return _WORDS[where.parse].get((text or "").lower())
    if where.parse == "pstate":
        state = _PSTATE.match(text or "")
        return float(state.group(1)) if state else None
    value = _number(text)
    if value is None or value * where.scale > (where.most if where.most is not None else float("inf")):
        return None
    return value * where.scale


def _sum_of_parts(gpu: ET.Element, parts: tuple[tuple[str, ...], ...]) -> float | None:
    """The sum of the parts present (each its first alternative present, "a+b" the sum of both), or None."""
    found = []
    for names in parts:
        for name in names:
            values = [_number(_text(gpu, each)) for each in name.split("+")]
            if None not in values:
                found.append(sum(filter(None, values)))
                break
    return sum(found) if found else None


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    return None if found is None or found.text is None or len(found) else found.text.strip()


def _number(text: str | None) -> float | None:
    """A number with an optional unit ("45 C", "250.50 W", "30 %", "509 KB/s", "16x"); None for N/A."""
    match = _NUMBER.match(text or "")
    value = float(match.group(1)) if match else -1.0
    return value if value >= 0 else None
