#!/usr/bin/env python3
"""Abuse the installed daemon and show that it stays small and correct.

    python bench/soak.py [--seconds 60] [--workers 4]

Starts ``atopgpud --reader sim`` on a unique abstract socket (8 GPUs x 40
processes, processes starting and ending all the time), then for the given time:
worker processes open and drop thousands of connections, send random bytes,
half requests, floods of requests they never read, and idle connections; one
well-behaved client asks T and S every 0.2 s and checks every reply (framing,
version, 8 GPUs, counters monotonic).  Every second the daemon's RSS and open
file descriptors are sampled.  Only this machine's loopback is used; every loop
is bounded in time.  Prints a summary; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from atopgpud_tw import codec


def scenario() -> dict:
    gpus = []
    for g in range(8):
        procs = [
            {"pid": 10000 + 100 * g + p, "memory_mib": 100 + p, "sm_util": [5, 50, 95], "mem_util": 3,
             "start": (p % 7) * 0.5, "stop": None if p % 2 else (p % 7) * 0.5 + 2 + (p % 5)}
            for p in range(40)
        ]
        gpus.append({"busid": f"00000000:{0x20 + g:02X}:00.0", "gpu_util": [10, 90], "processes": procs})
    return {"repeat": 8, "gpus": gpus}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def abuse(address: bytes, until: float, seed: int, counts: multiprocessing.Queue[dict]) -> None:
    rng = random.Random(seed)
    done = {"connections": 0, "garbage": 0, "half": 0, "floods": 0, "idle": 0, "refused": 0}
    idle: list[socket.socket] = []
    while time.time() < until:
        kind = rng.choice(("drop", "garbage", "half", "flood", "idle"))
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        try:
            s.connect(address)
        except OSError:
            done["refused"] += 1
            s.close()
            continue
        done["connections"] += 1
        try:
            if kind == "garbage":
                s.sendall(os.urandom(rng.randint(1, 64)))
                done["garbage"] += 1
            elif kind == "half":
                s.sendall(rng.choice((b"S", b"T")))
                done["half"] += 1
            elif kind == "flood":
                s.sendall(b"S\x02" * rng.randint(100, 3000))  # and never read
                done["floods"] += 1
            elif kind == "idle" and len(idle) < 200:
                idle.append(s)
                done["idle"] += 1
                continue
        except OSError:
            pass
        s.close()
    for s in idle:
        s.close()
    counts.put(done)


def check_client(address: bytes, until: float) -> dict:
    result = {"requests": 0, "errors": [], "max_reply": 0}
    previous: list[codec.DeviceStats] | None = None
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)  # atop's limit
    s.connect(address)

    def read(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = s.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    while time.time() < until:
        try:
            for command in ("T", "S"):
                s.sendall(codec.encode_request(command, 2))
                version, length = codec.parse_prelude(read(4))
                body = read(length)
                result["requests"] += 1
                result["max_reply"] = max(result["max_reply"], 4 + length)
                if version != 2 or 4 + length > codec.ATOP_REPLY_LIMIT:
                    result["errors"].append(f"bad reply: version {version}, {length} bytes")
                if command == "T" and len(codec.parse_types(body)) != 8:
                    result["errors"].append("T does not list 8 GPUs")
                if command == "S":
                    stats = codec.parse_stats(body, 2)
                    if previous is not None:
                        for a, b in zip(previous, stats):
                            if b.samples < a.samples or b.gpu_busy_cum < a.gpu_busy_cum:
                                result["errors"].append("a counter went backwards")
                    previous = stats
        except (OSError, codec.ProtocolError) as error:
            result["errors"].append(f"{type(error).__name__}: {error}")
            break
        time.sleep(0.2)
    s.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    name = f"atopgpud-soak-{uuid.uuid4().hex[:8]}"
    address = b"\0" + name.encode()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "scenario.json").write_text(json.dumps(scenario()))
    twistd = Path(sys.executable).with_name("twistd")
    daemon = subprocess.Popen(
        [str(twistd), "-n", "--pidfile=", "atopgpud", "--reader", "sim", "--scenario", str(tmp / "scenario.json"),
         "--listen", f"unix:@{name}", "--interval", "0.2", "--max-unsent", "65536"],
        stdout=open(tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(200):
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited: {(tmp / 'daemon.log').read_text()}")
            try:
                socket.socket(socket.AF_UNIX).connect(address)
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(1)
        start_rss, start_fds = rss_kib(daemon.pid), fds(daemon.pid)
        until = time.time() + args.seconds
        counts: multiprocessing.Queue[dict] = multiprocessing.Queue()
        workers = [
            multiprocessing.Process(target=abuse, args=(address, until, seed, counts)) for seed in range(args.workers)
        ]
        pool = multiprocessing.Pool(1)
        checked = pool.apply_async(check_client, (address, until))
        time.sleep(0.5)  # connected before the flood, as atop keeps its connection
        for worker in workers:
            worker.start()
        samples = []
        while time.time() < until:
            samples.append((time.time(), rss_kib(daemon.pid), fds(daemon.pid)))
            time.sleep(1)
        totals: dict[str, int] = {}
        for worker in workers:
            worker.join()
            for key, value in counts.get().items():
                totals[key] = totals.get(key, 0) + value
        result = checked.get()
        pool.close()
        time.sleep(2)
        end_rss, end_fds = rss_kib(daemon.pid), fds(daemon.pid)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
    half = len(samples) // 2
    second_half = [r for _, r, _ in samples[half:]] or [0]
    print(f"duration            {args.seconds:.0f} s, {args.workers} abusive workers + 1 checking client")
    print("abuse               " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    print(f"checked requests    {result['requests']} (max reply {result['max_reply']} bytes)")
    print(f"check errors        {len(result['errors'])} {result['errors'][:3]}")
    print(f"daemon RSS (KiB)    start {start_rss}, peak {max(r for _, r, _ in samples)}, "
          f"second half {min(second_half)}..{max(second_half)}, end {end_rss}")
    print(f"daemon open fds     start {start_fds}, peak {max(f for _, _, f in samples)}, end {end_fds}")
    print(f"daemon log          {tmp / 'daemon.log'}")
    return 1 if result["errors"] or result["requests"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
