#!/usr/bin/env python3
"""What the daemon holds and spends on a big host, scraped: the figures a pod's requests and limits rest on.

    .venv/bin/python bench/resources.py [--seconds 60] [--gpus 8] [--processes 255] [--clients 4]
                                        [--scrape 1] [--churn] [--per-process]

Starts ``atopgpud --reader sim`` on a simulated host (bench/perf.py's steady
host: every process runs throughout; ``--churn``: 100 processes start and 100
end every second on the GPUs instead) with the options of the Kubernetes
DaemonSet (``--metrics`` and ``--workloads pod``; ``--per-process`` adds
``--metrics-processes --metrics-process-context``, a series per process), then
for ``--seconds``: fetches ``/metrics`` every ``--scrape`` seconds (Prometheus's
default is every 15 s) and has ``--clients`` clients ask ``S`` every second, as
atop does at its shortest interval.  Every second it reads the daemon's CPU seconds (utime +
stime) and RSS from /proc.  Prints the peak RSS (VmHWM), the RSS at the end,
the CPU the daemon used (cores: the mean over the run and the highest over
any 10 s), the simulated library's share of it (what a real driver's C code
replaces), and the page's size.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import BenchError, Ours, ask, workdir  # noqa: E402
from perf import churn, host  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(args: argparse.Namespace) -> dict[str, float]:
    folder = workdir()
    scenario = folder / "scenario.json"
    scenario.write_text(json.dumps(churn(args.gpus) if args.churn else host(args.gpus, args.processes)))
    port = free_port()
    options = ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--workloads", "pod"]
    if args.per_process:
        options += ["--metrics-processes", "--metrics-process-context"]
    daemon = Ours(scenario, folder, options=tuple(options))
    daemon.start()
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(args.clients)]
    try:
        for client in clients:
            client.settimeout(5)
            client.connect(daemon.address)
        start = time.monotonic()
        cpu = [(start, daemon.figures()["cpu"])]
        simulated0 = daemon.simulator_time()[0]
        page = 0
        next_scrape = start
        while time.monotonic() - start < args.seconds:
            now = time.monotonic()
            if now >= next_scrape:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                    page = len(response.read())
                next_scrape += args.scrape
            for client in clients:
                ask(daemon.address, b"S\x02", sock=client)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
            cpu.append((time.monotonic(), daemon.figures()["cpu"]))
        figures = daemon.figures()
        simulated = daemon.simulator_time()[0] - simulated0
    finally:
        for client in clients:
            client.close()
        daemon.stop()
    elapsed = cpu[-1][0] - cpu[0][0]
    windows = [(c1 - c0) / (t1 - t0) for (t0, c0), (t1, c1) in zip(cpu, cpu[10:])]
    return {
        "seconds": round(elapsed, 1),
        "peak_rss_kib": figures["VmHWM"],
        "rss_kib": figures["VmRSS"],
        "cpu_cores_mean": round((cpu[-1][1] - cpu[0][1]) / elapsed, 4),
        "cpu_cores_max_10s": round(max(windows, default=0.0), 4),
        "simulated_library_cores": round(simulated / elapsed, 4),
        "metrics_page_bytes": page,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=255)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--scrape", type=float, default=1.0)
    parser.add_argument("--churn", action="store_true", help="100 processes start and 100 end every second")
    parser.add_argument("--per-process", action="store_true",
                        help="--metrics-processes --metrics-process-context too")
    args = parser.parse_args()
    try:
        figures = measure(args)
    except BenchError as error:
        print(f"resources.py: {error}", file=sys.stderr)
        return 1
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}: {' '.join(sys.argv[1:]) or '(defaults)'}")
    for key, value in figures.items():
        print(f"{key:<26}{value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
