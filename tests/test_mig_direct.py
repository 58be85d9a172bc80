"""The calls that find a MIG card's instances, through the binding's function table
(readers/nvml/direct.py, `DirectCalls`): the wrappers' answers, nothing kept from one
call's answer into the next, and one C call each per poll."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from scenarios import a10_card

from atopgpud_tw.readers.nvml import direct
from atopgpud_tw.readers.nvml.direct import DirectCalls, mig_handle
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding


def carving(**top: Any) -> dict:
    """An A100 in MIG mode, instances in slots 0, 2 and 5 of its 7, and a whole A10 beside it."""
    instances = [
        {"profile": profile, "gpu_instance": gi, "memory_total_mib": 9728, "slot": slot,
         "processes": [{"pid": 100 + gi, "memory_mib": 64}]}
        for profile, gi, slot in (("1g.10gb", 9, 0), ("1g.10gb", 10, 2), ("2g.20gb", 5, 5))
    ]
    card = {"name": "NVIDIA A100-SXM4-80GB", "busid": "00000000:17:00.0", "memory_total_mib": 81920,
            "mig": instances}
    return {"gpus": [card, a10_card(mig_capable=True)], **top}


def binding(**top: Any) -> Any:
    nvml = simulated_binding(parse_scenario(carving(**top)), clock=lambda: 30.0)
    nvml.nvmlInit()
    return nvml


def value(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def test_the_answers_are_the_wrappers_answers():
    """The mode, each slot's handle (as its pointer value) and each instance's UUID: what
    nvidia-ml-py's wrappers give, and the same error for an empty slot and a card out of MIG mode."""
    nvml = binding()
    calls = DirectCalls(nvml).functions()
    card, whole = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    assert calls["nvmlDeviceGetMigMode"](card) == nvml.nvmlDeviceGetMigMode(card)[0] == 1
    assert calls["nvmlDeviceGetMigMode"](whole) == nvml.nvmlDeviceGetMigMode(whole)[0] == 0
    found = 0
    for slot in reversed(range(nvml.nvmlDeviceGetMaxMigDeviceCount(card))):  # the kept slot numbers grow
        try:
            wrapped = nvml.nvmlDeviceGetMigDeviceHandleByIndex(card, slot)
        except nvml.NVMLError as error:
            with pytest.raises(type(error)):
                calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, slot)
            continue
        got = calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, slot)
        assert got == value(wrapped) is not None
        handle = mig_handle(nvml, got)
        assert isinstance(handle, nvml.c_nvmlDevice_t) and value(handle) == got
        uuid = calls["nvmlDeviceGetUUID"](handle)
        assert isinstance(uuid, str) and uuid == nvml.nvmlDeviceGetUUID(wrapped)
        assert uuid.startswith("MIG-")
        found += 1
    assert found == 3
    assert calls["nvmlDeviceGetUUID"](whole) == nvml.nvmlDeviceGetUUID(whole)
    with pytest.raises(nvml.NVMLError_NotSupported):
        calls["nvmlDeviceGetMigMode"](mig_handle(nvml, calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 0)))


def test_a_handle_made_for_a_slot_is_its_own():
    """The slot call fills one kept handle; a handle made from its value is another object,
    which later slots' calls do not write over (an instance keeps the handle it was found with)."""
    nvml = binding()
    calls = DirectCalls(nvml).functions()
    card = nvml.nvmlDeviceGetHandleByIndex(0)
    first = mig_handle(nvml, calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 0))
    kept = value(first)
    other = calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 5)
    assert other != kept and value(first) == kept
    assert value(mig_handle(nvml, None)) is None


