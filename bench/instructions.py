#!/usr/bin/env python3
"""Instructions per poll of our daemon, the reference and the reactor floor, counted by valgrind.

    .venv/bin/python bench/instructions.py [--case tiny-1 ...] [--who ours --who reference --who floor]
                                           [--reference PATH] [--polls 20] [--ours-path TREE]

CPU time on a shared machine moves by tens of percent from run to run; the
count of instructions a poll executes does not.  Each daemon (bench/perf.py's
hosts, the same commands as perf.py's) runs under valgrind's callgrind, which
counts every instruction the process executes, all its threads together.  Once
it has polled a few times, the counts are zeroed (``callgrind_control -z``),
the daemon polls `--polls` times with no client asking anything, and the counts
are dumped (``callgrind_control -d``).  Polls are counted by two ``S`` requests
on one connection, asked outside the window, as perf.py does (the first just
before the zeroing: a poll that falls between them is counted and not in the
window, so a count is within one poll in `--polls`).

Per poll the report gives the whole daemon's instructions, the simulated
library's share (callgrind's inclusive count of ctypes' ``PyCFuncPtr_call``:
a call of a foreign function, its arguments converted and the simulator's
callback run, what bench/simtime times for perf.py and a real driver would
replace) and the rest.  For ours, the floor (bench/floor.py's bare LoopingCall
with a thread hand-off, counted the same way) is taken off that rest, as
perf.py does, to give the own work.  Valgrind runs a program some 50 times
slower, so each daemon takes a minute or two to start; the counts are of the
same code, not of the same speed: a cache miss counts as one instruction.

``--inprocess`` counts the reader's polls and the board's fold in one process
instead (no reactor, no worker thread: what readers/nvml/ and the board cost),
as the difference between a run of 20 polls and one of 20 + `--polls`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import FLOOR, BenchError, Ours, Reference, reference_script, samples  # noqa: E402
from perf import CASES  # noqa: E402

#: what counts as the simulated library: a ctypes call of a foreign function pointer
FOREIGN_CALL = "PyCFuncPtr_call"


def valgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no", "--dump-line=no"]


def totals(dump: Path) -> tuple[int, int]:
    """All instructions of a callgrind dump, and those inclusive in foreign calls."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                          capture_output=True, text=True, check=True).stdout
    whole = foreign = 0
    for line in text.splitlines():
        match = re.match(r"\s*([\d,]+)\s", line)
        if not match:
            continue
        count = int(match.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in line:
            whole = count
        elif re.search(rf"[:\s]{FOREIGN_CALL}\s", line + " ") and not foreign:
            foreign = count
    return whole, foreign


def window(pid: int, out: Path, polls: int, address: bytes | None, counter: Path | None) -> tuple[int, int, int]:
    """Zero the counts, wait `polls` polls, dump; (instructions, foreign, polls seen)."""
    def seen(sock: socket.socket | None) -> int:
        if counter is not None:
            return int.from_bytes(counter.read_bytes()[:8], "little") if counter.exists() else 0
        assert address is not None
        return samples(address, sock)

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        if address is not None:
            sock.settimeout(120.0)
            sock.connect(address)
        zeroed = seen(sock if address else None)
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        # nothing is asked inside the window: a request would be counted as the daemon's work
        time.sleep(polls * 1.0 + 0.5)
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        last = seen(sock if address else None)
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise BenchError(f"callgrind wrote no dump beside {out}")
    whole, foreign = totals(dumps[-1])
    return whole, foreign, max(1, last - zeroed)


def wait_until(test, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if test():
                return
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.5)
    raise BenchError(f"{what} did not start within {timeout:.0f} s under valgrind")


def count(who: str, case: str, polls: int, reference: Path | None, ours_path: str | None, work: Path) -> dict:
    scenario = work / f"{case}.json"
    scenario.write_text(json.dumps(CASES[case][1]))
    out = work / f"{who}-{case}.callgrind"
    counter = None
    if who == "floor":
        counter = work / "floor.count"
        command, env = [sys.executable, str(FLOOR), str(counter)], dict(os.environ)
        address = None
    elif who == "reference":
        assert reference is not None
        daemon = Reference(scenario, work, reference_script(reference, work))
        command, env = daemon.command()
        address = daemon.address
    else:
        daemon = Ours(scenario, work, source=ours_path)
        command, env = daemon.command()
        command = [sys.executable, *command]  # the console script, run by this Python under valgrind
        address = daemon.address
    env.pop("ATOPGPUD_BENCH_SIMTIME", None)
    env["PYTHONHASHSEED"] = "0"
    proc = subprocess.Popen([*valgrind(out), *command], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(work / f"{who}-{case}.log", "wb"))
    try:
        if counter is not None:
            wait_until(lambda: counter.exists() and int.from_bytes(counter.read_bytes()[:8], "little") >= 3,
                       300, who)
        else:
            wait_until(lambda: samples(address) >= 3, 300, who)
        whole, foreign, seen = window(proc.pid, out, polls, address, counter)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"who": who, "case": case, "polls": seen, "all": whole / seen, "sim": foreign / seen,
            "rest": (whole - foreign) / seen}


