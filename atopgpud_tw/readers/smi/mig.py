"""The MIG instances of an ``nvidia-smi -q -x`` report, named from ``nvidia-smi -L`` (docs/mig.md).

``-q -x`` lists each card's ``<mig_device>`` elements with their ids and memory
but no profile name; ``-L`` lists the names by "Device N" with no ids.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from typing import Iterable, Mapping, NamedTuple

from atopgpud_tw.problems import Problems
from atopgpud_tw.readers.identity import mig_busid, mig_key, mig_profile
from atopgpud_tw.readers.smi.values import (
    MAX_TEXT,
    MEMORY,
    Card,
    SmiReportError,
    card_of,
    free_reserved,
    integer,
    kib,
    reading,
    text_at,
    within,
)
from atopgpud_tw.snapshot import DeviceSample, merge_processes

#: profile names per (card bus id, GPU instance id, compute instance id)
Profiles = Mapping[tuple[str, int, int], str]


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


def mig_slots(root: ET.Element) -> tuple[MigSlot, ...]:
    """Every MIG instance of every card in MIG mode, in report order."""
    slots: list[MigSlot] = []
    for position, gpu in enumerate(root.findall("gpu")):
        card = card_of(gpu, position, Problems())
        if card is not None and text_at(gpu, "mig_mode/current_mig") == "Enabled":
            slots.extend(slot for slot, _ in slots_of(gpu, card, Problems()))
    return tuple(slots)


def fallback_profile(slot: MigSlot) -> str:
    """A name for an instance whose profile ``nvidia-smi -L`` did not give: its SMs and its memory in
    whole GiB, rounded up as profile names round it (``42sm.20gb`` for a 3g.20gb of an A100).  ``-q -x``
    states neither slice counts nor the card's SMs, and SMs per slice differ between products."""
    parts = []
    if slot.multiprocessors is not None:
        parts.append(f"{slot.multiprocessors}sm")
    if slot.memory_total_kib:
        parts.append(f"{math.ceil(slot.memory_total_kib / 2**20)}gb")
    return ".".join(parts) or "MIG"


_GPU_LINE = re.compile(r"GPU\s+\d+:.*\(UUID:\s*([^)\s]+)\s*\)")
_MIG_LINE = re.compile(r"\s+MIG\s+(\S+)\s+Device\s+(\d+):")
_MIG_UUID = re.compile(r"\(UUID:\s*(MIG-[^)\s]+)\s*\)")


def parse_mig_names(text: str) -> dict[tuple[str, int], tuple[str, str]]:
    """Profiles and ``MIG-...`` UUIDs ("" where none is listed) from ``nvidia-smi -L``, by (card UUID,
    "Device N", the ``<mig_device><index>`` in ``-q -x``): by UUID rather than position, so that a card
    dropping off the bus between the two runs cannot shift names."""
    names: dict[tuple[str, int], tuple[str, str]] = {}
    card = None
    for line in text.splitlines():
        if found := _GPU_LINE.match(line):
            card = found[1][:MAX_TEXT]
        elif (found := _MIG_LINE.match(line)) and card is not None:
            uuid = _MIG_UUID.search(line)
            names[(card, int(found[2]))] = (mig_profile(found[1][:MAX_TEXT]), uuid[1][:MAX_TEXT] if uuid else "")
    return names


def name_slots(
    slots: Iterable[MigSlot], names: Mapping[tuple[str, int], tuple[str, str]]
) -> tuple[dict[tuple[str, int, int], str], dict[tuple[str, int, int], str]]:
    """The ``profiles`` and ``uuids`` arguments of `read_devices` from `mig_slots` and `parse_mig_names`;
    `SmiReportError` where ``-L`` lists other devices for a card (reconfigured between the two runs)."""
    by_card: dict[str, list[MigSlot]] = {}
    for slot in slots:
        by_card.setdefault(slot.card_key, []).append(slot)
    profiles, uuids = {}, {}
    for card_key, card_slots in by_card.items():
        listed = sorted(index for key, index in names if key == card_key)
        reported = sorted(slot.index for slot in card_slots)
        if listed != reported:
            raise SmiReportError(
                f"nvidia-smi -L lists MIG devices {listed} of GPU {card_slots[0].card_busid}, the report {reported}"
            )
        for slot in card_slots:
            key = (slot.card_busid, slot.gpu_instance, slot.compute_instance)
            profiles[key], uuid = names[(card_key, slot.index)]
            if uuid:
                uuids[key] = uuid
    return profiles, uuids


def slots_of(gpu: ET.Element, card: Card, problems: Problems) -> list[tuple[MigSlot, ET.Element]]:
    """The card's MIG instances by index, each with its ``<mig_device>`` element."""
    slots = []
    for device in gpu.findall("mig_devices/mig_device"):
        index, gi, ci = (integer(text_at(device, tag)) for tag in ("index", "gpu_instance_id", "compute_instance_id"))
        if index is None or gi is None or ci is None:
            problems.add(f"{card.key} mig-ids", f"GPU {card.busid}: a MIG device without ids is left out")
            continue
        owner = (mig_key(card.key, gi, ci), card.busid)
        total = reading(device, MEMORY[0], kib, 0, owner, problems)
        sms = integer(text_at(device, "device_attributes/shared/multiprocessor_count"))
        slots.append((MigSlot(card.key, card.busid, index, gi, ci, sms, total), device))
    return sorted(slots, key=lambda pair: pair[0].index)


def instances_of(
    card: Card,
    slots: list[tuple[MigSlot, ET.Element]],
    entries: list | None,
    profiles: Profiles,
    problems: Problems,
    uuids: Profiles | None = None,
) -> list[DeviceSample]:
    """Each instance with its own memory and the processes whose instance ids are its own."""
    devices = []
    for slot, element in slots:
        gi, ci = slot.gpu_instance, slot.compute_instance
        key = mig_key(card.key, gi, ci)
        mine = None if entries is None else (s for g, c, s in entries if (g, c) == (gi, ci))
        processes = None if mine is None else merge_processes(mine, memory="max")
        used = reading(element, MEMORY[1], kib, 0, (key, card.busid), problems)
        used = within(used, slot.memory_total_kib, (key, card.busid), problems)
        free, reserved = free_reserved(element, (key, card.busid), problems)
        name = profiles.get((card.busid, gi, ci)) or fallback_profile(slot)
        devices.append(
            DeviceSample(
                key,
                mig_busid(card.busid, gi, ci),
                name,
                memory_total_kib=slot.memory_total_kib,
                memory_used_kib=used,
                memory_free_kib=free,
                memory_reserved_kib=reserved,
                processes=processes,
                # -q -x has no MIG device UUID: nvidia-smi -L's, with the card's versions
                info=replace(
                    card.info, uuid=(uuids or {}).get((card.busid, gi, ci), ""), mig_profile=name,
                    parent_uuid=card.info.uuid, gpu_instance=str(gi), compute_instance=str(ci),
                ),
            )
        )
    ids = {(slot.gpu_instance, slot.compute_instance) for slot, _ in slots}
    if lost := sorted({s.pid for g, c, s in entries or () if (g, c) not in ids}):
        problems.add(
            f"{card.key} mig-unmatched",
            f"GPU {card.busid}: processes on no listed MIG instance are left out (pids {lost[:5]})",
        )
    return devices
