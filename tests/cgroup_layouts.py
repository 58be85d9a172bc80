"""Real processes in real cgroups laid out as containers, pods and Slurm jobs lay them out.

`writable_hierarchy()` finds a cgroup hierarchy this test may make folders in (the
cgroup2 one, else the v1 ``name=systemd`` one of a hybrid host), or says why
not; `Placed` starts a ``sleep`` and moves it into a folder made for it, under a
top folder of the test's own that it removes again (the processes killed first).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def writable_hierarchy() -> tuple[Path | None, str]:
    """(a hierarchy's root, "") where folders can be made and processes moved; (None, why) otherwise."""
    if os.geteuid() != 0:
        return None, "not root: processes cannot be moved between cgroups"
    for root in (CGROUP, CGROUP / "unified", CGROUP / "systemd"):
        if not (root / "cgroup.procs").exists():
            continue
        if root != CGROUP / "systemd" and not (root / "cgroup.controllers").exists():
            continue  # not cgroup2
        probe = root / f"atopgpud-probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
        except OSError:
            continue
        probe.rmdir()
        return root, ""
    return None, "no writable cgroup hierarchy (cgroup2, or v1 name=systemd) here"


class Placed:
    """Sleeping processes, each in a cgroup folder laid out as asked, under one top folder."""

    def __init__(self, root: Path) -> None:
        self.top = root / f"atopgpud-test-{uuid.uuid4().hex[:12]}"
        self.top.mkdir()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.folders: list[Path] = []

    def start(self, layout: str) -> int:
        """A ``sleep`` moved into TOP/`layout` (made for it); its pid."""
        folder = self.top / layout
        made = []
        for parent in reversed([folder, *folder.parents]):
            if parent == self.top or self.top not in parent.parents:
                continue
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        self.folders.extend(made)
        proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        self.processes.append(proc)
        (folder / "cgroup.procs").write_text(str(proc.pid))
        return proc.pid

    def close(self) -> None:
        """Kill the processes and remove the folders, deepest first."""
        for proc in self.processes:
            proc.kill()
            proc.wait(timeout=10)
        for folder in sorted(self.folders, key=lambda path: len(path.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        try:
            self.top.rmdir()
        except OSError:
            pass
