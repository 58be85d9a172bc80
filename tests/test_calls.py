"""The one mapping from what the binding raises to an outcome (`calls.outcome`), used by a
device's choke point and by the calls no device remembers alike, and what `Attempt` makes
of each outcome; over a stand-in binding, no simulator."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from atopgpud_tw import nvml_codes
from atopgpud_tw.problems import Problems
from atopgpud_tw.readers.nvml.calls import (
    Attempt,
    DeviceLost,
    Failed,
    Interrupted,
    Missing,
    NotFound,
    NvmlSession,
    Outcome,
    Reinitialise,
    Unsupported,
    answer,
    given,
    nothing_there,
    outcome,
)
from atopgpud_tw.readers.nvml.device import NvmlDevice
from atopgpud_tw.readers.nvml.gpm import GpmReader, GpmStream
from atopgpud_tw.readers.nvml.watchdog import CallWatch


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class NVMLLibraryMismatchError(Exception):
    pass


def binding(**functions: Any) -> SimpleNamespace:
    return SimpleNamespace(NVMLError=NVMLError, NVMLLibraryMismatchError=NVMLLibraryMismatchError, **functions)


def raising(error: Exception) -> Any:
    def call(*args: Any) -> Any:
        raise error

    return call


#: what each error becomes, and the words it is given
MAPPED = [
    (NVMLError(nvml_codes.FUNCTION_NOT_FOUND), Missing, "nvmlFoo"),
    (NVMLLibraryMismatchError("no symbol"), Missing, "nvmlFoo: no symbol"),
    (NVMLError(nvml_codes.NOT_SUPPORTED), Unsupported, "nvmlFoo"),
    (NVMLError(nvml_codes.NOT_FOUND), NotFound, "nvmlFoo"),
    (NVMLError(nvml_codes.UNINITIALIZED), Reinitialise, "nvmlFoo: NVML_ERROR_UNINITIALIZED"),
    (NVMLError(nvml_codes.DRIVER_NOT_LOADED), Reinitialise, "nvmlFoo: NVML_ERROR_DRIVER_NOT_LOADED"),
    (NVMLError(nvml_codes.LIB_RM_VERSION_MISMATCH), Reinitialise, "nvmlFoo: NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
    (NVMLError(nvml_codes.GPU_IS_LOST), DeviceLost, "nvmlFoo: NVML_ERROR_GPU_IS_LOST"),
    (NVMLError(nvml_codes.GPU_NOT_FOUND), DeviceLost, "nvmlFoo: NVML_ERROR_GPU_NOT_FOUND"),
    (NVMLError(nvml_codes.UNKNOWN), Failed, "nvmlFoo: NVML_ERROR_UNKNOWN"),
    (NVMLError(nvml_codes.TIMEOUT), Failed, "nvmlFoo: NVML_ERROR_TIMEOUT"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), Failed,
     "nvmlFoo: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: bad"),
]


@pytest.mark.parametrize("error, kind, words", MAPPED)
def test_one_mapping_for_device_calls_and_session_calls(error: Exception, kind: type, words: str) -> None:
    """`outcome`, a session's call and a device's first call give the same outcome of one error."""
    found = outcome(error, binding(), "nvmlFoo")
    assert type(found) is kind and str(found) == words
    session = NvmlSession(binding(nvmlFoo=raising(error)), watch=CallWatch())
    with pytest.raises(kind) as by_session:
        session.call("nvmlFoo", 1, where="GPU 0")
    device = NvmlDevice(session, "handle", "GPU-a", "00000000:17:00.0", "card")
    with pytest.raises(kind) as by_device:
        device.call("nvmlFoo")
    assert str(by_session.value) == str(by_device.value) == words
    assert session.watch is not None and session.watch.current is None  # the watch is ended either way
    if kind is Failed or issubclass(kind, Interrupted):
        code = getattr(error, "value", None)
        assert by_session.value.value == by_device.value.value == code  # type: ignore[attr-defined]


def test_losing_the_device_or_nvml_is_no_failed_reading() -> None:
    assert not issubclass(DeviceLost, Failed) and not issubclass(Reinitialise, Failed)
    assert all(issubclass(kind, Outcome) for kind in (Unsupported, Missing, NotFound, Failed, Interrupted))


def test_a_session_call_the_binding_lacks_is_missing() -> None:
    with pytest.raises(Missing, match="nvmlGpmSampleAlloc"):
        NvmlSession(binding()).call("nvmlGpmSampleAlloc")


def test_a_device_takes_not_supported_from_a_call_that_answered_for_a_failed_reading() -> None:
    """The device's own memory, on top of the one mapping: a call that answered is not believed
    at once (`Support`), while the session's call has no memory and is `Unsupported` at once."""
    answers: list[Any] = [7, NVMLError(nvml_codes.NOT_SUPPORTED)]

    def foo(*args: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    session = NvmlSession(binding(nvmlFoo=foo))
    device = NvmlDevice(session, "handle", "GPU-a", "00000000:17:00.0", "card")
    assert device.call("nvmlFoo") == 7
    with pytest.raises(Failed) as failed:
        device.call("nvmlFoo")
    assert (failed.value.cause, failed.value.value) == ("nvmlFoo: NVML_ERROR_NOT_SUPPORTED", nvml_codes.NOT_SUPPORTED)


class Device:
    key = "GPU-a"
    busid = "00000000:17:00.0"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def call(self, function: str, *args: Any, variant: str | None = None) -> Any:
        raise self.error

    def given_up(self, key: str) -> str | None:
        return None


@pytest.mark.parametrize(
    "error, problems",
    [
        (Failed("nvmlFoo: NVML_ERROR_UNKNOWN", nvml_codes.UNKNOWN),
         {"GPU-a nvmlFoo: NVML_ERROR_UNKNOWN": "GPU 00000000:17:00.0: nvmlFoo: NVML_ERROR_UNKNOWN"}),
        (NotFound("nvmlFoo"), {"GPU-a nvmlFoo not found": "GPU 00000000:17:00.0: nvmlFoo: NVML_ERROR_NOT_FOUND"}),
        (Unsupported("nvmlFoo"), {}),
    ],
)
def test_an_attempt_keys_each_problem_one_way(error: Exception, problems: dict[str, str]) -> None:
    """The health figures' problems are the polls' (one key format, `Attempt.note`)."""
    found = Problems()
    device = Device(error)
    assert Attempt(device, found)(device.call, "nvmlFoo", unsupported=None) is None
    assert dict(found) == problems


@pytest.mark.parametrize(
    "error",
    [Failed("nvmlFoo: NVML_ERROR_UNKNOWN", nvml_codes.UNKNOWN), NotFound("nvmlFoo"), Unsupported("nvmlFoo"),
     Failed("nvmlFoo: NVML_ERROR_INVALID_ARGUMENT", nvml_codes.INVALID_ARGUMENT)],
)
def test_an_answer_is_the_value_or_the_reading_s_outcome(error: Exception) -> None:
    """`answer` gives a reading's outcome as the value, `given` raises it again; a poll's
    outcomes pass unless caught; only INVALID_ARGUMENT is nothing there."""
    device = Device(error)
    assert answer(device.call, "nvmlFoo") is error
    with pytest.raises(type(error)):
        given(answer(device.call, "nvmlFoo"))
    assert answer(lambda value: value + 1, 2) == given(3) == 3
    assert nothing_there(error) == (getattr(error, "value", None) == nvml_codes.INVALID_ARGUMENT)
    lost = DeviceLost("nvmlFoo: NVML_ERROR_GPU_IS_LOST", nvml_codes.GPU_IS_LOST)
    with pytest.raises(DeviceLost):
        answer(Device(lost).call, "nvmlFoo")
    assert answer(Device(lost).call, "nvmlFoo", catch=Interrupted) is lost


def test_a_watched_call_is_noted_while_it_runs_and_its_long_duration_kept() -> None:
    """`CallWatch.run` is `begin`, the call and `end`: the call in progress names the function and
    where, it is cleared when the call returns or raises, and one that ran long leaves its duration."""
    now = [10.0]
    watch = CallWatch(clock=lambda: now[0])
    watch.long_after = 5.0
    seen = []

    def slow(value: int) -> int:
        call = watch.current
        assert call is not None
        seen.append((call.function, call.where, call.started))
        now[0] += 6.0
        return value

    assert watch.run("nvmlFoo", "GPU 0", slow, 3) == 3
    assert seen == [("nvmlFoo", "GPU 0", 10.0)] and watch.current is None
    assert watch.long is not None and watch.long[1] == 6.0
    serial = watch.long[0]
    with pytest.raises(ZeroDivisionError):
        watch.run("nvmlBar", None, lambda: 1 // 0)
    assert watch.current is None and watch.long[0] == serial  # quick: no duration left
    watch.begin("nvmlBaz")
    assert watch.current is not None and watch.current.serial == serial + 2
    watch.end()
    assert watch.current is None


def test_a_function_the_binding_lacks_is_missing_and_asked_again_once_forgotten() -> None:
    """A device finds each function once; one the binding lacks is missing, and is looked up again
    (not taken from what the device found) once its missing mark is cleared."""
    session = NvmlSession(binding())
    device = NvmlDevice(session, "handle", "GPU-a", "00000000:17:00.0", "card")
    with pytest.raises(Missing):
        device.call("nvmlFoo")
    assert "nvmlFoo" in device.missing
    device.missing.clear()
    session._bound.pop("nvmlFoo")
    session.nvml.nvmlFoo = lambda handle: handle
    assert device.call("nvmlFoo") == "handle"


@pytest.mark.parametrize("error", [DeviceLost("nvmlFoo: NVML_ERROR_GPU_IS_LOST"), Reinitialise("nvmlFoo: x")])
def test_an_attempt_lets_a_lost_device_or_nvml_through(error: Exception) -> None:
    with pytest.raises(type(error)):
        device = Device(error)
        Attempt(device, Problems())(device.call, "nvmlFoo")


@pytest.mark.parametrize("code", [nvml_codes.UNINITIALIZED, nvml_codes.GPU_IS_LOST, nvml_codes.UNKNOWN,
                                  nvml_codes.NOT_FOUND, nvml_codes.FUNCTION_NOT_FOUND])
def test_gpm_buffers_of_a_library_gone_are_let_go(code: int) -> None:
    """Freeing GPM's buffers never raises: a lost card is forgotten, and NVML shut down, whatever they answer."""
    freed: list[Any] = []

    def free(buffer: Any) -> None:
        freed.append(buffer)
        raise NVMLError(code)

    gpm = GpmReader(NvmlSession(binding(nvmlGpmSampleFree=free)))
    stream = GpmStream(previous="one", spare="two")
    gpm._free(None, [stream])
    assert freed == ["one", "two"] and (stream.previous, stream.spare) == (None, None)


@pytest.mark.parametrize("error", [lambda: Failed("nvmlFoo: NVML_ERROR_UNKNOWN", nvml_codes.UNKNOWN),
                                   lambda: Unsupported("nvmlFoo")], ids=["failed", "unsupported"])
def test_a_reading_that_fails_every_poll_leaves_no_garbage_for_the_collector(error: Callable[[], Outcome]) -> None:
    """Readings that fail or are not supported go through `Attempt` at every poll of every device: what
    they leave is freed at once, not kept in a cycle (the error, its traceback, the frame) that only the
    garbage collector, run in the reader's thread, would free."""
    device = SimpleNamespace(key="k", busid="00000000:17:00.0", given_up=lambda key: None)
    attempt = Attempt(device, Problems())

    def read() -> None:
        raise error()

    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            attempt(read)
            attempt.answered(answer(read))
        assert gc.collect() == 0
    finally:
        gc.enable()
