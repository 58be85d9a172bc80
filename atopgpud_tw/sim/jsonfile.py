"""Reading a JSON file a user named: every way it can be wrong is one line (a regular file only,
at most `MAX_SIZE` bytes: a fifo or ``/dev/zero`` would block or fill memory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atopgpud_tw.regularfile import read_regular

#: far beyond any scenario or calibration recording (those are some 100 KiB)
MAX_SIZE = 16 * 2**20


def read_json(path: str | Path, error: type[Exception]) -> Any:
    """The decoded contents of `path`; `error` with a one-line message naming it if unusable."""
    try:
        data = read_regular(path, MAX_SIZE)
    except OSError as failure:
        raise error(f"{path}: {failure.strerror or failure}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as failure:
        raise error(f"{path}: not UTF-8 text (byte {failure.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as failure:
        raise error(f"{path}: not JSON ({failure.msg} at line {failure.lineno})") from None
    except RecursionError:
        raise error(f"{path}: not usable JSON (nested too deeply)") from None
    except ValueError as failure:  # an integer of more digits than int() takes, NaN
        raise error(f"{path}: not usable JSON ({str(failure).split(';')[0]})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
