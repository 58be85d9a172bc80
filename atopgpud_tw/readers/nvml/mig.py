"""MIG: a card in MIG mode read as its instances, or as their sum (docs/mig.md).

Each instance is a device with its own memory and processes and no utilization (NVML
has none under MIG).  The mode and the slots' handles are asked at every poll, so
instances created or destroyed meanwhile are seen.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.logger import Logger

from atopgpud_tw.nvml_codes import DEVICE_MIG_ENABLE
from atopgpud_tw.problems import Problems, printable
from atopgpud_tw.readers.identity import mig_busid, mig_key, mig_profile
from atopgpud_tw.readers.nvml.calls import (
    READING,
    Attempt,
    DeviceLost,
    Failed,
    NotFound,
    Outcome,
    Unsupported,
    answer,
    as_text,
    given,
    nothing_there,
)
from atopgpud_tw.readers.nvml.device import (
    DevicePoll,
    MemoryKib,
    MigState,
    NvmlDevice,
    placeholder,
    probe_support,
    read_device,
    read_memory,
)
from atopgpud_tw.readers.nvml.direct import MIG_HANDLE, MIG_MODE, UUID, handle_value, mig_handle
from atopgpud_tw.snapshot import UNSUPPORTED, DeviceSample, ProcessSample, fold_instances

log = Logger(namespace="atopgpud_tw.readers.nvml_mig")


def read_card(card: NvmlDevice, mig: str, problems: Problems, poll: DevicePoll) -> list[DeviceSample]:
    """A card's devices in this poll: the card, or its MIG instances (or their sum), each on its own."""
    if not _mig_enabled(card, mig, problems):
        return [read_device(card, problems, poll)]
    instances, complete = _enumerate(card, problems)
    if not instances and complete:
        problems.add(
            f"{card.key} mig-empty", f"GPU {card.busid} is in MIG mode with no instances: nothing can run on it"
        )
        return [_unbusy(card, read_memory(card, Attempt(card, problems)), ())]
    # one DevicePoll for the instances: an instance's read learns nothing into it (no rates under MIG)
    each = DevicePoll(starts=poll.starts)
    samples = [_read_instance(instance, problems, each) for instance in instances]
    if not complete:
        # an instance that could not be looked at now is not gone: it counts nothing this poll
        seen = {instance.key for instance in instances}
        samples += [_unbusy(i) for key, i in card.mig_state.instances.items() if key not in seen]
        if not samples:
            return [_unbusy(card)] if mig == "card" else []
    if mig == "card":
        # --mig card: the instances summed
        return [fold_instances(card.key, card.busid, card.name, samples, card.task_support, card.info)]
    return samples


def layout_card(card: NvmlDevice, mig: str) -> list[DeviceSample]:
    """A card's devices as a poll would show them, by identity only (no readings)."""
    problems = Problems()
    instances = _enumerate(card, problems)[0] if _mig_enabled(card, mig, problems) else []
    return [placeholder(device) for device in (instances if mig == "instances" and instances else [card])]


def _mig_enabled(card: NvmlDevice, mig: str, problems: Problems) -> bool:
    """Whether the card is in MIG mode now; NOT_SUPPORTED means it cannot be (and is not asked again)."""
    state = card.mig_state
    # NOT_FOUND, or a failure (a problem): as it was
    enabled = Attempt(card, problems)(_mode_enabled, card, idle=state.enabled)
    if enabled is None or enabled == state.enabled:
        return state.enabled
    card.mig_state = MigState(enabled=enabled)
    # what a card supports depends on its mode
    card.forget_support()
    card.answered.add(MIG_MODE)
    shown = "each MIG instance as a device" if mig == "instances" else "the card as one device"
    log.info(
        "nvml: GPU {busid} is {state}",
        busid=printable(card.busid),
        state=f"in MIG mode: showing {shown}" if enabled else "out of MIG mode",
    )
    return enabled


