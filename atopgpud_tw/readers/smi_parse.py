"""Reading ``nvidia-smi -q -x`` and ``nvidia-smi -L``: pure functions over their output.

The ``-q -x`` schema grew from v9 to v13, elements moving and changing names, so
values are found by the elements present, never by the DTD the DOCTYPE line names
(which may be missing, as may the final newline; line ends may be CRLF).
docs/nvidia-smi.md lists what is read.  A value nvidia-smi cannot give ("N/A",
"Not Supported", ...) is permanent: `UNSUPPORTED` for a percentage and for a
process's memory, 0 for a device's memory.
A value present but unreadable, or implausible (memory beyond `MAX_MEMORY_MIB`,
more used than the device has, a pid beyond `MAX_PID`), is ``None`` for this
poll plus a problem ``{cause: description}`` for `ProblemLog`.  Only output that is not an
nvidia-smi report at all raises `SmiReportError`.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from typing import Callable, Iterable, Mapping, NamedTuple

from atopgpud_tw.problems import Problems
from atopgpud_tw.readers.identity import CardKeys, mig_busid, mig_key, mig_profile
from atopgpud_tw.snapshot import (
    KINDS,
    UNSUPPORTED,
    DeviceSample,
    ProcessSample,
    clamp_percent,
    fold_instances,
    merge_processes,
    mig_mode,
)

#: memory figures beyond this (4 PiB) are a garbled report, not a device
MAX_MEMORY_MIB = 2**32
#: pids and instance ids beyond this are no Linux pid (PID_MAX_LIMIT is 2**22)
MAX_PID = 2**31 - 1
#: profile names per (card bus id, GPU instance id, compute instance id)
Profiles = Mapping[tuple[str, int, int], str]
#: what nvidia-smi prints for a value it cannot give, brackets and case aside
_NOT_AVAILABLE = {
    "n/a",
    "not supported",
    "insufficient permissions",
    "requested functionality has been deprecated",
}
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%?")
_MIB = re.compile(r"(\d+(?:\.\d+)?)\s*MiB", re.IGNORECASE)
_BUSY = ("utilization/gpu_util", "utilization/memory_util")
_MEMORY = ("fb_memory_usage/total", "fb_memory_usage/used")
_REPORT_START = re.compile(rb"<\?xml|<nvidia_smi_log[\s>/]")


class SmiReportError(ValueError):
    """The output is not an nvidia-smi report at all; the message says why in one line."""


class _Implausible(ValueError):
    """A value that reads as a number, but one no device can report."""


class MigSlot(NamedTuple):
    """One MIG instance as ``-q -x`` lists it; what ``-L`` names are matched against."""

    card_key: str
    card_busid: str
    #: ``<mig_device><index>``, the "Device N" of ``nvidia-smi -L``
    index: int  # type: ignore[assignment]  # a field, not tuple.index
    gpu_instance: int
    compute_instance: int
    multiprocessors: int | None
    memory_total_kib: int | None


def read_report(data: bytes) -> tuple[ET.Element, str]:
    """The ``<nvidia_smi_log>`` element, and any text printed before the document.

    nvidia-smi writes some warnings ("WARNING: infoROM is corrupted at gpu ...")
    to stdout ahead of the XML; they are returned rather than failing every poll.
    """
    if not data.strip():
        raise SmiReportError("the output is empty")
    start = _REPORT_START.search(data)
    preamble = data[: start.start()] if start else b""
    try:
        root = ET.fromstring(data[len(preamble) :])
    except ET.ParseError as error:
        raise SmiReportError(f"the output is not XML ({error})") from None
    if root.tag != "nvidia_smi_log":
        raise SmiReportError(f"the document is <{root.tag}>, not <nvidia_smi_log>")
    return root, _first_line(preamble.decode("utf-8", errors="replace"))


def parse_report(
    data: bytes, mig: str = "instances", profiles: Profiles | None = None, keys: CardKeys | None = None
) -> tuple[tuple[DeviceSample, ...], Problems]:
    """The devices of one ``-q -x`` report and the problems met reading their values."""
    root, preamble = read_report(data)
    devices, problems = read_devices(root, mig, profiles, keys)
    if preamble:
        problems.add("preamble", f"nvidia-smi printed before its report: {preamble}")
    return devices, problems


def read_devices(
    root: ET.Element, mig: str = "instances", profiles: Profiles | None = None, keys: CardKeys | None = None
) -> tuple[tuple[DeviceSample, ...], Problems]:
    """The devices of a parsed report: cards, or the instances of cards in MIG mode.

    ``mig="instances"`` reports each MIG instance as a device; ``mig="card"``
    reports a MIG card as one device holding all its instances' memory and processes.
    `keys` keeps cards' keys across reports (a reader's own); without it they are
    unique within this report only.
    """
    mig_mode(mig)
    problems = Problems()
    devices: list[DeviceSample] = []
    found = [(gpu, _card(gpu, position, problems)) for position, gpu in enumerate(root.findall("gpu"))]
    cards = [(gpu, card) for gpu, card in found if card is not None]
    # two cards with one UUID (anonymised, cloned VMs) are both kept: keys unique per report
    unique = (keys or CardKeys()).assign([(card.key, card.busid) for _, card in cards])
    for (gpu, card), key in zip(cards, unique):
        card = card._replace(key=key)
        entries = _process_entries(gpu, card, problems)
        if _value(gpu, "mig_mode/current_mig") != "Enabled":
            devices.append(_whole_card(gpu, card, entries, problems))
            continue
        slots = _slots(gpu, card, problems)
        if not slots:
            problems.add(
                f"{card.busid} mig-empty", f"GPU {card.busid} is in MIG mode with no instances: nothing can run on it"
            )
            devices.append(_whole_card(gpu, card, entries, problems, mig=True))
            continue
        instances = _instances(card, slots, entries, profiles or {}, problems)
        if mig == "card":
            instances = [fold_instances(card.key, card.busid, card.name, instances)]
        devices.extend(instances)
    return tuple(devices), problems


def mig_slots(root: ET.Element) -> tuple[MigSlot, ...]:
    """Every MIG instance of every card in MIG mode, in report order."""
    slots: list[MigSlot] = []
    for position, gpu in enumerate(root.findall("gpu")):
        card = _card(gpu, position, Problems())
        if card is not None and _value(gpu, "mig_mode/current_mig") == "Enabled":
            slots.extend(slot for slot, _ in _slots(gpu, card, Problems()))
    return tuple(slots)


def fallback_profile(slot: MigSlot) -> str:
    """A name for an instance whose profile ``nvidia-smi -L`` did not give.

    ``-q -x`` states neither an instance's slice count nor the card's SM count,
    and SMs per slice differ between products, so no ``3g`` is guessed: the name
    says what the report does state, the instance's SMs and its memory rounded up
    to whole GiB (as profile names round it): ``42sm.20gb`` for a 3g.20gb of an A100.
    """
    parts = []
    if slot.multiprocessors is not None:
        parts.append(f"{slot.multiprocessors}sm")
    if slot.memory_total_kib:
        parts.append(f"{math.ceil(slot.memory_total_kib / 2**20)}gb")
    return ".".join(parts) or "MIG"


_GPU_LINE = re.compile(r"GPU\s+\d+:.*\(UUID:\s*([^)\s]+)\s*\)")
_MIG_LINE = re.compile(r"\s+MIG\s+(\S+)\s+Device\s+(\d+):")


def parse_mig_names(text: str) -> dict[tuple[str, int], str]:
    """Profiles from ``nvidia-smi -L``, by (card UUID, MIG device index).

    ``-L`` has no instance ids; its "Device N" is the ``<mig_device><index>`` of
    the same card in ``-q -x``.  Cards are matched by UUID rather than position so
    that a card dropping off the bus between the two runs cannot shift names.
    """
    names: dict[tuple[str, int], str] = {}
    card = None
    for line in text.splitlines():
        if found := _GPU_LINE.match(line):
            card = found[1]
        elif (found := _MIG_LINE.match(line)) and card is not None:
            names[(card, int(found[2]))] = mig_profile(found[1])
    return names


def name_slots(
    slots: Iterable[MigSlot], names: Mapping[tuple[str, int], str]
) -> dict[tuple[str, int, int], str]:
    """The ``profiles`` argument of `read_devices` from `mig_slots` and `parse_mig_names`.

    Raises `SmiReportError` when ``-L`` lists other devices for a card than the
    report does: the instances were reconfigured between the two runs.
    """
    by_card: dict[str, list[MigSlot]] = {}
    for slot in slots:
        by_card.setdefault(slot.card_key, []).append(slot)
    profiles = {}
    for card_key, card_slots in by_card.items():
        listed = sorted(index for key, index in names if key == card_key)
        reported = sorted(slot.index for slot in card_slots)
        if listed != reported:
            raise SmiReportError(
                f"nvidia-smi -L lists MIG devices {listed} of GPU {card_slots[0].card_busid}, "
                f"the report {reported}"
            )
        for slot in card_slots:
            key = (slot.card_busid, slot.gpu_instance, slot.compute_instance)
            profiles[key] = names[(card_key, slot.index)]
    return profiles


# -- one card --


class _Card(NamedTuple):
    key: str
    busid: str
    name: str


def gpu_busid(gpu: ET.Element) -> str:
    """A ``<gpu>`` element's bus id: its ``id`` attribute, else ``pci/pci_bus_id`` ("" if neither)."""
    return (gpu.get("id") or "").strip() or _value(gpu, "pci/pci_bus_id") or ""


