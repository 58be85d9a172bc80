"""Sample a running daemon with py-spy and say where its time went (bench/perf.py --profile).

    .venv/bin/python bench/spy.py FILE.raw ...     # the summary of raw files recorded earlier

py-spy (``pip install py-spy``) attaches to the process from outside, so the
daemon runs unchanged.  Its raw output is one line per distinct stack, frames
joined by ``;``, then a sample count.  A thread waiting for work (the reactor
in ``epoll``, the NVML worker on its queue) shows as a stack that ends in the
waiting function: such samples are left out of the summary, which gives each
function's share of the busy samples, by itself (self) and with its callees.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from daemons import BenchError

_LINE = re.compile(r":\d+\)$")
#: functions whose own samples are waits, not work
WAITING = ("EPollReactor.doPoll", "SerialWorker._run", "Thread.wait", "Condition.wait", "socket.recv")


def py_spy() -> str:
    found = Path(sys.executable).with_name("py-spy")
    path = str(found) if found.exists() else shutil.which("py-spy")
    if not path:
        raise BenchError("--profile needs py-spy: pip install py-spy")
    return path


def start(pid: int, seconds: float, out: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    """Record `pid` for `seconds` into `out` (raw folded stacks), in the background."""
    return subprocess.Popen(
        [py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
         "--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def summary(raw: Path, top: int = 12) -> list[str]:
    """The `top` functions by busy self samples, and by busy inclusive samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    busy = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        # py-spy names a frame "function (file:line)": count by function, not by line
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        if not count.isdigit() or frames[-1].startswith(WAITING):
            continue
        busy += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    if not busy:
        return [f"{raw.name}: no busy samples"]
    lines = [f"{raw.name}: {busy} busy samples; share and samples by itself (self)"]
    lines += [f"  {100 * n / busy:5.1f}% {n:7d}  {frame}" for frame, n in own.most_common(top)]
    lines.append("the daemon's own functions with their callees (inclusive)")
    ours = [(f, n) for f, n in inclusive.most_common() if "(atopgpud_tw/" in f][:top]
    lines += [f"  {100 * n / busy:5.1f}% {n:7d}  {frame}" for frame, n in ours]
    return lines


def shares(raw: Path, within: str) -> tuple[int, Counter[str], Counter[str]]:
    """Samples whose stack holds a frame named `within` (a function, e.g. ``NvmlReader.read``), and
    per function name the inclusive and self samples among them: profiles of unequal length
    compare as shares of that function."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if not count.isdigit() or within not in names:
            continue
        total += int(count)
        own[names[-1]] += int(count)
        for name in set(names):
            inclusive[name] += int(count)
    return total, inclusive, own


def main() -> None:
    """``python bench/spy.py FILE.raw ...``: the summary of py-spy raw files.

    ``python bench/spy.py --within FUNCTION BEFORE.raw AFTER.raw``: the functions that
    changed most in their share of FUNCTION's samples, before and after.
    """
    args = sys.argv[1:]
    if args[:1] == ["--within"] and len(args) == 4:
        within = args[1]
        (tb, ib, ob), (ta, ia, oa) = shares(Path(args[2]), within), shares(Path(args[3]), within)
        if not tb or not ta:
            raise SystemExit(f"no samples within {within}")
        print(f"share of {within} (inclusive, and self): before {tb} samples, after {ta}")
        changed = sorted(set(ib) | set(ia), key=lambda name: -abs(ib[name] / tb - ia[name] / ta))
        for name in changed[:20]:
            print(f"  {100 * ib[name] / tb:5.1f}% -> {100 * ia[name] / ta:5.1f}%"
                  f"   (self {100 * ob[name] / tb:4.1f}% -> {100 * oa[name] / ta:4.1f}%)  {name}")
        return
    for raw in args:
        print("\n".join(summary(Path(raw))))


if __name__ == "__main__":
    main()
