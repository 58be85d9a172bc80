#!/usr/bin/env python3
"""The reactor's floor: a bare Twisted LoopingCall that hands a no-op to a worker thread each tick.

    .venv/bin/python bench/floor.py COUNTER_FILE [--interval 1.0]

It runs until it is stopped.  Each tick hands ``lambda: None`` to the daemon's
own `SerialWorker` and back, as a poll does, and counts the tick as an
unsigned 64-bit integer in COUNTER_FILE (8 bytes, mapped), so that
bench/perf.py can read its CPU time (schedstat) from outside over the same
window as the daemons' and divide by the ticks.  What is left of a daemon's
CPU per poll above this is the daemon's own work.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("counter")
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    fd = os.open(args.counter, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8)
    counter = mmap.mmap(fd, 8)
    ticks = [0]

    from twisted.internet import reactor, task

    from atopgpud_tw.readers.nvml.worker import SerialWorker

    worker = SerialWorker(reactor)

    def counted(_: object) -> None:
        ticks[0] += 1
        struct.pack_into("=Q", counter, 0, ticks[0])

    def tick() -> object:
        return worker.submit(lambda: None).addCallback(counted)

    task.LoopingCall(tick).start(args.interval)
    reactor.run()


if __name__ == "__main__":
    main()
