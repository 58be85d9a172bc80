"""What an NVML call's answer means, one place for it: the outcomes of a call, what a
reader's devices share (`NvmlSession`), and the adapter that turns a call into a
reading or a recorded problem (`Attempt`).

One mapping turns what the binding raises into one of the outcomes below
(`outcome`): a device's choke point (`device.NvmlDevice.call`) raises it, with
what the device remembers of its calls, and so do the calls that take no
device's memory along (`NvmlSession.call`: discovery, the inventory, GPM's
sample buffers, XID events).  Code that branches on an outcome takes it as a
value (`answer`): no other module catches one (tests/test_layout.py).
Two of them are not about the reading at all, and are no kind of `Failed`:
`DeviceLost` (the device cannot be read in this poll) and `Reinitialise` (NVML
itself has to be set up again).  They pass through `Attempt` untouched, up to
the poll of the card or of the reader.

`Attempt` is the one place where the others become values: the reading, what
the device cannot do (`Unsupported`: a given value, and a standing problem
while a figure that had answered is given up), or ``None`` with a problem
recorded in the poll's `Problems`.  Every problem of a device is keyed
``"<device key> <cause>"`` and says ``"GPU <bus id>: <cause>"`` (`Attempt.note`).
Everything here runs in the reader's worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from twisted.logger import Logger

from atopgpud_tw.nvml_codes import (
    FUNCTION_NOT_FOUND,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    LIFECYCLE,
    LOST,
    NAMES,
    NOT_FOUND,
    NOT_SUPPORTED,
)
from atopgpud_tw.problems import Problems
from atopgpud_tw.readers.nvml.watchdog import CallWatch
from atopgpud_tw.snapshot import UNSUPPORTED

log = Logger(namespace="atopgpud_tw.readers.nvml_device")

class Outcome(Exception):
    """What a call gave instead of an answer (each kind below): raised by the calls, and
    given as a value by `answer`.  `value` is the NVML code where there is one; `error`
    is what the binding raised (None where nothing was called)."""

    error: BaseException | None = None

    def __init__(self, cause: str, value: int | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.value = value


class Unsupported(Outcome):
    """The device cannot do this; the call is not made again (but at `Support`'s backoff)."""


class Missing(Unsupported):
    """The binding or the driver's library lacks the function: a fallback may have it."""


class NotFound(Outcome):
    """NVML_ERROR_NOT_FOUND: nothing there (no samples since the last read of an idle
    device, an empty MIG slot, no such instance)."""


class Failed(Outcome):
    """The call failed in this poll; `cause` keys the logged problem, `value` is the NVML code."""


class Interrupted(Outcome):
    """Not a reading that failed: the poll of the device, or of every device, stops here.
    `cause` says why (``"<function>: <error>"``), `value` is the NVML code."""


class DeviceLost(Interrupted):
    """The device cannot be read at all in this poll."""


class Reinitialise(Interrupted):
    """NVML itself has to be set up again."""


def error_name(error: BaseException) -> str:
    """A short stable name for an NVML error (also the key of a logged problem)."""
    value = getattr(error, "value", None)
    if isinstance(value, int):
        return "NVML_ERROR_" + NAMES.get(value, str(value))
    return type(error).__name__


def outcome(error: Exception, nvml: Any, function: str, key: str | None = None) -> Outcome:
    """The outcome of `error`, raised by the binding's `function` (`key`: what a device
    remembers of it, the function unless said):

    - FUNCTION_NOT_FOUND and ``NVMLLibraryMismatchError`` (the binding wants a symbol
      the installed driver lacks): `Missing`, never to work with this library;
    - NOT_SUPPORTED: `Unsupported` (a device believes it or not, `NvmlDevice.call`);
    - NOT_FOUND: `NotFound`;
    - UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH: `Reinitialise`;
    - GPU_IS_LOST, GPU_NOT_FOUND: `DeviceLost`;
    - any other code: `Failed`, ``"<function>: NVML_ERROR_<name>"``; any other exception
      (a binding or driver bug): `Failed`, ``"<function>: <type>: <text>"``, no code.
    """
    key = key or function
    found = _outcome(error, nvml, function, key)
    found.error = error
    return found


def _outcome(error: Exception, nvml: Any, function: str, key: str) -> Outcome:
    if isinstance(error, nvml.NVMLError):
        value = getattr(error, "value", None)
        if value == FUNCTION_NOT_FOUND:
            return Missing(key, value)
        if value == NOT_SUPPORTED:
            return Unsupported(key, value)
        if value == NOT_FOUND:
            return NotFound(function, value)
        cause = f"{function}: {error_name(error)}"
        if value in LIFECYCLE:
            return Reinitialise(cause, value)
        if value in LOST:
            return DeviceLost(cause, value)
        return Failed(cause, value)
    if isinstance(error, getattr(nvml, "NVMLLibraryMismatchError", ())):
        return Missing(f"{key}: {error}")
    return Failed(f"{function}: {type(error).__name__}: {error}")


#: the outcomes of a reading (`answer`'s default): the others stop the poll of a device or of all
READING = (Unsupported, Failed, NotFound)


def answer(call: Callable[..., Any], *args: Any, catch: Any = READING, **named: Any) -> Any:
    """``call(*args, **named)``, or the outcome it raised of those in `catch`, as a value
    (the one place, with `Attempt`, where an outcome is caught); the others pass."""
    try:
        return call(*args, **named)
    except catch as found:
        return found


def given(found: Any) -> Any:
    """An `answer`'s value, or its outcome raised again."""
    if isinstance(found, Outcome):
        raise found
    return found


def nothing_there(found: Any) -> bool:
    """Whether an answer is INVALID_ARGUMENT, which a MIG slot, a destroyed MIG instance's
    handle and a link past a card's last NVLink answer: nothing is there (no problem)."""
    return isinstance(found, Failed) and found.value == INVALID_ARGUMENT


#: times one poll asks again for a list or samples that outgrew the array it was given
SIZE_RETRIES = 3


def call_sized(device: Any, function: str, *args: Any, variant: str | None = None) -> Any:
    """`device.call` (`NvmlDevice.call`) for a function that fills an array: INSUFFICIENT_SIZE
    (the list outgrew the array, which `direct` has grown) is asked again, a few times."""
    for _ in range(SIZE_RETRIES):
        try:
            return device.call(function, *args, variant=variant)
        except Failed as failure:
            if failure.value != INSUFFICIENT_SIZE:
                raise
    return device.call(function, *args, variant=variant)


def answer_first(call: Callable[..., Any], device: Any, *tries: tuple[str, str | None, tuple[Any, ...]]) -> Any:
    """``call(device, function, *args, variant=variant)`` (`NvmlDevice.call` or `call_sized`) for the
    first of `tries`, each ``(function, variant, args)``, newest first, that the binding and the
    driver have: `Missing` (which the device remembers: later polls go straight past it) moves on
    to the next; any other outcome, and the last one's, is raised."""
    for function, variant, args in tries[:-1]:
        if (variant or function) not in device.missing:
            try:
                return call(device, function, *args, variant=variant)
            except Missing:
                pass
    function, variant, args = tries[-1]
    return call(device, function, *args, variant=variant)


def as_text(value: Any) -> str:
    """Names and bus ids as str, whether the binding returns bytes or str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\0")
    return str(value)


@dataclass(eq=False)
class NvmlSession:
    """What every device of one reader shares, for the reader's life: the binding, the
    poll's time, the hang watch and what was said once."""

    nvml: Any
    #: where the reader's thread notes the call in progress, for the hang watchdog
    watch: CallWatch | None = None
    #: the reader's time of the poll in progress (what `Support` spells are held to)
    now: float = 0.0
    #: what was said once per reader
    said: set[str] = field(default_factory=set)
    #: the binding's functions by name, looked up once (None: the binding lacks it)
    _bound: dict[str, Any] = field(default_factory=dict, repr=False)

    def function(self, name: str) -> Any:
        """The binding's function `name`, or None where this binding has none."""
        try:
            return self._bound[name]
        except KeyError:
            found = self._bound[name] = getattr(self.nvml, name, None)
            return found

    def call(self, function: str, *args: Any, where: str | None = None) -> Any:
        """``nvml.<function>(*args)`` for a call no device remembers (one without a device
        handle, or one asked once): what it raises is its `outcome`, NOT_SUPPORTED
        `Unsupported` at once; `where` is what the hang watch says it is on."""
        bound = self.function(function)
        if bound is None:
            raise Missing(function)
        watch = self.watch
        if watch is not None:
            watch.begin(function, where)
        try:
            return bound(*args)
        except Exception as error:
            raise outcome(error, self.nvml, function) from None
        finally:
            if watch is not None:
                watch.end()

    def say_once(self, what: str, message: str, *, warn: bool = False, **fields: Any) -> None:
        """Log `message` the first time this reader meets `what`."""
        if what in self.said:
            return
        self.said.add(what)
        (log.warn if warn else log.info)(message, **fields)


#: `Attempt`'s `idle` default: NOT_FOUND where a value was expected is a problem
NOTED: Any = object()


class Attempt:
    """One poll's readings of one device: ``attempt(read, *args)`` is the reading
    ``read(*args)`` returns (with `named` given to it too), or what its outcome means,
    with the problem recorded in `problems`.

    - `Unsupported`: `unsupported` (``UNSUPPORTED`` unless said); while a figure
      that had answered is given up (`device.given_up`), its problem stands;
    - `Failed`: ``None``, and the problem ``failure.cause``;
    - `NotFound`: ``None`` and the problem ``"<function>: NVML_ERROR_NOT_FOUND"``
      (keyed ``"<function> not found"``), or `idle` where one is given (then no
      problem: nothing there is the answer);
    - `DeviceLost` and `Reinitialise` are let through: they are no reading's.

    The problem of a failure is keyed by its cause, or by `key` where one is given,
    and is a `part`'s where one is given (`note`).  `device` is anything with
    ``key``, ``busid`` and ``given_up(key)`` (an `NvmlDevice`); `subject` is what
    its problems say it is (``"GPU <bus id>"`` unless said).
    """

    __slots__ = ("device", "problems", "subject")

    def __init__(self, device: Any, problems: Problems, subject: str | None = None) -> None:
        self.device = device
        self.problems = problems
        self.subject = subject or f"GPU {device.busid}"

    def __call__(self, read: Callable[..., Any], *args: Any, unsupported: Any = UNSUPPORTED, idle: Any = NOTED,
                 key: str | None = None, part: tuple[str, str] | None = None, **named: Any) -> Any:
        try:
            return read(*args, **named)
        except READING as error:
            return self._instead(error, unsupported, idle, key, part)

    def _instead(self, error: Outcome, unsupported: Any, idle: Any, key: str | None,
                 part: tuple[str, str] | None) -> Any:
        """What a reading that gave `error` is, its problem noted."""
        if isinstance(error, Unsupported):
            cause = self.device.given_up(str(error))
            if cause:
                self.note(cause)
            return unsupported
        if isinstance(error, Failed):
            self.note(error.cause, key=key, part=part)
            return None
        if idle is not NOTED:
            return idle
        # NOT_FOUND where a value was expected: nothing to count in this poll
        self.note(f"{error}: NVML_ERROR_NOT_FOUND", key=key or f"{error} not found", part=part)
        return None

    def note(self, cause: str, *, key: str | None = None, part: tuple[str, str] | None = None) -> None:
        """Record a problem of the device: keyed ``"<device key> <key or cause>"``, saying
        ``"<subject>: <cause>"`` (``"GPU <bus id>: <cause>"``); of a `part` of it (its key
        words and its words, such as a MIG slot's), keyed ``"<device key> <part key> <cause>"``,
        saying ``"<subject>: <part words>: <cause>"``."""
        if part is None:
            self.problems.add(f"{self.device.key} {key or cause}", f"{self.subject}: {cause}")
        else:
            self.problems.add(f"{self.device.key} {part[0]} {cause}", f"{self.subject}: {part[1]}: {cause}")
