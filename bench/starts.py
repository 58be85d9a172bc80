#!/usr/bin/env python3
"""The CPU a poll spends on the listed processes' start times: read from /proc per pid
per poll (as before) against kept per process with pidfds (`readers.starts.ProcStarts`).

    .venv/bin/python bench/starts.py [--n 16 --n 256 --n 2040] [--gpus 8] [--polls 200] [--rounds 3]

N real sleeping processes (``sleep``), listed over GPUS lists per poll as the NVML
reader looks them up (one `of` per device's list, a sweep per poll).  CPU is the
process's user + system time (`time.process_time`), so the system calls count;
the two ways alternate within each round and the best round is kept.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time

from atopgpud_tw.readers.starts import ProcStarts, proc_start_time


def _old(lists: list[list[int]], polls: int) -> float:
    began = time.process_time()
    for _ in range(polls):
        for pids in lists:
            list(map(proc_start_time, pids))
    return (time.process_time() - began) / polls


def _new(lists: list[list[int]], polls: int, limit: int | None) -> tuple[float, int]:
    tracker = ProcStarts(limit=limit)
    for pids in lists:  # the first listing (one read and one pidfd per process) is not what a poll costs
        list(tracker.of(pids))
    tracker.sweep()
    began = time.process_time()
    for _ in range(polls):
        for pids in lists:
            list(tracker.of(pids))
        tracker.sweep()
    spent = (time.process_time() - began) / polls
    watched = tracker.watched
    tracker.close()
    return spent, watched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, action="append", help="processes (repeatable; default 16, 256, 1024, 2040)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="most pidfds (default: half the soft RLIMIT_NOFILE)")
    args = parser.parse_args()
    sizes = args.n or [16, 256, 1024, 2040]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"RLIMIT_NOFILE soft {soft}; pidfds at most {args.limit or soft // 2}")
    print(f"{'N':>6} {'old ms/poll':>12} {'new ms/poll':>12} {'ratio':>7} {'pidfds':>7}")
    for n in sizes:
        children = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
        try:
            pids = [child.pid for child in children]
            lists = [pids[g::args.gpus] for g in range(args.gpus)]
            old = new = float("inf")
            watched = 0
            for _ in range(args.rounds):
                old = min(old, _old(lists, args.polls))
                spent, watched = _new(lists, args.polls, args.limit)
                new = min(new, spent)
            ratio = old / new if new else float("inf")
            print(f"{n:>6} {old * 1e3:>12.3f} {new * 1e3:>12.3f} {ratio:>7.1f} {watched:>7}")
        finally:
            for child in children:
                child.kill()
            for child in children:
                child.wait()


if __name__ == "__main__":
    main()
