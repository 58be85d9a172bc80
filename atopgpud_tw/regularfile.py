"""Reading a file a user named, bounded: only a regular file, opened without blocking, at most so many bytes.

A FIFO would block the reactor until someone writes to it, and ``/dev/zero`` would
fill memory.  The one rule for the files an option names (scenario, web configuration).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular(path: str | Path, max_size: int) -> bytes:
    """The bytes of the regular file at `path`; OSError (its strerror one line) if it is
    not one, cannot be read, or holds more than `max_size` bytes."""
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
    if count % 2**20 == 0:
        return f"{count // 2**20} MiB"
    if count % 2**10 == 0:
        return f"{count // 2**10} KiB"
    return f"{count} bytes"
