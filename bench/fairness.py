#!/usr/bin/env python3
"""No request stalls another: a probe client's latency while others flood or ask at once.

    .venv/bin/python bench/fairness.py [--seconds 10] [--wait 45] [--case flood-v1 exits-250] [--ours-path DIR]

``flood-v1``: a host of 8 GPUs x 80 processes (640), 48 client processes each
sending version 1 ``S`` in a loop as fast as the daemon answers (bench/loadgen.py),
and a probe that asks version 2 ``S`` every 50 ms, and version 1 every 50 ms on a
second connection, measuring each reply from send to last byte.

``exits-250``: a host where 200 processes start and 200 end every second; 250
connections (in this process) ask ``S`` once, wait ``--wait`` seconds while the
exits pile up in their queues, then all send ``S`` at once; the probe asks right
after them.  Reported: the probe's latency and the time until the last of the
250 replies was read (atop gives up after 2 s).

``--ours-path DIR`` runs the daemon from another source tree (an older commit,
``git archive``d), to compare.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import Ours, workdir  # noqa: E402
from loadgen import CONNECT_GRACE, _read_reply, run_load  # noqa: E402
from perf import churn, host  # noqa: E402


def probe(address: bytes, version: int, until: float, pace: float = 0.05) -> list[float]:
    """Latencies of `version` S requests sent every `pace` seconds until `until` (time.time)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(address)
    view = memoryview(bytearray(1 << 16))
    request = b"S" + bytes([version])
    out = []
    while time.time() < until:
        begin = time.perf_counter()
        sock.send(request)
        _read_reply(sock, view)
        out.append(time.perf_counter() - begin)
        time.sleep(pace)
    sock.close()
    return out


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "count": len(ordered),
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
    }


def flood_v1(folder: Path, seconds: float, source: str | None) -> dict:
    scenario = folder / "flood.json"
    scenario.write_text(json.dumps(host(8, 80)))
    daemon = Ours(scenario, folder, source)
    daemon.start()
    try:
        until = time.time() + CONNECT_GRACE + seconds
        probes: dict[int, list[float]] = {}
        threads = [
            threading.Thread(target=lambda v=v: probes.__setitem__(v, probe(daemon.address, v, until)))
            for v in (1, 2)
        ]
        for thread in threads:
            thread.start()
        load = run_load(daemon.address, 48, seconds, version=1)
        for thread in threads:
            thread.join()
    finally:
        daemon.stop()
    return {
        "flooders_requests_per_s": round(load.rate),
        "flooders_max_ms": round(1000 * max(load.latencies), 1),
        "flooder_errors": load.errors[:3],
        "probe_v1": summary(probes[1]),
        "probe_v2": summary(probes[2]),
    }


def exits_250(folder: Path, wait: float, source: str | None) -> dict:
    scenario = folder / "exits.json"
    scenario.write_text(json.dumps(churn(8, 200)))
    daemon = Ours(scenario, folder, source)
    daemon.start()
    socks = []
    try:
        view = memoryview(bytearray(1 << 16))
        for _ in range(250):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10.0)
            sock.connect(daemon.address)
            sock.send(b"S\x02")
            _read_reply(sock, view)
            socks.append(sock)
        time.sleep(wait)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.settimeout(10.0)
        other.connect(daemon.address)
        other.send(b"T\x02")
        _read_reply(other, view)
        begin = time.perf_counter()
        for sock in socks:
            sock.send(b"S\x02")
        sent = time.perf_counter()
        other.send(b"S\x02")
        _read_reply(other, view)
        probe_latency = time.perf_counter() - sent
        last = 0.0
        exited = 0
        for sock in socks:
            size = _read_reply(sock, view)
            exited += bytes(view[:size]).count(b"#E")
            last = time.perf_counter() - begin
        other.close()
    finally:
        for sock in socks:
            sock.close()
        daemon.stop()
    return {
        "probe_ms": round(1000 * probe_latency, 1),
        "last_of_250_ms": round(1000 * last, 1),
        "exits_per_reply": round(exited / 250),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--wait", type=float, default=45.0)
    parser.add_argument("--ours-path", default=None)
    parser.add_argument("--case", nargs="*", default=["flood-v1", "exits-250"])
    args = parser.parse_args()
    folder = workdir()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {}
    if "flood-v1" in args.case:
        results["flood-v1"] = flood_v1(folder, args.seconds, args.ours_path)
    if "exits-250" in args.case:
        results["exits-250"] = exits_250(folder, args.wait, args.ours_path)
    print(f"# {started}")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
