"""Values out of an ``nvidia-smi -q -x`` report's elements: each read, or why not.

A value nvidia-smi cannot give ("N/A", ...) is permanent: `UNSUPPORTED` for a
percentage and a process's memory, 0 for a device's memory.  One unreadable or
implausible is ``None`` for this poll and a trouble in its `Problems`.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from typing import Callable, NamedTuple

from atopgpud_tw.figures import INVENTORY
from atopgpud_tw.problems import Problems
from atopgpud_tw.snapshot import NO_INFO, DeviceInfo, clamp_percent

#: memory figures beyond this (4 PiB) are a garbled report, not a device
MAX_MEMORY_MIB = 2**32
#: pids and instance ids beyond this are no Linux pid (PID_MAX_LIMIT is 2**22)
MAX_PID = 2**31 - 1
#: characters of a text kept (a product name, a UUID, a version, a MIG profile; figures are far shorter)
MAX_TEXT = 256
#: what nvidia-smi prints for a value it cannot give, brackets and case aside
_NOT_AVAILABLE = {"n/a", "not supported", "insufficient permissions", "requested functionality has been deprecated"}
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%?")
_MIB = re.compile(r"(\d+(?:\.\d+)?)\s*MiB", re.IGNORECASE)
MEMORY = ("fb_memory_usage/total", "fb_memory_usage/used")
Parse = Callable[[str], "int | None"]
#: the (key, bus id) of the device a problem is logged under
Owner = tuple[str, str]


class SmiReportError(ValueError):
    """The output is not an nvidia-smi report at all; the message says why in one line."""


class _Implausible(ValueError):
    """A value that reads as a number, but one no device can report."""


class Card(NamedTuple):
    key: str
    busid: str
    name: str
    info: DeviceInfo = NO_INFO


def gpu_busid(gpu: ET.Element) -> str:
    """A ``<gpu>`` element's bus id: its ``id`` attribute, else ``pci/pci_bus_id`` ("" if neither)."""
    return (gpu.get("id") or "").strip() or text_at(gpu, "pci/pci_bus_id") or ""


def card_of(gpu: ET.Element, position: int, problems: Problems) -> Card | None:
    busid = gpu_busid(gpu)
    uuid = text_at(gpu, "uuid")
    key = uuid if uuid and not not_available(uuid) else busid
    if not key:
        problems.add(f"gpu#{position} no-id", f"GPU number {position} in the report has no bus id and no UUID")
        return None
    return Card(key, busid, text_at(gpu, "product_name") or "")


def card_info(root: ET.Element, gpu: ET.Element) -> DeviceInfo:
    """What a ``<gpu>`` is, from its report: "" for what the report lacks or gives as N/A."""
    # the MIG profile is an instance's, from mig.py
    texts = {row.attribute: text_at(root if row.smi_root else gpu, row.smi) or ""
             for row in INVENTORY if row.attribute != "mig_profile"}
    return DeviceInfo(**{name: "" if not_available(text) else text for name, text in texts.items()})


def reading(
    element: ET.Element, path: str, parse: Parse, unavailable: int | None, owner: Owner, problems: Problems
) -> int | None:
    """`value_of` the text at `path`."""
    return value_of(text_at(element, path), path, parse, unavailable, owner, problems)


def value_of(
    text: str | None, path: str, parse: Parse, unavailable: int | None, owner: Owner, problems: Problems
) -> int | None:
    """The value of the text found at `path`: `unavailable` if absent (None) or N/A; None and a
    problem (under `owner`, the device's key and bus id) if unreadable."""
    if text is None or not_available(text):
        return unavailable
    try:
        value = parse(text)
    except _Implausible:
        problems.add(f"{owner[0]} {path}", f"GPU {owner[1]}: implausible {path} {text[:40]!r}")
        return None
    if value is None:
        problems.add(f"{owner[0]} {path}", f"GPU {owner[1]}: unreadable {path} {text[:40]!r}")
    return value


#: free and reserved memory, beside `MEMORY` (reserved since the 510 drivers' schema)
MEMORY_FREE_RESERVED = ("fb_memory_usage/free", "fb_memory_usage/reserved")


def free_reserved(element: ET.Element, owner: Owner, problems: Problems) -> tuple[int | None, int | None]:
    """The free and reserved memory in KiB under `element` (None where absent, N/A or unreadable)."""
    free, reserved = (reading(element, path, kib, None, owner, problems) for path in MEMORY_FREE_RESERVED)
    return free, reserved


def within(used: int | None, total: int | None, owner: Owner, problems: Problems) -> int | None:
    """`used`, unless it is more than a known `total` (0: not known): then None and a problem."""
    if used is None or not total or used <= total:
        return used
    path = MEMORY[1]
    problems.add(
        f"{owner[0]} {path}",
        f"GPU {owner[1]}: implausible {path} {used // 1024} MiB, more than the {total // 1024} MiB total",
    )
    return None


def kib(text: str) -> int | None:
    found = _MIB.fullmatch(text)
    if not found:
        return None
    mib = float(found[1])  # inf for a thousand digits, never an error
    if mib > MAX_MEMORY_MIB:
        raise _Implausible(text)
    return round(mib * 1024)


def percent(text: str) -> int | None:
    found = _PERCENT.fullmatch(text)
    if not found:
        return None
    value = float(found[1])
    if not math.isfinite(value):  # a thousand digits; a mere 250 % is clamped
        raise _Implausible(text)
    return clamp_percent(value)


def text_at(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    return None if found is None else "".join(found.itertext()).strip()


def not_available(text: str) -> bool:
    return text.strip("[] ").lower() in _NOT_AVAILABLE


def integer(text: str | None) -> int | None:
    # the length first: int() refuses thousands of digits with an error
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 10:
        return None
    value = int(text)
    return value if value <= MAX_PID else None


def first_line(text: str) -> str:
    return next((line.strip()[:200] for line in text.splitlines() if line.strip()), "")
