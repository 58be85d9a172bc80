"""The one stand-in nvidia-smi of the tests: an executable steered by files.

``FakeSmi(root).binary`` is a shell wrapper that execs tests/fake_nvidia_smi.py on
a state directory (so the pid a reader spawns and kills is the stand-in itself);
the methods write that directory: what ``-q -x`` and ``-L`` print, and the mode
(report, hang, garbage, fail, empty, ...; see fake_nvidia_smi.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "smi"


class FakeSmi:
    """An executable ``nvidia-smi`` running the stand-in on its own state directory."""

    def __init__(self, root: Path) -> None:
        self.state = root / "smi-state"
        self.state.mkdir()
        self.binary = root / "nvidia-smi"
        command = [sys.executable, str(HERE / "fake_nvidia_smi.py"), str(self.state)]
        self.binary.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
        self.binary.chmod(0o755)

    def report(self, fixture: str, data: bytes | None = None) -> None:
        """``-q -x`` prints this fixture (or `data`)."""
        if data is None:
            data = (FIXTURES / fixture).read_bytes()
        (self.state / "report.xml").write_bytes(data)
        self.mode("report")

    def listing(self, fixture: str) -> None:
        """``-L`` prints this fixture."""
        shutil.copy(FIXTURES / fixture, self.state / "list.txt")
        self.mode("report", "list-mode")

    def mode(self, mode: str, which: str = "mode") -> None:
        """What ``-q -x`` (or, with ``which="list-mode"``, ``-L``) does from the next run on."""
        # written whole and renamed: a run starting meanwhile never reads half a word
        part = self.state / f"{which}.part"
        part.write_text(mode)
        part.replace(self.state / which)

    def calls(self) -> list[str]:
        """The arguments of every run so far, one string per run."""
        path = self.state / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def leftovers(self) -> list[int]:
        """The pids the leave and escape modes' children noted, oldest first."""
        path = self.state / "leftovers"
        return [int(word) for word in path.read_text().split()] if path.exists() else []

    def reap_leftovers(self) -> None:
        """SIGKILL what the leave and escape modes left, where a test failed to see it die (only ours)."""
        for pid in self.leftovers():
            try:
                if str(self.state).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

    def hung_pid(self) -> int | None:
        return self._pid("pid")

    def grandchild_pid(self) -> int | None:
        """The pid of what the stand-in started, as a wrapper script would."""
        return self._pid("grandchild")

    def _pid(self, name: str) -> int | None:
        path = self.state / name
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text else None

    def reap_leftover(self) -> None:
        """Kill a hung stand-in a daemon left behind (only ours: its command line names our state)."""
        pid = self.hung_pid()
        if pid is None:
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return
        if str(self.state).encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