def _mode_enabled(card: NvmlDevice) -> bool:
    """Whether the card's current MIG mode is on; one that cannot be in MIG mode is not
    (no problem, given up or not)."""
    mode = answer(card.call, MIG_MODE)
    return not isinstance(mode, Unsupported) and given(mode) == DEVICE_MIG_ENABLE


def _enumerate(card: NvmlDevice, problems: Problems) -> tuple[list[NvmlDevice], bool]:
    """The card's MIG instances now, in slot order, and whether the list is complete: slots are
    sparse (NOT_FOUND or INVALID_ARGUMENT: nothing there); any other failure leaves the list
    incomplete, so that no instance is taken for gone on a passing error."""
    state = card.mig_state
    if state.slots is None:
        slots = Attempt(card, problems)(card.call, "nvmlDeviceGetMaxMigDeviceCount", unsupported=0)
        if slots is None:
            return [], False
        state.slots = int(slots)
    found: dict[str, NvmlDevice] = {}
    complete = True
    identified = state.identified
    call = card.call
    for slot in range(state.slots):
        value = answer(call, MIG_HANDLE, slot)  # the handle's pointer value (`direct.DirectCalls`)
        if isinstance(value, (NotFound, Unsupported)):
            identified.pop(slot, None)
            continue
        # (an instance's handle lost while it is looked at is no loss of the card)
        instance = value if isinstance(value, Failed) else answer(_instance, card, slot, value,
                                                                   catch=(*READING, DeviceLost))
        if not isinstance(instance, Outcome):
            found.setdefault(instance.key, instance)
            continue
        identified.pop(slot, None)
        if isinstance(instance, Unsupported):
            # a driver that cannot say which instance this is: said, not guessed
            Attempt(card, problems).note(
                f"MIG device {slot} left out: {instance} is not supported", key="mig identity"
            )
        elif not isinstance(instance, NotFound) and not nothing_there(instance):
            Attempt(card, problems).note(instance.cause, part=(f"mig slot {slot}", f"MIG device {slot}"))
        # only nothing there leaves the list complete (NOT_FOUND: destroyed while looked at, or a passing fault)
        complete = complete and nothing_there(instance)
    if complete:
        unseen = [i for key, i in state.instances.items() if key not in found]
        if unseen:
            # a handle that a slot gave another instance now is no sign of life (a driver may
            # give a destroyed instance's pointer to the next one in its slot)
            taken = {handle_value(instance.handle) for instance in found.values()}
            if any(handle_value(i.handle) not in taken and _still_there(i) for i in unseen):
                complete = False  # a slot's answer was a passing fault: the instance's own handle works
    _note_changes(card, found, complete)
    return list(found.values()), complete


def _still_there(instance: NvmlDevice) -> bool:
    """Whether a known instance that no slot showed still answers on its own handle (a
    destroyed instance's handle answers INVALID_ARGUMENT, or NOT_FOUND)."""
    found = answer(instance.call, "nvmlDeviceGetGpuInstanceId")
    return not isinstance(found, Outcome) or (isinstance(found, Failed) and not nothing_there(found))


def _instance(card: NvmlDevice, slot: int, value: int | None) -> NvmlDevice:
    """The instance behind a slot's handle: the one it was found to be, or identified anew."""
    return _known(card.mig_state.identified, slot, value) or _identify(card, value, slot)


def _known(identified: dict[int, tuple[int, NvmlDevice, str]], slot: int, value: int | None) -> NvmlDevice | None:
    """The instance a slot's handle (`value`, its pointer value) was found to be at an earlier
    poll, if it still is: one call instead of identifying it (three).

    A driver may give a destroyed instance's pointer to the next one in its slot, so the
    ``MIG-`` UUID tells them apart: "UUIDs are immutable for the lifetime of a MIG device"
    (NVIDIA's reference of nvmlDeviceGetUUID,
    https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html); neither the ids
    nor the name would do alone (an instance carved again may share either).
    """
    known = identified.get(slot)
    if known is None or known[0] != value:
        return None
    # (the instance keeps the handle it was found with: it has the same value)
    instance = known[1]
    if instance.call(UUID).strip() != known[2]:  # (a str, as the binding gives it)
        return None
    return instance