def _card(gpu: ET.Element, position: int, problems: Problems) -> _Card | None:
    busid = gpu_busid(gpu)
    uuid = _value(gpu, "uuid")
    key = uuid if uuid and not _not_available(uuid) else busid
    if not key:
        problems.add(f"gpu#{position} no-id", f"GPU number {position} in the report has no bus id and no UUID")
        return None
    return _Card(key, busid, _value(gpu, "product_name") or "")


def _whole_card(
    gpu: ET.Element, card: _Card, entries: list | None, problems: Problems, mig: bool = False
) -> DeviceSample:
    owner = (card.key, card.busid)
    busy: list[int | None] = [UNSUPPORTED, UNSUPPORTED]
    if not mig:  # a card in MIG mode has no utilization of its own (docs/mig.md)
        busy = [_reading(gpu, path, _percent, UNSUPPORTED, owner, problems) for path in _BUSY]
    total, used = (_reading(gpu, path, _kib, 0, owner, problems) for path in _MEMORY)
    used = _within(used, total, owner, problems)
    return DeviceSample(
        card.key,
        card.busid,
        card.name,
        gpu_busy=busy[0],
        mem_busy=busy[1],
        memory_total_kib=total,
        memory_used_kib=used,
        processes=None if entries is None else merge_processes((s for _, _, s in entries), memory="max"),
    )


