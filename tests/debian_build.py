"""The Debian package built as a user builds it: ``dpkg-buildpackage -us -uc -b`` in a clean copy of the checkout.

`build_package()` copies the checkout's files (`copy_source()`: ``git ls-files``: tracked and
untracked but not ignored, as they are now, so uncommitted edits are in and
.venv, build outputs and caches are not) into a temporary directory and builds
there; the checkout itself is never written to.  `Built` holds the .deb and
what the build said.  `repacked()` makes a "newer build" of a .deb for an
upgrade: the same files under a higher version (``dpkg-deb -R``, the version
raised in DEBIAN/control, ``dpkg-deb -b``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "atopgpud-tw"
#: what the build needs on the host (README's test command installs them)
BUILD_TOOLS = ("dpkg-buildpackage", "dh", "dh_virtualenv", "lintian", "dpkg-deb")


@dataclasses.dataclass
class Built:
    deb: Path
    log: str
    seconds: float


def missing_tools() -> list[str]:
    """The build tools not on PATH."""
    return [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]


def source_files(root: Path = ROOT) -> list[str]:
    """The checkout's files as they are now: tracked and untracked, not ignored, not deleted."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    return [name for name in out.split("\0") if name and (root / name).exists()]


def copy_source(dest: Path, root: Path = ROOT) -> Path:
    """The checkout's `source_files` copied into `dest` (made): a clean tree to build in; `dest`."""
    for name in source_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)
    return dest


def build_package(scratch: Path, root: Path = ROOT, timeout: float = 1200.0) -> Built:
    """``dpkg-buildpackage -us -uc -b`` in a copy of `root` under `scratch`; AssertionError with the log's
    tail if it fails."""
    source = copy_source(scratch / PACKAGE, root)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DEB_", "DH_", "VIRTUAL_ENV"))}
    began = time.monotonic()
    done = subprocess.run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=source, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - began
    log = done.stdout + done.stderr
    (scratch / "build.log").write_text(log)
    assert done.returncode == 0, f"dpkg-buildpackage exited {done.returncode}:\n{log[-6000:]}"
    debs = sorted(scratch.glob(f"{PACKAGE}_*.deb"))
    assert len(debs) == 1, f"{debs} built:\n{log[-3000:]}"
    return Built(debs[0], log, seconds)


def field(deb: Path, name: str) -> str:
    """One field of a .deb's control file."""
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True,
                          check=True).stdout.strip()


def repacked(deb: Path, version: str, dest: Path) -> Path:
    """The same package's files under `version`: what apt sees as a newer build."""
    tree = dest / "tree"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, capture_output=True)
    control = tree / "DEBIAN" / "control"
    control.write_text(re.sub(r"^Version: .*$", f"Version: {version}", control.read_text(), flags=re.M))
    out = dest / f"{PACKAGE}_{version}_{field(deb, 'Architecture')}.deb"
    subprocess.run(["dpkg-deb", "-b", str(tree), str(out)], check=True, capture_output=True)
    shutil.rmtree(tree)
    return out
