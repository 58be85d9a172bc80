#!/usr/bin/env python3
"""What a listen backlog does to a burst of connections nobody accepts yet.

    python3 bench/backlog.py [--burst 300] [--backlog 50 4096]

For each backlog, listens on an abstract UNIX socket without accepting, makes
`--burst` non-blocking connections at once (as clients do while the daemon is
busy or not yet accepting) and counts those the kernel queued and those it
refused with EAGAIN.  Twisted listens with a backlog of 50 unless told; the
daemon's endpoints ask for SOMAXCONN (4096 on Debian 12).
"""

from __future__ import annotations

import argparse
import os
import socket


def burst(backlog: int, count: int) -> tuple[int, int]:
    """(queued, refused) of `count` connections to a listener with `backlog` that accepts nothing."""
    name = f"\0atopgpud-backlog-{os.getpid()}".encode()
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen(backlog)
    held: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(count):
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            try:
                client.connect(name)
            except BlockingIOError:
                refused += 1
                client.close()
            else:
                held.append(client)
    finally:
        for client in held:
            client.close()
        server.close()
    return len(held), refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=300)
    parser.add_argument("--backlog", type=int, nargs="+", default=[50, socket.SOMAXCONN])
    args = parser.parse_args()
    for backlog in args.backlog:
        queued, refused = burst(backlog, args.burst)
        print(f"backlog {backlog}: {args.burst} connections at once, {queued} queued, {refused} refused (EAGAIN)")


if __name__ == "__main__":
    main()
