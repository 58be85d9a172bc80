#!/usr/bin/env python3
"""Attack the installed daemon's --metrics endpoint and time atop's replies meanwhile.

    python bench/metrics_attack.py [--seconds 20] [--processes 640] [--nice 10] [--attacks pipeline,...]

Starts ``atopgpud --reader sim --metrics tcp:PORT --metrics-processes`` (8 GPUs,
`--processes` GPU processes in all, so the page is a few hundred KB) and runs each
attack alone for the given time, from a separate process, while an atop-like
client asks ``S`` every 50 ms on its connection and ``T`` on a fresh connection
every 0.5 s, timing each reply:

- pipeline: one connection sends 200,000 pipelined ``GET /metrics`` and never reads;
- chunked:  one ``POST`` with an endless chunked body, sent as fast as it goes;
- slowloris: 300 connections each sending a header byte a second;
- scrapes:  500 concurrent scrapes of the page, again and again.

For each it prints the atop reply times (max, 99th percentile, count over 100 ms),
the daemon's peak RSS and descriptors, and whether the daemon's log stayed short.
The attackers run at `--nice` 10 by default: on a
small machine they would otherwise take the daemon's CPU, which an attacker on
the network does not.  Only loopback is used; every loop ends with its phase.  Exit status 1 if an atop
reply took 100 ms or more, or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon import Daemon, free_port  # noqa: E402
from soak import fds, rss_kib  # noqa: E402

GET = b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n"


def scenario(processes: int) -> dict:
    per_gpu = processes // 8
    gpus = []
    for g in range(8):
        procs = [{"pid": 10000 + 1000 * g + p, "memory_mib": 100 + p, "sm_util": [5, 50], "mem_util": 3}
                 for p in range(per_gpu)]
        gpus.append({"busid": f"00000000:{0x20 + g:02X}:00.0", "gpu_util": [10, 90], "processes": procs})
    return {"gpus": gpus}


async def _pipeline(port: int, until: float) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    while sent < 200_000 and time.time() < until:
        writer.write(GET * 1000)
        sent += 1000
        try:
            await asyncio.wait_for(writer.drain(), max(0.1, until - time.time()))
        except (asyncio.TimeoutError, OSError):
            break
    await asyncio.sleep(max(0.0, until - time.time()))
    writer.transport.abort()


async def _chunked(port: int, until: float) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /metrics HTTP/1.1\r\nHost: bench\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    try:
        while time.time() < until:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), max(0.1, until - time.time()))
    except (asyncio.TimeoutError, OSError):
        pass
    writer.transport.abort()


async def _slow_client(port: int, until: float) -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: bench\r\nX-Slow: " + b"a" * 4000
    while time.time() < until:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for byte in head:
                if time.time() >= until:
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
            writer.transport.abort()
        except OSError:
            await asyncio.sleep(0.5)


async def _scrape(port: int, until: float) -> None:
    while time.time() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n")
            await asyncio.wait_for(reader.read(-1), max(0.1, until - time.time()))
            writer.close()
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.01)


def attack(kind: str, port: int, until: float, nice: int) -> None:
    os.nice(nice)  # an attacker elsewhere on the network does not take this host's CPU

    async def main() -> None:
        if kind == "pipeline":
            await _pipeline(port, until)
        elif kind == "chunked":
            await _chunked(port, until)
        elif kind == "slowloris":
            await asyncio.gather(*(_slow_client(port, until) for _ in range(300)))
        else:
            await asyncio.gather(*(_scrape(port, until) for _ in range(500)))

    try:
        asyncio.run(main())
    except Exception:  # noqa: BLE001 - the attacker may fail; the daemon is what is measured
        pass


def probe(daemon: Daemon, until: float) -> tuple[list[float], int]:
    """atop's view: S every 50 ms on one connection, T on a fresh one every 0.5 s."""
    times: list[float] = []
    failures = 0
    client = daemon.client()
    next_fresh = time.monotonic()
    while time.time() < until:
        try:
            start = time.monotonic()
            client.stats()
            times.append(time.monotonic() - start)
            if start >= next_fresh:
                next_fresh = start + 0.5
                start = time.monotonic()
                fresh = daemon.client()
                try:
                    fresh.ask("T")
                finally:
                    fresh.close()
                times.append(time.monotonic() - start)
        except OSError:
            failures += 1
            client.close()
            client = daemon.client()
        time.sleep(0.05)
    client.close()
    return times, failures


def watch(pid: int, until: float, peaks: dict[str, int]) -> None:
    """The daemon's peak RSS and descriptors until `until`, sampled every 0.2 s."""
    while time.time() < until:
        peaks["rss"] = max(peaks["rss"], rss_kib(pid))
        peaks["fds"] = max(peaks["fds"], fds(pid))
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--processes", type=int, default=640)
    parser.add_argument("--nice", type=int, default=10, help="the attackers' niceness (0: as the daemon)")
    parser.add_argument("--attacks", default="pipeline,chunked,slowloris,scrapes",
                        help="which to run, comma-separated")
    args = parser.parse_args()
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="metrics-attack-"))
    daemon = Daemon(tmp, ["--interval", "1", "--metrics", f"tcp:{port}:interface=127.0.0.1",
                          "--metrics-processes"], scenario=scenario(args.processes)).start()
    ok = True
    try:
        daemon.wait_samples(2)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            page = b"".join(iter(lambda: s.recv(1 << 16), b""))
        print(f"page                {len(page)} bytes, {args.processes} processes on 8 GPUs")
        assert daemon.proc is not None
        pid = daemon.proc.pid
        for kind in args.attacks.split(","):
            log_before = len(daemon.log().splitlines())
            until = time.time() + args.seconds
            attacker = multiprocessing.Process(target=attack, args=(kind, port, until, args.nice))
            attacker.start()
            peaks = {"rss": 0, "fds": 0}
            sampler = threading.Thread(target=watch, args=(pid, until, peaks))
            sampler.start()
            times, failures = probe(daemon, until)
            sampler.join()
            attacker.join(30)
            if attacker.is_alive():
                attacker.kill()
            times.sort()
            slow = sum(t >= 0.1 for t in times)
            p99 = times[int(len(times) * 0.99)] if times else float("nan")
            worst = times[-1] if times else float("nan")
            lines = len(daemon.log().splitlines()) - log_before
            ok = ok and not slow and not failures
            print(f"{kind:<19} atop replies {len(times)}: max {worst * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
                  f">=100 ms {slow}, failed {failures}; daemon peak RSS {peaks['rss']} KiB, fds {peaks['fds']}; "
                  f"log lines {lines}")
        print(f"daemon RSS now      {rss_kib(pid)} KiB, fds {fds(pid)}; /tmp files held open: "
              f"{sum('(deleted)' in os.readlink(f'/proc/{pid}/fd/{fd}') for fd in os.listdir(f'/proc/{pid}/fd'))}")
        print(f"daemon log          {daemon.log_path}")
    finally:
        daemon.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