def _identify(card: NvmlDevice, value: int | None, slot: int) -> NvmlDevice:
    """The instance behind a MIG handle (`value`, its pointer value) not known at its slot: one
    already known by its ids, or a new one (the handle an object of its own)."""
    handle = mig_handle(card.session.nvml, value)
    probe = card.mig_state.probe
    if probe is None:
        probe = NvmlDevice(card.session, handle, card.key, card.busid, card.name, is_mig_instance=True)
        card.mig_state.probe = probe
    else:
        probe.handle = handle
        probe.forget_support()
        probe.missing.clear()
    gpu_instance = int(probe.call("nvmlDeviceGetGpuInstanceId"))
    compute_instance = int(probe.call("nvmlDeviceGetComputeInstanceId"))
    profile = mig_profile(as_text(probe.call("nvmlDeviceGetName")))
    key = mig_key(card.key, gpu_instance, compute_instance)
    instance = card.mig_state.instances.get(key)
    if instance is None or instance.name != profile:
        busid = mig_busid(card.busid, gpu_instance, compute_instance)
        instance = NvmlDevice(card.session, handle, key, busid, profile, is_mig_instance=True)
        instance.task_support = probe_support(instance)
        instance.info = replace(
            card.info, uuid=_instance_uuid(probe), mig_profile=profile, parent_uuid=card.info.uuid,
            gpu_instance=str(gpu_instance), compute_instance=str(compute_instance),
        )
        uuid = instance.info.uuid
    else:
        uuid = _instance_uuid(probe)
    instance.handle = handle
    if value is not None and uuid:
        # (where the UUID cannot be read, the instance is identified afresh at every poll)
        card.mig_state.identified[slot] = (value, instance, uuid)
    return instance


def _instance_uuid(probe: NvmlDevice) -> str:
    """A MIG instance's own ``MIG-...`` UUID; "" where it cannot be read (an inventory label)."""
    found = answer(probe.call, UUID)
    return "" if isinstance(found, Outcome) else as_text(found).strip()


def _note_changes(card: NvmlDevice, found: dict[str, NvmlDevice], complete: bool) -> None:
    known = card.mig_state.instances
    if found.keys() != known.keys():  # (at most polls the same instances: nothing to say)
        for key, instance in found.items():
            if key not in known:
                log.info(
                    "nvml: GPU {card}: MIG instance {busid} ({profile}) is there",
                    card=printable(card.busid),
                    busid=printable(instance.busid),
                    profile=printable(instance.name),
                )
        if complete:
            for key, instance in known.items():
                if key not in found:
                    log.info(
                        "nvml: GPU {card}: MIG instance {busid} is gone",
                        card=printable(card.busid),
                        busid=printable(instance.busid),
                    )
    if complete:
        card.mig_state.instances = found  # (made for this poll, and kept by nothing else)
    else:
        known.update(found)


def _read_instance(instance: NvmlDevice, problems: Problems, poll: DevicePoll) -> DeviceSample:
    found = answer(read_device, instance, problems, poll, catch=DeviceLost)
    if not isinstance(found, DeviceLost):
        return found  # type: ignore[no-any-return]
    Attempt(instance, problems, f"MIG instance {instance.busid}").note(found.cause, key="lost")
    return placeholder(instance).absent()


#: the memory of a device not read
_UNREAD = MemoryKib(None, None)


def _unbusy(card: NvmlDevice, memory: MemoryKib = _UNREAD,
            processes: tuple[ProcessSample, ...] | None = None) -> DeviceSample:
    """A device with no utilization of its own: a card in MIG mode as one, an instance (None: not read)."""
    return DeviceSample(card.key, card.busid, card.name, card.task_support, UNSUPPORTED, UNSUPPORTED, *memory,
                        processes=processes, info=card.info)
