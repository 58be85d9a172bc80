#!/usr/bin/env python3
"""The daemon's own per-poll and per-request work, in one process, without sockets or NVML.

    .venv/bin/python bench/hotpath.py [--gpus 8] [--processes 30] [--clients 32] [--exits 12]

Folds a synthetic poll (every process's figures change, `--exits` processes
per GPU end and as many start) into a Board, then sends ``S`` requests through
the real protocol on a transport that discards what is written: each client
asks `--asks` times per poll, the first of which carries its exited processes.
Prints the fold's time per poll and the time per request.  Run it with
``PYTHONPATH=DIR`` to time another copy of the source tree (before and after).
"""

from __future__ import annotations

import argparse
import time

from twisted.internet.task import Clock

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory
from atopgpud_tw.snapshot import DeviceSample, ProcessSample, Snapshot


class NullTransport:
    """Just enough of a transport for the protocol; what it writes is dropped."""

    disconnecting = False

    def write(self, data: bytes) -> None:
        pass

    def registerProducer(self, producer: object, streaming: bool) -> None:
        pass

    def getPeer(self) -> None:
        return None

    def loseConnection(self) -> None:
        pass


def snapshot(gpus: int, processes: int, poll: int, exits: int) -> Snapshot:
    """Poll number `poll`: the first `exits` pids of each GPU are new in every poll."""
    devices = []
    for g in range(gpus):
        procs = tuple(
            ProcessSample(
                20000 + 1000 * g + p + (poll * 1_000_000 if p < exits else 0),
                "C", 500_000 + 37_000 * p, (7 * p + poll) % 100, (3 * p) % 50,
            )
            for p in range(processes)
        )
        devices.append(DeviceSample(f"GPU-{g}", f"00000000:{0x18 + g:02X}:00.0", "NVIDIA H100 80GB HBM3", 3,
                                    50, 10, 81559 * 1024, 30000 * 1024, procs))
    return Snapshot(tuple(devices))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=30, help="per GPU")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--exits", type=int, default=12, help="processes per GPU that end (and start) every poll")
    parser.add_argument("--asks", type=int, default=20, help="S requests per client per poll")
    parser.add_argument("--polls", type=int, default=50)
    args = parser.parse_args()

    board = Board()
    factory = AtopGpuFactory(board, clock=Clock())
    protocols = []
    for _ in range(args.clients):
        protocol = factory.buildProtocol(None)
        protocol.makeConnection(NullTransport())
        protocol.dataReceived(b"S\x02")  # subscribe to exited processes
        protocols.append(protocol)
    polls = [snapshot(args.gpus, args.processes, n, args.exits) for n in range(args.polls)]
    folding = first = rest = 0.0
    clock = time.perf_counter
    for poll in polls:
        began = clock()
        board.fold(poll)
        folded = clock()
        for protocol in protocols:
            protocol.dataReceived(b"S\x02")
        firsts = clock()
        for _ in range(args.asks - 1):
            for protocol in protocols:
                protocol.dataReceived(b"S\x02")
        folding += folded - began
        first += firsts - folded
        rest += clock() - firsts
    print(f"{args.gpus} GPUs x {args.processes} processes, {args.exits} exits per GPU per poll, "
          f"{args.clients} clients x {args.asks} S per poll")
    print(f"fold:                          {1e3 * folding / args.polls:8.3f} ms per poll")
    print(f"first S after a poll (exits):  {1e6 * first / (args.polls * args.clients):8.2f} us per request")
    if args.asks > 1:
        print(f"later S (cached reply):        {1e6 * rest / (args.polls * args.clients * (args.asks - 1)):8.2f} us "
              "per request")


if __name__ == "__main__":
    main()
