#!/usr/bin/env python3
"""Workloads whose processes come and go: sums exact and monotonic, the page bounded.

    .venv/bin/python bench/workload_churn.py [--minutes 10] [--gpus 4] [--processes 48]
        [--workloads 40] [--limit 12] [--expiry 20] [--scrape 15]

The NVML reader over the simulator on a simulated clock (one poll a second), its
processes starting and ending all the time (each GPU's processes run for 5 to
40 s, every minute again as new processes: pids reused), their contexts read by
the daemon's own `Contexts` from a /proc made for them (each pid in one of
``--workloads`` systemd services), folded into a Board with a `WorkloadBook` as
the daemon folds them.  Every ``--scrape`` simulated seconds the workload rows
are read as the page reads them, and checked:

- every series only grows while it is on the page, and each GPU's sum over its
  series (``other`` included) only grows;
- each GPU's sum equals the sum of every process's own figures on it, the
  exited ones' (kept by a watcher of its own) and the active ones' (the
  differential test);
- in a first run without the cap and the expiry, each workload's sums equal
  its own processes' figures; the second runs within ``--limit`` and ``--expiry``;
- the page holds at most ``--limit`` series (and one ``other`` per GPU).

Prints the checks, the counts, and the CPU time a poll and a page collection took.
Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def scenario(gpus: int, processes: int) -> dict[str, Any]:
    cards = []
    for g in range(gpus):
        procs = []
        for p in range(processes):
            start = (p * 7 + g * 3) % 50
            procs.append({"pid": 20000 + 1000 * g + p, "memory_mib": 64 + p, "sm_util": [5 + p % 60, 20, 90],
                          "mem_util": 3 + p % 7, "start": start + 0.5, "stop": start + 5.5 + (p * 13) % 35})
        cards.append({"name": "NVIDIA A100-SXM4-80GB", "busid": f"00000000:{16 + g:02X}:00.0",
                      "memory_total_mib": 81920, "memory_used_mib": 4096, "gpu_util": [40, 70], "mem_util": 10,
                      "processes": procs})
    return {"gpus": cards, "repeat": 60}


def fake_proc(root: Path, spec: dict[str, Any], workloads: int) -> None:
    """/proc/PID/{stat,status,cmdline,cgroup} of each scenario pid, in one of `workloads` services."""
    for card in spec["gpus"]:
        for proc in card["processes"]:
            pid = proc["pid"]
            folder = root / str(pid)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "stat").write_text(f"{pid} (python3) S 1 " + " ".join(["0"] * 17) + " 4242 0 0\n")
            (folder / "status").write_text(f"Name:\tpython3\nUid:\t{1000 + pid % 5}\t0\t0\t0\n")
            (folder / "cmdline").write_bytes(b"python3\0train.py\0")
            (folder / "cgroup").write_text(f"0::/system.slice/wl-{pid % workloads}.service\n")


def run(args: argparse.Namespace, limit: int, expiry: float) -> list[str]:
    from atopgpud_tw.counters import Counters, ExitedProcess
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.readers.procinfo import Contexts
    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.sim import simulated_binding
    from atopgpud_tw.sim.scenario import parse_scenario
    from atopgpud_tw.snapshot import UNKNOWN_CONTEXT
    from atopgpud_tw.workloads import WorkloadBook

    failures: list[str] = []
    spec = scenario(args.gpus, args.processes)
    now = [0.0]
    sim = simulated_binding(parse_scenario(spec), clock=lambda: now[0])

    class Clock:
        def seconds(self) -> float:
            return now[0]

    with tempfile.TemporaryDirectory() as proc:
        fake_proc(Path(proc), spec, args.workloads)
        reader = NvmlReader(sim, Clock())
        reader.contexts = Contexts(proc)
        reader.open()
        counters = Counters(weigh_processes=True)
        board = Board(counters)
        book = WorkloadBook(counters, "unit", limit, expiry, lambda: now[0])
        board.exit_watchers.append(book.exited)
        ended: dict[tuple[int, str], float] = {}
        lives = [0]

        def keep(exits: list[ExitedProcess]) -> None:
            for exit in exits:
                lives[0] += 1
                name = (exit.totals.context or UNKNOWN_CONTEXT).workload("unit")[1]
                key = (exit.device_index, name)
                ended[key] = ended.get(key, 0.0) + exit.totals.gpu_busy_seconds

        board.exit_watchers.append(keep)
        seen: dict[tuple[int, str, str], float] = {}
        gpu_sums: dict[int, float] = {}
        poll_cpu = page_cpu = 0.0
        pages = most = 0
        polls = int(args.minutes * 60)
        for poll in range(1, polls + 1):
            since = now[0]
            now[0] = float(poll)
            began = time.thread_time()
            board.fold(reader.read(now[0])[0], now[0], since)
            poll_cpu += time.thread_time() - began
            if poll % args.scrape:
                continue
            began = time.thread_time()
            rows = book.rows()
            page_cpu += time.thread_time() - began
            pages += 1
            most = max(most, len(book.entries))
            if len(book.entries) > limit:
                failures.append(f"t={poll}: {len(book.entries)} series, above the limit {limit}")
            sums: dict[int, float] = {}
            present = {(row.sums.device_index, row.sums.kind, row.sums.name) for row in rows}
            for key in [key for key in seen if key not in present]:
                del seen[key]  # it left the page (expired): back later, it starts again from 0
            for row in rows:
                key = (row.sums.device_index, row.sums.kind, row.sums.name)
                if row.busy < seen.get(key, 0.0) - 1e-6:
                    failures.append(f"t={poll}: {key} went down from {seen[key]} to {row.busy}")
                seen[key] = row.busy
                sums[row.sums.device_index] = sums.get(row.sums.device_index, 0.0) + row.busy
            for index, total in sums.items():
                if total < gpu_sums.get(index, 0.0) - 1e-6:
                    failures.append(f"t={poll}: GPU {index}'s sum went down")
                gpu_sums[index] = total
                # the differential: every process's own figures, exited and active
                own = sum(value for (gpu, _), value in ended.items() if gpu == index)
                own += sum(t.gpu_busy_seconds for t in counters.devices[index].processes.values()
                           if t.context is not None)
                if abs(total - own) > 1e-6 * max(1.0, own):
                    failures.append(f"t={poll}: GPU {index}: workloads {total}, processes {own}")
            if limit > args.workloads * args.gpus and not book.expired:
                for row in rows:
                    index, name = row.sums.device_index, row.sums.name
                    own = ended.get((index, name), 0.0) + sum(
                        t.gpu_busy_seconds for t in counters.devices[index].processes.values()
                        if t.context is not None and t.context.workload("unit")[1] == name)
                    if abs(row.busy - own) > 1e-6 * max(1.0, own):
                        failures.append(f"t={poll}: {name} on GPU {index}: {row.busy}, its processes {own}")
        print(f"limit {limit}, expiry {expiry:g} s: {polls} polls ({args.minutes:g} simulated minutes), "
              f"{lives[0]} processes ended, "
              f"{reader.contexts.reads} contexts read; at most {most} workload series on a page, "
              f"{book.expired} workloads expired into other; {pages} pages checked; CPU per poll "
              f"{1000 * poll_cpu / polls:.3f} ms, per page collection {1000 * page_cpu / max(pages, 1):.3f} ms; "
              f"{'all checks passed' if not failures else f'{len(failures)} checks FAILED'}")

    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--processes", type=int, default=48)
    parser.add_argument("--workloads", type=int, default=40)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--expiry", type=float, default=20.0)
    parser.add_argument("--scrape", type=int, default=15, help="simulated seconds between page collections")
    args = parser.parse_args()
    # first without the cap and expiry, each workload against its own processes; then within them
    failures = run(args, args.workloads * args.gpus + 1, 1e9) + run(args, args.limit, args.expiry)
    for failure in failures[:20]:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