def child(case: str, polls: int, mig: str) -> None:
    """The reader's polls in this process on a simulated clock, folded into a Board (--inprocess)."""
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.sim import simulated_binding
    from atopgpud_tw.sim.scenario import parse_scenario

    now = [0.0]
    sim = simulated_binding(parse_scenario(CASES[case][1]), clock=lambda: now[0])

    class Clock:
        def seconds(self) -> float:
            return now[0]

    reader = NvmlReader(sim, Clock(), mig=mig)
    reader.open()
    board = Board()
    for _ in range(WARM_POLLS + polls):
        now[0] += 1.0
        board.fold(reader.read(now[0])[0])


#: polls before the counted ones, in --inprocess: the arrays grown, the driver's ways learnt
WARM_POLLS = 20


def inprocess(case: str, polls: int, mig: str, work: Path) -> dict:
    """Instructions per poll of the reader and the board in one process: a run of
    `WARM_POLLS` and one of as many more `polls`, the difference divided."""
    counts = []
    for extra in (0, polls):
        out = work / f"inprocess-{case}-{extra}.callgrind"
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run([*valgrind(out), sys.executable, __file__, "--child", case, str(extra), "--mig", mig],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        counts.append(totals(out))
    whole = counts[1][0] - counts[0][0]
    foreign = counts[1][1] - counts[0][1]
    return {"who": "inprocess", "case": case, "polls": polls, "all": whole / polls, "sim": foreign / polls,
            "rest": (whole - foreign) / polls}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--who", action="append", choices=("ours", "reference", "floor"))
    parser.add_argument("--reference", type=Path, metavar="PATH", help="atop's Python atopgpud (as perf.py)")
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--ours-path", metavar="TREE", help="our daemon from another source tree")
    parser.add_argument("--inprocess", action="store_true",
                        help="the reader and the board in one process (no reactor, no daemon), the installed "
                             "package or what PYTHONPATH puts first")
    parser.add_argument("--mig", default="instances", choices=("instances", "card"), help="with --inprocess")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "POLLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.mig)
        return 0
    if args.inprocess:
        work = Path(tempfile.mkdtemp(prefix="atopgpud-instructions-"))
        for case in args.case or ["tiny-1"]:
            row = inprocess(case, args.polls, args.mig, work)
            print(f"inprocess {case:10} all {row['all'] / 1e6:.3f}  simulated library {row['sim'] / 1e6:.3f}  "
                  f"own work {row['rest'] / 1e6:.3f}  ({row['polls']} polls)", flush=True)
        return 0
    who = args.who or (["floor", "ours"] + (["reference"] if args.reference else []))
    if "reference" in who and args.reference is None:
        parser.error("--who reference needs --reference PATH")
    work = Path(tempfile.mkdtemp(prefix="atopgpud-instructions-"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}: instructions per poll (millions), {args.polls} polls")
    floor = None
    rows = []
    for case in args.case or ["tiny-1"]:
        for one in who:
            if one == "floor" and floor is not None:
                continue
            try:
                row = count(one, case, args.polls, args.reference, args.ours_path, work)
            except BenchError as error:
                print(f"{one} {case}: {error}", file=sys.stderr)
                return 1
            if one == "floor":
                floor = row
            rows.append(row)
            own = ""
            if one == "ours" and floor is not None:
                own = f"  own work {(row['rest'] - floor['rest']) / 1e6:.3f}"
            print(f"{one:9} {case:10} all {row['all'] / 1e6:.3f}  simulated library {row['sim'] / 1e6:.3f}  "
                  f"rest {row['rest'] / 1e6:.3f}{own}  ({row['polls']} polls)", flush=True)
    if floor is not None:
        for row in rows:
            if row["who"] == "ours":
                print(f"ours {row['case']}: own work {(row['rest'] - floor['rest']) / 1e6:.3f} M instructions "
                      f"per poll (floor {floor['rest'] / 1e6:.3f} taken off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
