"""Reading ``nvidia-smi -q -x``: the devices of one report, pure functions over its output.

The schema grew from v9 to v13, elements moving and changing names, so values are
found by the elements present, never by the DTD the DOCTYPE line names (which may
be missing).  docs/nvidia-smi.md lists what is read.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Iterable

from atopgpud_tw.problems import Problems
from atopgpud_tw.readers.identity import CardKeys
from atopgpud_tw.readers.smi.mig import Profiles, instances_of, slots_of
from atopgpud_tw.readers.smi.stream import CUT, OVER, PROCESS_FIELDS, ProcessList, read_report
from atopgpud_tw.readers.smi.values import (
    MAX_TEXT,
    MEMORY,
    Card,
    card_info,
    card_of,
    free_reserved,
    integer,
    kib,
    percent,
    reading,
    text_at,
    value_of,
    within,
)
from atopgpud_tw.readers.starts import StartTimes
from atopgpud_tw.snapshot import (
    KINDS,
    UNSUPPORTED,
    DeviceSample,
    ProcessSample,
    fold_instances,
    merge_processes,
    mig_mode,
)

_BUSY = ("utilization/gpu_util", "utilization/memory_util")


def parse_report(
    data: bytes, mig: str = "instances", profiles: Profiles | None = None, keys: CardKeys | None = None
) -> tuple[tuple[DeviceSample, ...], Problems]:
    """The devices of one ``-q -x`` report and the problems met reading their values."""
    root, preamble = read_report(data)
    devices, problems = read_devices(root, mig, profiles, keys)
    note_preamble(preamble, problems)
    return devices, problems


def note_cut_texts(root: ET.Element, problems: Problems) -> None:
    """The texts the parser cut to `MAX_TEXT` (stream.py), one trouble each, by GPU and element."""
    for element in root:
        gpu = element.tag == "gpu"
        owner = (element.get("id") or "").strip() or "?" if gpu else "report"
        for tag, size in ((each.tag, each.get(CUT)) for each in (element.iter() if gpu else [element])):
            if size is not None:
                problems.add(f"{owner} {tag} long",
                             f"{'GPU ' + owner if owner != 'report' else 'the report'}: <{tag}> is longer than "
                             f"{MAX_TEXT} characters ({size}): its start and end are kept, about an ellipsis")


def note_preamble(preamble: str, problems: Problems) -> None:
    """What nvidia-smi printed before its report (`read_report`), as a trouble of the poll."""
    if preamble:
        problems.add("preamble", f"nvidia-smi printed before its report: {preamble}")


def read_devices(
    root: ET.Element,
    mig: str = "instances",
    profiles: Profiles | None = None,
    keys: CardKeys | None = None,
    uuids: Profiles | None = None,
    starts: StartTimes | None = None,
) -> tuple[tuple[DeviceSample, ...], Problems]:
    """The devices of a parsed report: cards, and each MIG instance (``mig="instances"``) or a MIG card
    holding its instances' (``"card"``).  `keys` keeps cards' keys across reports; `profiles` and `uuids`
    are ``nvidia-smi -L``'s (`mig.name_slots`); `starts` tells each listed pid's start time."""
    mig_mode(mig)
    problems = Problems()
    note_cut_texts(root, problems)
    devices: list[DeviceSample] = []
    found = [(gpu, card_of(gpu, position, problems)) for position, gpu in enumerate(root.findall("gpu"))]
    cards = [(gpu, card) for gpu, card in found if card is not None]
    # two cards with one UUID (anonymised, cloned VMs) are both kept: keys unique per report
    unique = (keys or CardKeys()).assign([(card.key, card.busid) for _, card in cards])
    for (gpu, card), key in zip(cards, unique):
        card = card._replace(key=key, info=card_info(root, gpu))
        entries = _process_entries(gpu, card, problems, starts)
        if text_at(gpu, "mig_mode/current_mig") != "Enabled":
            devices.append(_whole_card(gpu, card, entries, problems))
            continue
        slots = slots_of(gpu, card, problems)
        if not slots:
            problems.add(
                f"{card.busid} mig-empty", f"GPU {card.busid} is in MIG mode with no instances: nothing can run on it"
            )
            devices.append(_whole_card(gpu, card, entries, problems, mig=True))
            continue
        instances = instances_of(card, slots, entries, profiles or {}, problems, uuids)
        if mig == "card":
            instances = [fold_instances(card.key, card.busid, card.name, instances, info=card.info)]
        devices.extend(instances)
    return tuple(devices), problems


def _whole_card(
    gpu: ET.Element, card: Card, entries: list | None, problems: Problems, mig: bool = False
) -> DeviceSample:
    owner = (card.key, card.busid)
    # a card in MIG mode has no utilization of its own (docs/mig.md)
    busy = [UNSUPPORTED if mig else reading(gpu, path, percent, UNSUPPORTED, owner, problems) for path in _BUSY]
    total, used = (reading(gpu, path, kib, 0, owner, problems) for path in MEMORY)
    used = within(used, total, owner, problems)
    free, reserved = free_reserved(gpu, owner, problems)
    return DeviceSample(
        card.key,
        card.busid,
        card.name,
        gpu_busy=busy[0],
        mem_busy=busy[1],
        memory_total_kib=total,
        memory_used_kib=used,
        memory_free_kib=free,
        memory_reserved_kib=reserved,
        processes=None if entries is None else merge_processes((s for _, _, s in entries), memory="max"),
        info=card.info,
    )


def _process_entries(gpu: ET.Element, card: Card, problems: Problems, starts: StartTimes | None) -> list | None:
    """(gpu instance, compute instance, sample) per ``process_info``; None if unreadable or longer than
    the parser keeps: a partial list would make the missing processes seem to end."""
    listing = gpu.find("processes")
    over = None if listing is None else listing.get(OVER)
    if over is not None:
        problems.add(f"{card.key} processes", f"GPU {card.busid} lists {over}: none of them is counted")
        return None
    entries = []
    owner = (card.key, card.busid)
    for pid_text, kind, memory_text, gi_text, ci_text in _process_fields(listing):
        pid = integer(pid_text)
        if pid is None:
            problems.add(f"{card.key} pid", f"GPU {card.busid}: unreadable pid {pid_text and pid_text[:40]!r}")
            return None
        # N/A, as for every process under WDDM, is not known: -1, not a failure
        memory = value_of(memory_text, "used_memory", kib, UNSUPPORTED, owner, problems)
        started = None if starts is None else starts(pid)
        sample = ProcessSample(pid, kind if kind in KINDS else "C", memory, UNSUPPORTED, UNSUPPORTED, started)
        entries.append((integer(gi_text), integer(ci_text), sample))
    return entries


def _process_fields(listing: ET.Element | None) -> Iterable[tuple[str | None, ...]]:
    """Each process's `PROCESS_FIELDS` texts: as the parser kept them, or from a whole tree's elements."""
    if listing is None:
        return ()
    if isinstance(listing, ProcessList):
        return listing.entries
    return [tuple(text_at(info, name) for name in PROCESS_FIELDS) for info in listing.findall("process_info")]
