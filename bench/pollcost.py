#!/usr/bin/env python3
"""What one poll costs, and where: per thread of a running daemon, or in one process.

    .venv/bin/python bench/pollcost.py threads [--case large-32] [--reference PATH] [--seconds 20]
    .venv/bin/python bench/pollcost.py bare [--seconds 15]
    .venv/bin/python bench/pollcost.py inprocess [--case large-32] [--polls 300] [--cprofile 25] [--bare-calls]

``threads``: starts our daemon (or the reference) on a case's host and prints
each thread's CPU per poll while no client asks anything.  ``bare``: a Twisted
LoopingCall that ticks once a second and does nothing, then one that also hands
a no-op to a worker thread and back: the reactor's fixed cost per poll.
``inprocess``: the NVML reader over the simulator on a simulated clock that
advances one second per poll, folded into a Board; prints the CPU time per poll
and the share of the binding's functions (pynvml's wrappers over the simulator),
or, with ``--cprofile N``, the N functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import Ours, Reference, reference_script, samples, workdir  # noqa: E402
from perf import CASES, host  # noqa: E402

#: the hosts of perf.py's cases, and one GPU with no process (the fixed cost of a poll)
HOSTS = {name: case[1] for name, case in CASES.items()} | {"bare-1": host(1, 0)}


def thread_times(pid: int) -> dict[str, float]:
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
            times[tid] = int(stat.read().split()[0]) / 1e9
    return times


def threads(args: argparse.Namespace) -> None:
    work = workdir()
    path = work / "host.json"
    path.write_text(json.dumps(HOSTS[args.case]))
    daemon = Reference(path, work, reference_script(Path(args.reference), work)) if args.reference else Ours(path, work)
    daemon.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(daemon.address)
            first, before = samples(daemon.address, sock), thread_times(daemon.pid)
            time.sleep(args.seconds)
            after = thread_times(daemon.pid)
            polls = samples(daemon.address, sock) - first
    finally:
        daemon.stop()
    # the main thread runs the reactor (ours) or waits in accept() (the reference)
    shares = {"main" if tid == str(daemon.pid) else f"thread {tid}": after[tid] - before.get(tid, 0.0) for tid in after}
    print(f"{daemon.label}, {args.case}: {polls} polls; CPU ms per poll: "
          + ", ".join(f"{name} {1000 * s / polls:.3f}" for name, s in shares.items())
          + f"; total {1000 * sum(shares.values()) / polls:.3f}")


def bare(args: argparse.Namespace) -> None:
    from twisted.internet import reactor, task

    from atopgpud_tw.readers.nvml.worker import SerialWorker

    worker = SerialWorker(reactor)
    results = []

    def measure(handoff: bool) -> Any:
        loop = task.LoopingCall(lambda: worker.submit(lambda: None) if handoff else None)
        loop.start(1.0)
        start = sum(thread_times(os.getpid()).values())
        yield task.deferLater(reactor, args.seconds, lambda: None)
        loop.stop()
        results.append((handoff, (sum(thread_times(os.getpid()).values()) - start) / args.seconds))

    def run() -> Any:
        yield from measure(False)
        yield from measure(True)

    from twisted.internet.defer import inlineCallbacks

    done = inlineCallbacks(run)()
    done.addBoth(lambda _: reactor.stop())
    reactor.run()
    for handoff, per_tick in results:
        what = "tick with a hand-off to a worker thread" if handoff else "tick doing nothing"
        print(f"LoopingCall, 1 s, {what}: {1000 * per_tick:.3f} ms CPU per tick")


def inprocess(args: argparse.Namespace) -> None:
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.sim import simulated_binding
    from atopgpud_tw.sim.scenario import parse_scenario

    now = [0.0]
    sim = simulated_binding(parse_scenario(HOSTS[args.case]), clock=lambda: now[0])
    spent = [0.0]

    class Timed:
        """The binding over the simulated library, its nvml* functions timed."""

        def __getattr__(self, name: str) -> Any:
            value = getattr(sim, name)
            if not (callable(value) and name.startswith("nvml")):
                return value

            def timed(*a: Any, **k: Any) -> Any:
                began = time.thread_time()
                try:
                    return value(*a, **k)
                finally:
                    spent[0] += time.thread_time() - began

            return timed

    class Clock:
        def seconds(self) -> float:
            return now[0]

    reader = NvmlReader(sim if args.cprofile else Timed(), Clock())
    reader.open()
    if args.host_clocks:
        # watch the simulated host's clocks, as the daemon watches the real one's (readers/nvml/stamps.py)
        reader.host_offsets = sim.nvmlLib.model.host_offsets
    board = Board()

    def polls() -> None:
        for _ in range(args.polls):
            now[0] += 1.0
            board.fold(reader.read(now[0])[0])

    if args.cprofile:
        profile = cProfile.Profile()
        profile.runcall(polls)
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
        return
    # CPU time of this thread: other work on a shared machine does not count
    began = time.thread_time()
    polls()
    per_poll = (time.thread_time() - began) / args.polls
    print(f"{args.case}: read + fold {1000 * per_poll:.3f} ms per poll, of which the binding's "
          f"functions {1000 * spent[0] / args.polls:.3f} ms")
    if args.bare_calls:
        bare_calls(sim, now, args)


def bare_calls(sim: Any, now: list[float], args: argparse.Namespace) -> None:
    """The binding alone, cache warm: per GPU the reference's five calls (rates, memory, both
    process lists, process utilization) with their entries read, then our two samples calls."""
    handles = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(sim.nvmlDeviceGetCount())]
    newest: dict[tuple[int, int], int] = {}

    def five() -> None:
        for index, handle in enumerate(handles):
            sim.nvmlDeviceGetUtilizationRates(handle)
            sim.nvmlDeviceGetMemoryInfo(handle)
            listed = sim.nvmlDeviceGetComputeRunningProcesses(handle)
            listed += sim.nvmlDeviceGetGraphicsRunningProcesses(handle)
            try:
                # newer than the newest seen, as the reference asks
                busy = sim.nvmlDeviceGetProcessUtilization(handle, newest.get((index, -1), 0))
            except sim.NVMLError:
                busy = []
            [(p.pid, p.usedGpuMemory) for p in listed]
            read = [(s.pid, s.timeStamp, s.smUtil, s.memUtil) for s in busy]
            newest[(index, -1)] = max([newest.get((index, -1), 0), *(stamp for _, stamp, _, _ in read)])

    def samples() -> None:
        for index, handle in enumerate(handles):
            for kind in (sim.NVML_GPU_UTILIZATION_SAMPLES, sim.NVML_MEMORY_UTILIZATION_SAMPLES):
                _, got = sim.nvmlDeviceGetSamples(handle, kind, newest.get((index, kind), 0))
                if got:
                    newest[(index, kind)] = got[-1].timeStamp

    for what, calls in (("the reference's five calls per GPU", five), ("our two samples calls per GPU", samples)):
        began = time.thread_time()
        for _ in range(args.polls):
            now[0] += 1.0
            calls()
        print(f"{args.case}: {what}, binding alone: {1000 * (time.thread_time() - began) / args.polls:.3f} ms per poll")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("threads", "bare", "inprocess"))
    parser.add_argument("--case", default="large-32", choices=sorted(HOSTS))
    parser.add_argument("--reference", metavar="PATH",
                        help="threads: measure the reference daemon instead (atop's own atopgpud: "
                        "see bench/perf.py --help)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--host-clocks", action="store_true",
                        help="inprocess: the reader watches the host clocks for steps, as in the daemon")
    parser.add_argument("--bare-calls", action="store_true",
                        help="inprocess: then time the binding alone making the reference's calls, and ours")
    args = parser.parse_args()
    {"threads": threads, "bare": bare, "inprocess": inprocess}[args.mode](args)


if __name__ == "__main__":
    main()
