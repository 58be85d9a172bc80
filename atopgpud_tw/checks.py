"""A user's file, read bounded (`read_regular`), and the checks each value read from it goes through:
one rule for numbers, counts, flags and objects, shared by the simulator's scenario and the web
configuration.  Each takes the value, where it stands (``gpus[0].gpu_util``) and the error to raise
(a callable from the one-line message), and returns the value checked."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

Error = Callable[[str], Exception]

#: pids, ids and counts: what a C int holds
MAX_INTEGER = 2**31 - 1
#: no figure (seconds, MiB, percent) comes near this; beyond it (1e999 is inf) is an error
LARGEST = 1e15


def kind(value: Any) -> str:
    """What a decoded JSON or YAML value is, in words."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, where: str, error: Error, low: float | None = None, high: float | None = None,
           words: str = "a number") -> float:
    """A finite number from `low` on, to `high` (None: no bound but `LARGEST`)."""
    if not is_number(value):
        raise error(f"{where} must be {words}")
    if not -LARGEST <= value <= LARGEST:  # False for NaN too
        raise error(f"{where} must be a number from {-LARGEST:g} to {LARGEST:g}")
    if low is not None and (value < low or high is not None and value > high):
        raise error(f"{where} must be at least {low}" if high is None
                    else f"{where} must be a number from {low} to {high}")
    return value  # type: ignore[no-any-return]  # an int or a float


def integer(value: Any, where: str, error: Error, low: int = 0, words: str = "an integer, 0 or more",
            high: int | None = MAX_INTEGER) -> int:
    """An integer from `low` to `high` (None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise error(f"{where} must be {words}")
    if high is not None and value > high:
        raise error(f"{where} must be at most {high}")
    return value


def flag(value: Any, where: str, error: Error) -> bool:
    if not isinstance(value, bool):
        raise error(f"{where} must be true or false, not {kind(value)}")
    return value


def cycled(value: Any, where: str, error: Error, low: float | None = None, high: float | None = None,
           words: str = "a number") -> float | tuple[float, ...]:
    """A `number`, or a list of at least one (cycled, one entry per sample or second): a tuple."""
    if not isinstance(value, list):
        return number(value, where, error, low, high, words)
    if not value:
        raise error(f"{where} must not be an empty list")
    return tuple(number(entry, where, error, low, high, words) for entry in value)


def known(value: Any, where: str, keys: set[str] | dict[str, Any], error: Error, prefix: str | None = None
          ) -> dict[str, Any]:
    """A JSON object whose keys are all `keys`; keys starting with ``_`` are comments.  A key is named
    `prefix` + key (`where` and a dot unless given)."""
    if not isinstance(value, dict):
        raise error(f"{where} must be an object")
    for key in value:
        if key not in keys and not str(key).startswith("_"):
            raise error(f"{where + '.' if prefix is None else prefix}{key} is not a known field")
    return value


def read_regular(path: str | Path, max_size: int) -> bytes:
    """The bytes of the regular file a user named at `path`, opened without blocking; OSError (its
    strerror one line) if it is not one (a FIFO would block the reactor, ``/dev/zero`` fill
    memory), cannot be read, or holds more than `max_size` bytes."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(0, "is a directory")
        if not stat.S_ISREG(mode):
            raise OSError(0, "not a regular file")
        with os.fdopen(descriptor, "rb", closefd=False) as stream:
            data = stream.read(max_size + 1)
    finally:
        os.close(descriptor)
    if len(data) > max_size:
        raise OSError(0, f"larger than {_size(max_size)}")
    return data


def _size(count: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if count % 2**shift == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"
