#!/usr/bin/env python3
"""The reader's own work per poll in one process, the simulated library's C functions left out.

    .venv/bin/python bench/ownwork.py [--case tiny-1 ...] [--polls 200] [--rounds 2] [--before TREE]

Each run is a fresh process: the NVML reader over the simulator (perf.py's hosts)
on a simulated clock one second per poll, folded into a Board.  The CPU time of
the simulated library's C functions is timed inside each ctypes call, as
bench/simtime does for the daemons, and taken off; what is left is the
reader's and the board's own Python, the binding's wrappers included, whose
share is given too (outermost wrapper calls, their C calls left out).  With
``--before TREE`` (a ``git archive`` of another commit) each round runs that
tree first, then the installed package: before and after, alternating.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def measure(case: str, polls: int) -> str:
    sys.path.insert(0, str(BENCH))
    from perf import CASES

    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.sim import simulated_binding
    from atopgpud_tw.sim.scenario import parse_scenario

    now = [0.0]
    sim = simulated_binding(parse_scenario(CASES[case][1]), clock=lambda: now[0])
    fd = os.open(os.environ["ATOPGPUD_BENCH_SIMTIME"], os.O_RDONLY)
    totals = mmap.mmap(fd, 16, prot=mmap.PROT_READ)
    unpack = struct.Struct("=QQ").unpack_from
    wrappers = [0]
    depth = [0]
    for name in dir(sim):
        function = getattr(sim, name)
        if name.startswith("nvml") and isinstance(function, types.FunctionType):

            def timed(*args: object, _function: types.FunctionType = function) -> object:
                if depth[0]:
                    return _function(*args)
                depth[0] += 1
                began, c_began = time.thread_time_ns(), unpack(totals, 0)[0]
                try:
                    return _function(*args)
                finally:
                    wrappers[0] += time.thread_time_ns() - began - (unpack(totals, 0)[0] - c_began)
                    depth[0] -= 1

            setattr(sim, name, timed)

    class Clock:
        def seconds(self) -> float:
            return now[0]

    reader = NvmlReader(sim, Clock())
    reader.open()
    board = Board()
    for _ in range(20):  # the arrays grown, the driver's ways learnt
        now[0] += 1.0
        board.fold(reader.read(now[0])[0])
    wrappers[0] = 0
    c_time, c_calls = unpack(totals, 0)
    began = time.thread_time_ns()
    for _ in range(polls):
        now[0] += 1.0
        board.fold(reader.read(now[0])[0])
    spent = time.thread_time_ns() - began
    c_time_after, c_calls_after = unpack(totals, 0)
    own = spent - (c_time_after - c_time)
    return (f"{case}: own work {own / polls / 1e6:.3f} ms per poll (the binding's wrappers "
            f"{wrappers[0] / polls / 1e6:.3f}, {100 * wrappers[0] / own:.0f} %), simulated library "
            f"{(c_time_after - c_time) / polls / 1e6:.3f} ms, C calls {(c_calls_after - c_calls) / polls:.0f}")


def run(case: str, polls: int, tree: str | None) -> str:
    """One measurement in a fresh process (`tree` first on its path, if given)."""
    with tempfile.NamedTemporaryFile(prefix="ownwork-") as totals:
        paths = [str(BENCH / "simtime")] + ([tree] if tree else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), ATOPGPUD_BENCH_SIMTIME=totals.name)
        command = [sys.executable, __file__, "--one", case, "--polls", str(polls)]
        return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="perf.py's case names (default: tiny-1, large-32, mig-32)")
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", metavar="TREE", help="a source tree to measure first in each round")
    parser.add_argument("--one", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(measure(args.one, args.polls))
        return 0
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {os.getloadavg()[0]:.2f}")
    for round_ in range(1, args.rounds + 1):
        for label, tree in ([("before", args.before)] if args.before else []) + [("after", None)]:
            for case in args.case or ["tiny-1", "large-32", "mig-32"]:
                print(f"round {round_} {label} {run(case, args.polls, tree)}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
