"""The load generator of bench/perf.py: atop-like clients, one process and one connection each.

Every client connects first, waits for a common start time, then sends ``S`` and
reads the whole reply, in a loop, until the common end (or once per `pace`
seconds).  A "silent" client never sends ``S``: it asks ``T`` once a second, the
way a client that never subscribes to exited processes looks to a daemon.
Latencies are measured per request in the client, from the send to the last
byte of the reply.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

#: seconds every client gets to connect before the common start
CONNECT_GRACE = 1.0


@dataclass
class LoadResult:
    """What all clients of one load saw together."""

    seconds: float
    requests: int = 0
    latencies: list[float] = field(default_factory=list)
    reply_sizes: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    #: ``E`` records received, all clients together
    exited: int = 0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, fraction: float) -> float:
        """A latency percentile in seconds (nearest rank over every request)."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _read_reply(sock: socket.socket, view: memoryview) -> int:
    """Read one whole reply into `view`; its size, prelude included."""
    got = 0
    while got < 4:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the daemon closed the connection")
        got += n
    size = 4 + (int.from_bytes(view[:4], "big") & 0xFFFFFF)
    if size > len(view):
        raise ValueError(f"reply of {size} bytes is larger than the client's buffer")
    while got < size:
        n = sock.recv_into(view[got:size])
        if not n:
            raise ConnectionError("the daemon closed the connection mid-reply")
        got += n
    return size


def _client(address: bytes, version: int, start: float, end: float, pace: float, silent: bool, out: Any) -> None:
    latencies = array("d")
    sizes: set[int] = set()
    errors: list[str] = []
    count = exited = 0
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    request = (b"T" if silent else b"S") + bytes([version])
    interval = 1.0 if silent else pace
    clock = time.perf_counter
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.connect(address)
        time.sleep(max(0.0, start - time.time()))
        # perf_counter is cheaper than time.time() and monotonic; map the end onto it
        stop = clock() + (end - time.time())
        due = clock()
        while True:
            begin = clock()
            if begin >= stop:
                break
            if interval:
                if begin < due:
                    time.sleep(min(due - begin, stop - begin))
                    continue
                due += interval
            sock.send(request)
            size = _read_reply(sock, view)
            if silent:
                continue
            latencies.append(clock() - begin)
            sizes.add(size)
            count += 1
            exited += buffer.count(b"#E", 4, size)
        sock.close()
    except (OSError, ValueError) as error:
        errors.append(f"{type(error).__name__}: {error}")
    out.send((count, latencies.tobytes(), sorted(sizes), errors, exited))
    out.close()


def run_load(
    address: bytes,
    clients: int,
    seconds: float,
    version: int = 2,
    pace: float = 0.0,
    silent: int = 0,
) -> LoadResult:
    """Run `clients` clients (the last `silent` of them never send ``S``) for `seconds`."""
    context = multiprocessing.get_context("fork")
    start = time.time() + CONNECT_GRACE
    end = start + seconds
    workers = []
    for number in range(clients):
        receive, send = context.Pipe(duplex=False)
        is_silent = number >= clients - silent
        worker = context.Process(
            target=_client, args=(address, version, start, end, pace, is_silent, send), daemon=True
        )
        worker.start()
        send.close()
        workers.append((worker, receive))
    result = LoadResult(seconds)
    for worker, receive in workers:
        try:
            count, raw, sizes, errors, exited = receive.recv()
        except EOFError:
            count, raw, sizes, errors, exited = 0, b"", [], [f"client {worker.pid} died"], 0
        worker.join()
        result.requests += count
        result.exited += exited
        samples = array("d")
        samples.frombytes(raw)
        result.latencies.extend(samples)
        result.reply_sizes.update(sizes)
        result.errors.extend(errors)
    return result

