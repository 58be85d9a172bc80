#!/usr/bin/env python3
"""Our daemon's /metrics beside nvitop-exporter's, on the same simulated host: CPU per second and peak RSS.

    .venv/bin/python bench/exporter.py --exporter PATH [--gpus 2] [--processes 3] [--seconds 60]
                                       [--scrape 15] [--rounds 3] [--before DIR]

``--exporter`` is an installed ``nvitop-exporter`` (``pip install nvitop-exporter`` in a venv of its
own); it runs on nvidia-ml-py's real ``pynvml`` over the simulated libnvidia-ml, as the reference
does in bench/perf.py (``atopgpud_tw/sim/shim`` first on PYTHONPATH).  Ours runs as ``atopgpud
--reader sim --metrics``, on bench/perf.py's steady host (every process runs throughout).  Each
round starts each exporter fresh and alone (in turn, the order swapped every round), fetches
``/metrics`` every ``--scrape`` seconds for ``--seconds``, and reads from /proc the CPU seconds it
used (utime + stime) and its peak RSS (VmHWM).  Prints the medians and the ratios ours/nvitop-exporter.
The source trees are byte-compiled first, as an install is, and ours runs without bench/simtime.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons import REPO, SHIM, BenchError, Ours, proc_figures, workdir  # noqa: E402
from perf import host  # noqa: E402
from resources import free_port  # noqa: E402


def scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return reply.status == 200 and bool(reply.read())
    except OSError:
        return False


def nvitop(exporter: str, scenario: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO)]), ATOPGPUD_SCENARIO=str(scenario))
    with open(log, "wb") as out:
        return subprocess.Popen([exporter, "--bind-address", "127.0.0.1", "--port", str(port), "--interval", "1"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def run(pid: int, port: int, args: argparse.Namespace) -> dict[str, float]:
    """CPU seconds per second and peak RSS of `pid` over `--seconds`, scraped every `--scrape`."""
    deadline = time.monotonic() + 60
    while not scrape(port):
        if time.monotonic() > deadline:
            raise BenchError(f"no /metrics on port {port}")
        time.sleep(0.2)
    start, cpu0 = time.monotonic(), proc_figures(pid)["cpu"]
    while time.monotonic() - start < args.seconds:
        if not scrape(port):
            raise BenchError(f"a scrape of port {port} failed")
        time.sleep(max(0.0, min(args.scrape, args.seconds - (time.monotonic() - start))))
    end = proc_figures(pid)
    return {"cpu_per_s": (end["cpu"] - cpu0) / (time.monotonic() - start), "peak_rss_kib": end["VmHWM"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exporter", required=True, help="the nvitop-exporter command")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scrape", type=float, default=15, help="seconds between scrapes (Prometheus's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="also run our daemon from this copy of the source tree")
    args = parser.parse_args()
    folder = workdir()
    scenario = folder / "scenario.json"
    scenario.write_text(json.dumps(host(args.gpus, args.processes)))
    # as an install does (pip, dpkg): else, where PYTHONDONTWRITEBYTECODE is set, every start of ours (and
    # nvitop-exporter's simulator) compiles the checkout from source, which its peak RSS keeps (0.5 MB)
    for tree in filter(None, [REPO, args.before]):
        compileall.compile_dir(Path(tree, "atopgpud_tw"), quiet=1)
    names = ["ours", "before", "nvitop-exporter"] if args.before else ["ours", "nvitop-exporter"]
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            port = free_port()
            if name == "nvitop-exporter":
                proc = nvitop(args.exporter, scenario, port, folder / f"nvitop-{round_}.log")
                try:
                    figures[name].append(run(proc.pid, port, args))
                finally:
                    proc.terminate()
                    proc.wait(10)
            else:
                daemon = Ours(scenario, folder, source=args.before if name == "before" else None,
                              options=("--metrics", f"tcp:{port}:interface=127.0.0.1"), label=name)
                daemon.timed = False  # as nvitop-exporter: no wrapper around the simulated library's calls
                daemon.start()
                try:
                    figures[name].append(run(daemon.pid, port, args))
                finally:
                    daemon.stop()
            print(f"round {round_ + 1} {name}: {figures[name][-1]}", file=sys.stderr)
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in figures.items()}
    reference = medians["nvitop-exporter"]
    print(f"{args.gpus} GPUs x {args.processes} processes, {args.seconds:.0f} s, a scrape every {args.scrape:g} s, "
          f"medians of {args.rounds} rounds")
    print("| daemon | CPU s/s | peak RSS KiB | CPU / nvitop-exporter | RSS / nvitop-exporter |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, row in medians.items():
        cpu, rss = row["cpu_per_s"], row["peak_rss_kib"]
        print(f"| {name} | {cpu:.4f} | {rss:.0f} | {cpu / reference['cpu_per_s']:.2f} | "
              f"{rss / reference['peak_rss_kib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
