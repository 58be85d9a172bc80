"""What an NVML call's answer means, in one place: the outcomes of a call (`outcome` maps what
the binding raises), what a reader's devices share (`NvmlSession`), and `Attempt`, which turns
a call into a reading or a recorded problem.

A device's calls go through `device.NvmlDevice.call`, the others through `NvmlSession.call`;
code that branches on an outcome takes it as a value (`answer`): no other module catches one
(tests/test_layout.py).  `DeviceLost` and `Reinitialise` are no reading's: they pass through
`Attempt` up to the poll of the card or of the reader.  Runs in the reader's worker thread.
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
    """What a call gave instead of an answer: `value` is the NVML code where there is one,
    `error` what the binding raised (None where nothing was called)."""

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
    """The call failed in this poll; `cause` keys the logged problem."""


class Interrupted(Outcome):
    """Not a reading that failed: the poll of the device, or of every device, stops here."""


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
    """The outcome of `error`, raised by the binding's `function` (`key`: what a device remembers
    of it).  ``NVMLLibraryMismatchError`` (a symbol the driver lacks) is `Missing`, like
    FUNCTION_NOT_FOUND; an exception that is no NVML error (a binding or driver bug) `Failed`."""
    found = _outcome(error, nvml, function, key or function)
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
    """``call(*args, **named)``, or the outcome it raised of those in `catch`, as a value."""
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
    """`device.call`, asked again (a few times) while INSUFFICIENT_SIZE says a list outgrew its array."""
    for _ in range(SIZE_RETRIES):
        try:
            return device.call(function, *args, variant=variant)
        except Failed as failure:
            if failure.value != INSUFFICIENT_SIZE:
                raise
    return device.call(function, *args, variant=variant)


def answer_first(call: Callable[..., Any], device: Any, *tries: tuple[str, str | None, tuple[Any, ...]]) -> Any:
    """``call(device, function, *args, variant=variant)`` for the first of `tries`, each
    ``(function, variant, args)``, newest first, that is not `Missing` (which the device remembers)."""
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
    """What every device of one reader shares, for the reader's life."""

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
        if name not in self._bound:
            self._bound[name] = getattr(self.nvml, name, None)
        return self._bound[name]

    def call(self, function: str, *args: Any, where: str | None = None) -> Any:
        """``nvml.<function>(*args)`` for a call no device remembers: NOT_SUPPORTED is
        `Unsupported` at once; `where` is what the hang watch says it is on."""
        bound = self.function(function)
        if bound is None:
            raise Missing(function)
        try:
            return bound(*args) if self.watch is None else self.watch.run(function, where, bound, *args)
        except Exception as error:
            raise outcome(error, self.nvml, function) from None

    def say_once(self, what: str, message: str, *, warn: bool = False, **fields: Any) -> None:
        """Log `message` the first time this reader meets `what`."""
        if what in self.said:
            return
        self.said.add(what)
        (log.warn if warn else log.info)(message, **fields)


#: `Attempt`'s `idle` default: NOT_FOUND where a value was expected is a problem
NOTED: Any = object()


class Attempt:
    """One poll's readings of one device: ``attempt(read, *args)`` is what ``read(*args)``
    returns, or instead: `unsupported` for `Unsupported` (its problem standing while a
    figure that had answered is given up); ``None`` and a problem for `Failed`; for
    `NotFound`, `idle` where one is given, else ``None`` and a problem.  `key` and `part`
    are the problem's (`note`); `subject` what it says the device is."""

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
            # (handled inside the except block: a name bound to the error after it would keep the
            # error, its traceback and this frame in a cycle for the garbage collector, every poll)
            return self.instead(error, unsupported=unsupported, idle=idle, key=key, part=part)

    def answered(self, found: Any, **how: Any) -> Any:
        """An `answer`'s value, or what its outcome means (`instead`, given `how`), not raised again."""
        return self.instead(found, **how) if isinstance(found, Outcome) else found

    def instead(self, error: Outcome, *, unsupported: Any = UNSUPPORTED, idle: Any = NOTED, key: str | None = None,
                part: tuple[str, str] | None = None) -> Any:
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
        """A problem keyed ``"<device key> <key or cause>"`` saying ``"<subject>: <cause>"``; of a
        `part` (its key words and its words, such as a MIG slot's), keyed ``"<device key> <part
        key> <cause>"`` saying ``"<subject>: <part words>: <cause>"``."""
        if part is None:
            self.problems.add(f"{self.device.key} {key or cause}", f"{self.subject}: {cause}")
        else:
            self.problems.add(f"{self.device.key} {part[0]} {cause}", f"{self.subject}: {part[1]}: {cause}")
