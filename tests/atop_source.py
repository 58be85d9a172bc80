"""atop 2.13 built from its source in ../shared/clients, as a client for the tests.

atop 2.13 and later talk API version 2 over the abstract socket ``atopgpud_nvidia``
(``atop -k``).  Debian 12 ships 2.8.1 only, so the tests build 2.13 from the
tarball in the shared folder (``make atop``, with libncurses-dev, zlib1g-dev and
libglib2.0-dev installed) and use the binary as a client; nothing of atop goes
into this project.

The build is cached in ``$ATOPGPUD_ATOP_CACHE`` or /var/cache/atopgpud-tw-test (a
temporary folder where that cannot be written), in a folder named after the
tarball's hash, so a run builds it once; an fcntl lock keeps two pytest
processes from building it at once.  `built_atop` returns the binary, or the
reason it cannot be had, for the tests to skip with.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from locks import file_lock

#: the shared folder's clients, found from the repository root as ../shared
CLIENTS = Path(__file__).resolve().parents[2] / "shared" / "clients"
TARBALL = "atop-2.13.0-09c3266.tar.gz"
DEFAULT_CACHE = Path("/var/cache/atopgpud-tw-test")
#: the abstract socket atop 2.13 connects to (its gpucom.c), and the daemon's --listen for it
SOCKET_NAME = "atopgpud_nvidia"
LISTEN = f"unix:@{SOCKET_NAME}"
#: every test that listens there takes this lock first
LOCK_PATH = Path("/tmp/atopgpud-tests-abstract-atopgpud_nvidia.lock")


class Unavailable(Exception):
    """atop 2.13 cannot be built here; the message says why."""


def _cache_dir() -> Path:
    for candidate in (os.environ.get("ATOPGPUD_ATOP_CACHE"), DEFAULT_CACHE):
        if not candidate:
            continue
        path = Path(candidate)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    path = Path(tempfile.gettempdir()) / "atopgpud-tw-test"
    path.mkdir(exist_ok=True)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@functools.cache
def built_atop(timeout: float = 600.0) -> str:
    """The atop 2.13 binary, built first if the cache has none; `Unavailable` says why not."""
    tarball = CLIENTS / TARBALL
    if not tarball.is_file():
        raise Unavailable(f"the atop 2.13 source is not at {tarball} (the shared clients folder)")
    if shutil.which("make") is None or shutil.which("cc") is None:
        raise Unavailable("make and a C compiler are needed to build atop 2.13")
    cache = _cache_dir()
    key = _digest(tarball)
    binary = cache / f"atop-{key}" / "atop"
    if binary.is_file():
        return str(binary)
    with file_lock(cache / f".atop-{key}.lock", timeout, poll=0.5):
        if binary.is_file():  # another process built it meanwhile
            return str(binary)
        building = Path(tempfile.mkdtemp(prefix=f".atop-{key}-building-", dir=cache))
        log = cache / f"atop-{key}.build.log"
        try:
            with tarfile.open(tarball) as archive:
                archive.extractall(building, filter="data")
            (tree,) = [p for p in building.iterdir() if p.is_dir()]
            with open(log, "wb") as out:
                done = subprocess.run(
                    ["make", "-C", str(tree), f"-j{min(os.cpu_count() or 1, 4)}", "atop"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout,
                )
            if done.returncode != 0 or not (tree / "atop").is_file():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise Unavailable(
                    f"building atop 2.13 failed ({done.returncode}; libncurses-dev, zlib1g-dev and "
                    f"libglib2.0-dev installed?):\n{tail}"
                )
            binary.parent.mkdir(exist_ok=True)
            # only the binary is kept: the tree was needed for the build alone
            partial = binary.with_suffix(".partial")
            shutil.copy2(tree / "atop", partial)
            os.rename(partial, binary)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return str(binary)
