"""An exclusive lock on a file, shared by test processes that must take turns."""

from __future__ import annotations

import contextlib
import fcntl
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: Path | str, timeout: float, poll: float = 0.1) -> Iterator[None]:
    """An exclusive fcntl lock on `path`, waited for up to `timeout` seconds."""
    with open(path, "a+b") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for over {timeout} s") from None
                time.sleep(poll)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
