"""Real processes in real cgroups laid out as containers, pods and Slurm jobs lay them out.

`writable_hierarchy()` finds a cgroup hierarchy this test may make folders in (the
cgroup2 one, else the v1 ``name=systemd`` one of a hybrid host), or says why
not; `Placed` starts a ``sleep`` and moves it into a folder made for it, under a
top folder of the test's own that it removes again (the processes killed first).
`Placed.delegate` hands a folder to a uid as systemd's ``Delegate=yes`` does
(the folder and its ``cgroup.procs``, ``cgroup.threads``, ``cgroup.subtree_control``
chowned), and `Placed.start_as` starts a process of that uid that makes folders
of its own in it and moves itself there, as a user may in ``user@UID.service``.
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


#: the files systemd hands over with a delegated cgroup (systemd.resource-control(5), Delegate=)
DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control")


class Placed:
    """Sleeping processes, each in a cgroup folder laid out as asked, under one top folder.

    With `slice_top` the top folder is a top-level slice, ``PREFIX.slice`` (`prefix` has no dash),
    so that layouts under it can be systemd's chain of slices (``PREFIX-kubepods.slice`` ...)."""

    def __init__(self, root: Path, slice_top: bool = False) -> None:
        self.prefix = f"atopgpudtest{uuid.uuid4().hex[:12]}"
        self.top = root / (f"{self.prefix}.slice" if slice_top else f"atopgpud-test-{uuid.uuid4().hex[:12]}")
        self.top.mkdir()
        self.processes: list[subprocess.Popen[bytes]] = []

    def make(self, layout: str) -> Path:
        """TOP/`layout`, made with the folders above it."""
        folder = self.top / layout
        for parent in reversed([folder, *folder.parents]):
            if parent == self.top or self.top not in parent.parents:
                continue
            if not parent.exists():
                parent.mkdir()
        return folder

    def start(self, layout: str) -> int:
        """A ``sleep`` moved into TOP/`layout` (made for it); its pid."""
        folder = self.make(layout)
        proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        self.processes.append(proc)
        (folder / "cgroup.procs").write_text(str(proc.pid))
        return proc.pid

    def delegate(self, layout: str, uid: int) -> Path:
        """TOP/`layout`, made and handed to `uid` as systemd delegates a unit's subtree."""
        folder = self.make(layout)
        for path in (folder, *(folder / name for name in DELEGATED_FILES)):
            if path.exists():
                os.chown(path, uid, uid)
        return folder

    def start_as(self, uid: int, delegated: str, own: str) -> int:
        """A process of `uid` (setpriv), put in the delegated folder TOP/`delegated`, that makes
        `own` below it itself and moves itself there, then sleeps; its pid."""
        script = 'read _ && mkdir -p "$1" && echo $$ > "$1/cgroup.procs" && echo moved && exec sleep 600'
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c", script, "sh", own],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.top / delegated,
        )
        self.processes.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        (self.top / delegated / "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        said = proc.stdout.readline()
        if said != b"moved\n":
            raise RuntimeError(f"uid {uid} could not move itself into {own}: exit {proc.wait(timeout=10)}")
        return proc.pid

    def close(self) -> None:
        """Kill the processes and remove every folder under the top (those the processes made too),
        deepest first."""
        for proc in self.processes:
            proc.kill()
            proc.wait(timeout=10)
        for folder in sorted((path for path in self.top.rglob("*") if path.is_dir()),
                             key=lambda path: len(path.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        try:
            self.top.rmdir()
        except OSError:
            pass