def _slots(gpu: ET.Element, card: _Card, problems: Problems) -> list[tuple[MigSlot, ET.Element]]:
    """The card's MIG instances by index, each with its ``<mig_device>`` element."""
    slots = []
    for device in gpu.findall("mig_devices/mig_device"):
        ids = [_integer(_value(device, tag)) for tag in ("index", "gpu_instance_id", "compute_instance_id")]
        index, gi, ci = ids
        if index is None or gi is None or ci is None:
            problems.add(f"{card.key} mig-ids", f"GPU {card.busid}: a MIG device without ids is left out")
            continue
        owner = (mig_key(card.key, gi, ci), card.busid)
        total = _reading(device, _MEMORY[0], _kib, 0, owner, problems)
        sms = _integer(_value(device, "device_attributes/shared/multiprocessor_count"))
        slots.append((MigSlot(card.key, card.busid, index, gi, ci, sms, total), device))
    return sorted(slots, key=lambda pair: pair[0].index)


def _instances(
    card: _Card,
    slots: list[tuple[MigSlot, ET.Element]],
    entries: list | None,
    profiles: Profiles,
    problems: Problems,
) -> list[DeviceSample]:
    """Each instance with its own memory and the processes whose instance ids are its own."""
    devices = []
    for slot, element in slots:
        gi, ci = slot.gpu_instance, slot.compute_instance
        key = mig_key(card.key, gi, ci)
        mine = None if entries is None else (s for g, c, s in entries if (g, c) == (gi, ci))
        processes = None if mine is None else merge_processes(mine, memory="max")
        used = _reading(element, _MEMORY[1], _kib, 0, (key, card.busid), problems)
        used = _within(used, slot.memory_total_kib, (key, card.busid), problems)
        name = profiles.get((card.busid, gi, ci)) or fallback_profile(slot)
        busid = mig_busid(card.busid, gi, ci)
        devices.append(
            DeviceSample(
                key,
                busid,
                name,
                memory_total_kib=slot.memory_total_kib,
                memory_used_kib=used,
                processes=processes,
            )
        )
    ids = {(slot.gpu_instance, slot.compute_instance) for slot, _ in slots}
    if lost := sorted({s.pid for g, c, s in entries or () if (g, c) not in ids}):
        problems.add(
            f"{card.key} mig-unmatched",
            f"GPU {card.busid}: processes on no listed MIG instance are left out (pids {lost[:5]})",
        )
    return devices


