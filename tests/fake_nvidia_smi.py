"""A stand-in for nvidia-smi in the reader tests, steered by files in a directory.

    fake_nvidia_smi.py STATE_DIR [nvidia-smi arguments]

``STATE_DIR/mode`` says what ``-q -x`` does and ``STATE_DIR/list-mode`` what
``-L`` does (each "report" when the file is absent):

- report: print ``STATE_DIR/report.xml`` (``-q -x``) or ``STATE_DIR/list.txt`` (``-L``);
- hang: write the pid to ``STATE_DIR/pid`` and sleep far past any test timeout;
- garbage: print what nvidia-smi prints without a driver, and exit 0;
- fail: print that message and exit 9, as nvidia-smi does;
- empty: print nothing and exit 0;
- orphan-hang: start a child that sleeps, holding stdout, then sleep too;
- flood: start a child that prints without end, then sleep;
- linger: print the report, start a child that sleeps holding stdout, and exit 0;
- leave: print the report, start a child that ignores SIGTERM, lets go of the
  pipes and sleeps, and exit 0;
- escape: the same, but the child calls setsid (leaving the run's session and
  group) and starts a child of its own that does the same, in its session;
- escape-hang: start such a child, then hang as hang does.

The child of orphan-hang, flood and linger writes its pid to
``STATE_DIR/grandchild``: what a wrapper script around the real nvidia-smi
leaves behind; those of leave and escape append theirs to ``STATE_DIR/leftovers``.

Every run appends its arguments as one line to ``STATE_DIR/calls``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


SLEEP = "import time; time.sleep(600)"
FLOOD = "import sys\nwhile True: sys.stdout.buffer.write(b'x' * 65536)"


#: a process that ignores SIGTERM, holds none of the run's pipes, notes its pid and sleeps
#: (run with CODE, its own text, defined first: an escaping one starts another like it)
LEAVE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[2] == "escape":
    os.setsid()
    if len(sys.argv) < 4:
        import subprocess
        subprocess.Popen([sys.executable, "-c", CODE, sys.argv[1], "escape", "inner"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(sys.argv[1], "a") as out:
    out.write(f"{os.getpid()}\\n")
time.sleep(600)
"""


def leave(state: Path, how: str) -> None:
    """Start LEAVE and wait until all it starts have noted their pids (a test looks for them)."""
    path = state / "leftovers"
    noted = len(path.read_text().split()) if path.exists() else 0
    code = "CODE = " + repr(LEAVE) + "\n" + LEAVE
    subprocess.Popen(
        [sys.executable, "-c", code, str(path), how],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wanted = noted + (2 if how == "escape" else 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (len(path.read_text().split()) if path.exists() else 0) < wanted:
        time.sleep(0.01)


def grandchild(state: Path, code: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", code])
    (state / "grandchild").write_text(str(child.pid))


def main(state: Path, arguments: list[str]) -> int:
    with open(state / "calls", "a") as calls:
        calls.write(" ".join(arguments) + "\n")
    listing = arguments == ["-L"]
    mode_file = state / ("list-mode" if listing else "mode")
    mode = mode_file.read_text().strip() if mode_file.exists() else "report"
    if mode == "hang":
        (state / "pid").write_text(str(os.getpid()))
        time.sleep(600)
    elif mode in ("orphan-hang", "flood"):
        grandchild(state, SLEEP if mode == "orphan-hang" else FLOOD)
        (state / "pid").write_text(str(os.getpid()))
        time.sleep(600)
    elif mode == "linger":
        sys.stdout.buffer.write((state / "report.xml").read_bytes())
        sys.stdout.flush()
        grandchild(state, SLEEP)
    elif mode in ("leave", "escape"):
        sys.stdout.buffer.write((state / "report.xml").read_bytes())
        sys.stdout.flush()
        leave(state, mode)
    elif mode == "escape-hang":
        leave(state, "escape")
        (state / "pid").write_text(str(os.getpid()))
        time.sleep(600)
    elif mode == "garbage":
        sys.stdout.write(NO_DRIVER)
    elif mode == "fail":
        sys.stdout.write(NO_DRIVER)
        return 9
    elif mode == "report":
        sys.stdout.buffer.write((state / ("list.txt" if listing else "report.xml")).read_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