def test_an_answer_without_writing_reads_as_the_binding_s_fresh_objects():
    """A call that answers NVML_SUCCESS and writes nothing: 0, NULL and "" as the wrappers' new
    objects would hold, not what the call before it wrote."""
    nvml = binding()
    real = nvml._nvmlGetFunctionPointer
    silent = {"on": False}

    def table(symbol: str) -> Any:
        function = real(symbol)
        return lambda *args: 0 if silent["on"] else function(*args)

    nvml._nvmlGetFunctionPointer = table
    calls = DirectCalls(nvml).functions()
    card = nvml.nvmlDeviceGetHandleByIndex(0)
    handle = mig_handle(nvml, calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 0))
    assert calls["nvmlDeviceGetMigMode"](card) == 1 and calls["nvmlDeviceGetUUID"](handle)
    silent["on"] = True
    assert calls["nvmlDeviceGetMigMode"](card) == 0
    assert calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 0) is None
    assert calls["nvmlDeviceGetUUID"](handle) == ""


def test_a_uuid_that_is_no_utf8_fails_as_the_binding_s():
    """The binding decodes the UUID strictly: bytes that are no UTF-8 raise, here as there."""
    nvml = binding()
    real = nvml._nvmlGetFunctionPointer

    def table(symbol: str) -> Any:
        def garbled(handle: Any, buffer: Any, size: Any) -> int:
            buffer.value = b"MIG-\xff\xfe"
            return 0
        return garbled if symbol == "nvmlDeviceGetUUID" else real(symbol)

    nvml._nvmlGetFunctionPointer = table
    calls = DirectCalls(nvml).functions()
    with pytest.raises(UnicodeDecodeError):
        calls["nvmlDeviceGetUUID"](nvml.nvmlDeviceGetHandleByIndex(0))


def test_a_missing_symbol_is_the_binding_s_function_not_found():
    """A library without the MIG functions: the table's own FUNCTION_NOT_FOUND (the reader's
    choke point makes it a function missing), asked of the table again until it has it."""
    nvml = binding(missing_symbols=["nvmlDeviceGetMigMode"])
    calls = DirectCalls(nvml).functions()
    card = nvml.nvmlDeviceGetHandleByIndex(0)
    for _ in range(2):
        with pytest.raises(nvml.NVMLError_FunctionNotFound):
            calls["nvmlDeviceGetMigMode"](card)
    assert calls["nvmlDeviceGetMigDeviceHandleByIndex"](card, 0) is not None


def test_the_reader_takes_them_from_the_table():
    """Every MIG name `DirectCalls` answers is one the device's choke point sends there."""
    assert direct.MIG_NAMES <= direct.NAMES
    nvml = binding()
    assert set(direct.MIG_NAMES) <= set(direct.DirectCalls(nvml).functions())


def test_a_poll_of_a_mig_card_makes_one_c_call_each_and_no_wrapper():
    """Once the instances are known, a poll asks the card's mode once, each slot once and each
    instance's UUID once, through the C functions (not the binding's wrappers)."""
    clock = [30.0]
    nvml = simulated_binding(parse_scenario(carving()), clock=lambda: clock[0])
    wrapped: list[str] = []
    for name in ("nvmlDeviceGetMigMode", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetUUID"):
        real = getattr(nvml, name)

        def counted(*args: Any, real: Any = real, name: str = name) -> Any:
            wrapped.append(name)
            return real(*args)

        setattr(nvml, name, counted)
    reader = NvmlReader(nvml, reactor=None)
    reader.open()
    for second in range(3):
        clock[0] = 31.0 + second
        reader.read(clock[0])
    calls = nvml.nvmlLib.calls
    before = dict(calls)
    del wrapped[:]
    for second in range(5):
        clock[0] = 34.0 + second
        snapshot, problems = reader.read(clock[0])
        assert problems == {}
        assert len([d for d in snapshot.devices if d.present]) == 4
    made = {symbol: calls[symbol] - before.get(symbol, 0) for symbol in calls}
    assert made["nvmlDeviceGetMigMode"] == 5 * 2  # the MIG card and the A10
    assert made["nvmlDeviceGetMigDeviceHandleByIndex"] == 5 * 7
    assert made["nvmlDeviceGetUUID"] == 5 * 3
    assert made.get("nvmlDeviceGetGpuInstanceId", 0) == made.get("nvmlDeviceGetName", 0) == 0
    assert wrapped == []