# -- processes --


def _process_entries(gpu: ET.Element, card: _Card, problems: Problems) -> list | None:
    """(gpu instance, compute instance, sample) per ``process_info``; None if unreadable.

    A list with one unreadable pid is dropped whole for this poll: a partial
    list would make the missing processes seem to end.
    """
    entries = []
    for info in gpu.findall("processes/process_info"):
        pid = _integer(_value(info, "pid"))
        if pid is None:
            problems.add(f"{card.key} pid", f"GPU {card.busid}: unreadable pid {_value(info, 'pid')!r}")
            return None
        kind = _value(info, "type")
        # N/A, as for every process under WDDM, is not known: -1, not a failure
        memory = _reading(info, "used_memory", _kib, UNSUPPORTED, (card.key, card.busid), problems)
        sample = ProcessSample(pid, kind if kind in KINDS else "C", memory, UNSUPPORTED, UNSUPPORTED)
        gi = _integer(_value(info, "gpu_instance_id"))
        ci = _integer(_value(info, "compute_instance_id"))
        entries.append((gi, ci, sample))
    return entries




# -- values --


def _reading(
    element: ET.Element,
    path: str,
    parse: Callable[[str], int | None],
    unavailable: int,
    owner: tuple[str, str],
    problems: Problems,
) -> int | None:
    """The value at `path`: `unavailable` if absent or N/A; None and a problem if unreadable.

    `owner` is the (key, bus id) of the device the problem is logged under.
    """
    text = _value(element, path)
    if text is None or _not_available(text):
        return unavailable
    try:
        value = parse(text)
    except _Implausible:
        problems.add(f"{owner[0]} {path}", f"GPU {owner[1]}: implausible {path} {text[:40]!r}")
        return None
    if value is None:
        problems.add(f"{owner[0]} {path}", f"GPU {owner[1]}: unreadable {path} {text[:40]!r}")
    return value


def _within(used: int | None, total: int | None, owner: tuple[str, str], problems: Problems) -> int | None:
    """`used`, unless it is more than a known `total` (0: not known): then None and a problem."""
    if used is None or not total or used <= total:
        return used
    path = _MEMORY[1]
    problems.add(
        f"{owner[0]} {path}",
        f"GPU {owner[1]}: implausible {path} {used // 1024} MiB, more than the {total // 1024} MiB total",
    )
    return None


def _kib(text: str) -> int | None:
    found = _MIB.fullmatch(text)
    if not found:
        return None
    mib = float(found[1])  # inf for a thousand digits, never an error
    if mib > MAX_MEMORY_MIB:
        raise _Implausible(text)
    return round(mib * 1024)


def _percent(text: str) -> int | None:
    found = _PERCENT.fullmatch(text)
    if not found:
        return None
    value = float(found[1])
    if not math.isfinite(value):  # a thousand digits; a mere 250 % is clamped
        raise _Implausible(text)
    return clamp_percent(value)


def _value(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    return None if found is None else "".join(found.itertext()).strip()


def _not_available(text: str) -> bool:
    return text.strip("[] ").lower() in _NOT_AVAILABLE


def _integer(text: str | None) -> int | None:
    # the length first: int() refuses thousands of digits with an error
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 10:
        return None
    value = int(text)
    return value if value <= MAX_PID else None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
