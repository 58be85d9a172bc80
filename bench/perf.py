#!/usr/bin/env python3
"""Requests/s, latency, CPU per poll and peak RSS of our daemon, beside the reference's.

    .venv/bin/python bench/perf.py [--reference PATH] [--case NAME ...] [--rounds 3] [--seconds 10]
    .venv/bin/python bench/perf.py --memory-run 600

For every case (a simulated host and a number of clients) each round starts a
fresh daemon on the simulator (the real nvidia-ml-py over the simulated
libnvidia-ml, for both daemons), measures its CPU seconds per poll while no
client asks anything (``--idle`` seconds), then runs the clients (one process
and one persistent connection each, ``S`` in a loop) for ``--seconds`` and reads
the daemon's peak RSS (VmHWM).  CPU per poll is split into the simulated
library's C functions (timed inside each daemon by bench/simtime, what a real
driver would replace), the reactor floor (bench/floor.py, a bare LoopingCall
with a thread hand-off, measured over the same window; ours only) and the rest,
the daemon's own work.  With ``--reference`` the reference daemon runs
the same case in the same round, never at the same time as ours, the order
alternating from round to round; the report gives medians over the rounds and
the ratios, checked against the targets of docs/PERFORMANCE.md.

``--reference PATH`` is atop's own ``atopgpud``: the Python script of that name
at the top of atop's source tree (https://github.com/Atoptool/atop, atop 2.13 or
later: the version that listens on the abstract socket ``@atopgpud_nvidia``;
atop's ``make install`` copies it to /usr/sbin/atopgpud).  Debian 12's atop
package (2.8.1) does not ship it (``dpkg -L atop | grep -i gpu`` lists nothing).

Our daemon runs as the ``atopgpud`` command, which the shipped unit runs
(``--twistd``: as ``twistd -n atopgpud``, which imports all of twistd's graph
before the plugin is found).  ``--before DIR`` also runs our daemon from another
copy of the source tree in the same rounds (each daemon first in turn), for a
before-and-after comparison in one run.

``--memory-run SECONDS`` instead runs our daemon for that long on a host where
100 processes start and 100 end every second, with 32 clients (one of which
never sends ``S``), and samples its RSS every second.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spy  # noqa: E402
from daemons import BenchError, Daemon, Floor, Ours, Reference, idle_cpu_per_poll, reference_script, workdir  # noqa: E402
from loadgen import CONNECT_GRACE, run_load  # noqa: E402


def host(gpus: int, processes: int, delay_ms: float = 0.0) -> dict[str, Any]:
    """A simulated host whose processes all run from the start and never end."""
    cards = []
    for g in range(gpus):
        procs = [
            {"pid": 20000 + 1000 * g + p, "type": "G" if p % 10 == 9 else "C",
             "memory_mib": [512 + 37 * p, 520 + 37 * p], "sm_util": [(7 * p) % 100, (11 * p) % 100],
             "mem_util": (3 * p) % 50}
            for p in range(processes)
        ]
        cards.append({
            "name": "NVIDIA H100 80GB HBM3", "busid": f"00000000:{0x18 + g:02X}:00.0",
            "memory_total_mib": 81559, "memory_used_mib": [30000, 31000],
            "gpu_util": [40, 60, 80], "mem_util": [10, 20], "processes": procs,
        })
    return {"call_delay_ms": delay_ms, "gpus": cards}


def mig_host(cards: int = 8, instances: int = 7, processes: int = 4) -> dict[str, Any]:
    """`cards` A100s in MIG mode, `instances` 1g.10gb instances each, `processes` on every instance."""
    gpus = []
    for c in range(cards):
        mig = [
            {"profile": "1g.10gb", "memory_total_mib": 9856, "memory_used_mib": [2000, 2100],
             "processes": [
                 {"pid": 30000 + 1000 * c + 100 * i + p, "memory_mib": 300 + 17 * p, "sm_util": [(9 * p) % 100, 50]}
                 for p in range(processes)
             ]}
            for i in range(instances)
        ]
        gpus.append({"name": "NVIDIA A100-SXM4-80GB", "busid": f"00000000:{0x18 + c:02X}:00.0",
                     "memory_total_mib": 81920, "gpu_util": [30, 70], "mig": mig})
    return {"gpus": gpus}


def churn(gpus: int = 8, per_second: int = 100, lifetime: float = 2.0, repeat: float = 30.0) -> dict[str, Any]:
    """A host where `per_second` processes start and as many end every second.

    Each process lives `lifetime` seconds once per `repeat` seconds (those that
    start in the cycle's last `lifetime` seconds end at its wrap, sooner); its pid
    comes back in the next cycle, so the daemon sees ``per_second * repeat``
    distinct pids.
    """
    per_gpu = int(per_second * repeat / gpus)
    span = repeat
    cards = []
    for g in range(gpus):
        procs = [
            {"pid": 100000 + 10000 * g + p, "memory_mib": 100 + p % 900, "sm_util": [5, 50, 95],
             "mem_util": 3, "start": span * p / per_gpu, "stop": span * p / per_gpu + lifetime}
            for p in range(per_gpu)
        ]
        cards.append({"busid": f"00000000:{0x18 + g:02X}:00.0", "gpu_util": [10, 90], "processes": procs})
    return {"repeat": repeat, "gpus": cards}


#: name: (what, scenario, clients[, options of our daemon])
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "tiny-1": ("2 GPUs x 3 processes, 1 client", host(2, 3), 1),
    "small-1": ("2 GPUs x 20 processes, 1 client", host(2, 20), 1),
    "small-32": ("2 GPUs x 20 processes, 32 clients", host(2, 20), 32),
    "large-32": ("8 GPUs x 30 processes, 32 clients", host(8, 30), 32),
    "slow-4": ("8 GPUs x 20 processes, NVML calls 5 ms, 4 clients", host(8, 20, 5.0), 4),
    "churn-32": ("8 GPUs, 100 process starts and exits per second, 32 clients", churn(), 32),
    "huge-32": ("8 GPUs x 255 processes, 32 clients", host(8, 255), 32),
    "mig-32": ("8 cards x 7 MIG instances (56 devices) x 4 processes, 32 clients", mig_host(), 32),
}


def one_run(daemon: Daemon, clients: int, seconds: float, idle: float, profile_to: Path | None = None) -> dict:
    """Start a daemon, measure it idle (beside the reactor floor), then under load (sampled by
    py-spy into `profile_to`), stop it."""
    floor = Floor(daemon.workdir) if isinstance(daemon, Ours) else None
    daemon.start()
    try:
        if floor is not None:
            floor.start()
        try:
            idle_figures = idle_cpu_per_poll(daemon, idle, floor)
        finally:
            if floor is not None:
                floor.stop()
        after = daemon.figures()
        sampler = spy.start(daemon.pid, seconds + CONNECT_GRACE, profile_to) if profile_to else None
        load = run_load(daemon.address, clients, seconds)
        end = daemon.figures()
        if sampler is not None:
            sampler.wait()
    finally:
        daemon.stop()
    if profile_to is not None:
        print("\n".join(spy.summary(profile_to)), file=sys.stderr)
    if load.errors:
        raise BenchError(f"{daemon.label}: client errors: {load.errors[:3]}\n{daemon.log_tail()}")
    # what a real driver would not cost: the simulated library's C functions
    poll = idle_figures["cpu"] - idle_figures["sim"]
    # the reference has no reactor: one thread sleeps between polls
    reactor_floor = idle_figures["floor"] if floor is not None else 0.0
    return {
        "rate": load.rate,
        "p50_ms": 1000 * load.percentile(0.50),
        "p99_ms": 1000 * load.percentile(0.99),
        "max_ms": 1000 * max(load.latencies, default=float("nan")),
        "reply_bytes": max(load.reply_sizes, default=0),
        "cpu_per_poll_ms": 1000 * idle_figures["cpu"],
        "sim_per_poll_ms": 1000 * idle_figures["sim"],
        "sim_calls_per_poll": idle_figures["sim_calls"],
        "poll_ms": 1000 * poll,
        "floor_ms": 1000 * reactor_floor,
        "own_ms": 1000 * (poll - reactor_floor),
        "cpu_under_load": (end["cpu"] - after["cpu"]) / seconds,
        "rss_peak_kib": end["VmHWM"],
    }


#: (metric, label, format, better-when ("high" or "low"))
METRICS = (
    ("rate", "requests/s", "{:.0f}", "high"),
    ("p50_ms", "latency p50 ms", "{:.2f}", "low"),
    ("p99_ms", "latency p99 ms", "{:.2f}", "low"),
    ("max_ms", "latency max ms", "{:.1f}", "low"),
    ("reply_bytes", "reply bytes", "{:.0f}", "low"),
    ("cpu_per_poll_ms", "CPU ms/poll, all (idle)", "{:.3f}", "low"),
    ("sim_per_poll_ms", " of it, simulated lib", "{:.3f}", "low"),
    ("sim_calls_per_poll", " C calls per poll", "{:.0f}", "low"),
    ("poll_ms", "CPU ms/poll, no sim", "{:.3f}", "low"),
    ("floor_ms", " of it, reactor floor", "{:.3f}", "low"),
    ("own_ms", " of it, own work", "{:.3f}", "low"),
    ("cpu_under_load", "CPU s/s under load", "{:.2f}", "low"),
    ("rss_peak_kib", "peak RSS KiB", "{:.0f}", "low"),
)

def _against(key: str, factor: float, better: str) -> Callable[[dict, dict | None], bool | None]:
    """A target relative to the reference: ours at least (high) or at most (low) factor x theirs."""

    def check(ours: dict, ref: dict | None) -> bool | None:
        if ref is None:
            return None
        return ours[key] >= factor * ref[key] if better == "high" else ours[key] <= factor * ref[key]

    return check


def _own_work(factor: float) -> Callable[[dict, dict | None], bool | None]:
    """Our own work per poll (no simulator, no reactor floor) at most factor x the reference's whole poll
    (no simulator)."""
    return lambda ours, ref: None if ref is None else ours["own_ms"] <= factor * ref["poll_ms"]


#: case: [(description, check over (ours, reference or None))]: docs/PERFORMANCE.md's kept targets
#: (peak RSS and CPU per second are held against nvitop-exporter's: bench/exporter.py)
TARGETS: dict[str, list[tuple[str, Callable[[dict, dict | None], bool | None]]]] = {
    "tiny-1": [("own work per poll <= 3x reference's poll", _own_work(3.0))],
    "large-32": [("requests/s >= 5x reference", _against("rate", 5.0, "high"))],
    "slow-4": [
        ("latency max < 20 ms", lambda o, r: o["max_ms"] < 20),
        ("latency p99 < 5 ms", lambda o, r: o["p99_ms"] < 5),
    ],
    "huge-32": [
        ("own work per poll <= 0.6x reference's poll", _own_work(0.6)),
        ("every reply within 8192 bytes", lambda o, r: o["reply_bytes"] <= 8192),
    ],
    "mig-32": [("every reply within 8192 bytes", lambda o, r: o["reply_bytes"] <= 8192)],
}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def report(case: str, ours: list[dict], ref: list[dict], before: list[dict] | None = None) -> list[str]:
    """The table of one case (with a column for `before`, our daemon from --before, if run),
    and its target lines."""
    what, _, _ = CASES[case]
    mo, mr = medians(ours), medians(ref) if ref else None
    mb = medians(before) if before else None
    lines = [f"== {case}: {what} (median of {len(ours)} rounds; {time.strftime('%H:%M %Z')})"]
    head = f"{'metric':<24}{'ours':>12}{'reference':>12}{'ours/ref':>10}"
    lines.append(head + (f"{'before':>12}{'before/ref':>12}" if mb else ""))
    for key, label, fmt, _ in METRICS:
        theirs = fmt.format(mr[key]) if mr else "-"
        ratio = f"{mo[key] / mr[key]:.2f}" if mr and mr[key] else "-"
        line = f"{label:<24}{fmt.format(mo[key]):>12}{theirs:>12}{ratio:>10}"
        if mb:
            line += f"{fmt.format(mb[key]):>12}" + (f"{mb[key] / mr[key]:>12.2f}" if mr and mr[key] else f"{'-':>12}")
        lines.append(line)
    for text, check in TARGETS.get(case, []):
        verdict = check(mo, mr)
        lines.append(f"target: {text:<36} {'-' if verdict is None else 'met' if verdict else 'MISSED'}")
    return lines


def compare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = reference_script(Path(args.reference), work) if args.reference else None
    results: dict[str, Any] = {}
    for case in args.case:
        what, scenario, clients = CASES[case]
        path = work / f"{case}.json"
        path.write_text(json.dumps(scenario))
        ours: list[dict] = []
        ref: list[dict] = []
        before: list[dict] = []
        for round_ in range(args.rounds):
            makers: list[tuple[list[dict], Callable[[], Daemon]]] = [
                (ours, lambda path=path: Ours(path, work, args.ours_path, twistd=args.twistd))
            ]
            if script is not None:
                makers.append((ref, lambda path=path: Reference(path, work, script, args.reference_wait)))
            if args.before:
                makers.append((before, lambda path=path: Ours(path, work, args.before, twistd=args.twistd,
                                                              label="before")))
            # each daemon first in turn: with two, ours first in odd rounds, the other in even ones
            shift = round_ % len(makers)
            makers = makers[shift:] + makers[:shift]
            for runs, make in makers:
                daemon = make()
                spied = None
                if args.profile and round_ == 0:
                    spied = Path(args.profile) / f"{case}-{daemon.label}.raw"
                runs.append(one_run(daemon, clients, args.seconds, args.idle, spied))
                print(f"  {case} round {round_ + 1} {daemon.label}: {runs[-1]['rate']:.0f} req/s", file=sys.stderr)
        results[case] = {"what": what, "ours": ours, "reference": ref, "before": before}
        print("\n".join(report(case, ours, ref, before)) + "\n", flush=True)
    return results


def memory_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Our daemon under process churn and 32 clients for a long time; RSS every second."""
    path = work / "churn.json"
    path.write_text(json.dumps(churn()))
    daemon = Ours(path, work, args.ours_path, twistd=args.twistd)
    daemon.start()
    series: list[tuple[float, float, float, float]] = []
    outcome: dict[str, Any] = {}
    try:
        thread = threading.Thread(
            target=lambda: outcome.update(load=run_load(daemon.address, 32, args.memory_run, pace=args.pace, silent=1))
        )
        began = time.monotonic()
        thread.start()
        while thread.is_alive():
            figures = daemon.figures()
            series.append((time.monotonic() - began, figures["VmRSS"], figures["cpu"], figures["fds"]))
            thread.join(1.0)
    finally:
        daemon.stop()
    load = outcome["load"]
    rss = [s[1] for s in series]
    tenth = max(1, len(series) // 10)
    second_half = series[len(series) // 2:]
    slope = _slope([(t, r) for t, r, _, _ in second_half]) * 60
    print(f"== memory run: {args.memory_run:.0f} s, 8 GPUs, 100 process starts and exits per second, "
          f"32 clients (31 ask S every {args.pace} s, 1 never sends S)")
    print(f"requests {load.requests} ({load.rate:.0f}/s), E records received {load.exited} "
          f"({load.exited / 31 / args.memory_run:.0f} per S client per second), errors {len(load.errors)}")
    print(f"RSS KiB: after 10% {rss[tenth]}, at 50% {rss[len(rss) // 2]}, end {rss[-1]}, peak {max(rss)}; "
          f"second-half slope {slope:+.1f} KiB/min")
    print(f"open descriptors: start {series[0][3]:.0f}, end {series[-1][3]:.0f}; "
          f"CPU {series[-1][2] - series[0][2]:.1f} s over {series[-1][0]:.0f} s")
    return {"series": series, "requests": load.requests, "exited": load.exited, "slope_kib_per_min": slope,
            "errors": load.errors}


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (per second)."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(p[0] for p in points)
    my = statistics.fmean(p[1] for p in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", metavar="PATH",
                        help="atop's own Python atopgpud to compare with: the file atopgpud at the top of atop's "
                        "source tree (github.com/Atoptool/atop, 2.13 or later; its make install copies it to "
                        "/usr/sbin/atopgpud; Debian 12's atop package does not ship it); lines before '#!' "
                        "are dropped")
    parser.add_argument("--reference-wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for @atopgpud_nvidia to be free before each start of the "
                        "reference (another run's reference there; default: stop at once)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each daemon per case (default 3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="load per run (default 10)")
    parser.add_argument("--idle", type=float, default=10.0, help="idle seconds for CPU per poll (default 10)")
    parser.add_argument("--memory-run", type=float, metavar="SECONDS", help="run the memory run instead")
    parser.add_argument("--pace", type=float, default=0.02, help="memory run: seconds between a client's S")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--profile", metavar="DIR", help="sample each daemon with py-spy under load in the first "
                        "round: DIR/<case>-<daemon>.raw, and a summary on stderr")
    parser.add_argument("--ours-path", metavar="DIR", help="run our daemon from this copy of the source tree "
                        "(put first on PYTHONPATH), e.g. an older version, to compare before and after")
    parser.add_argument("--before", metavar="DIR", help="also run our daemon from this copy of the source tree "
                        "(e.g. git archive of an older commit), as 'before', in the same rounds, in turn")
    parser.add_argument("--twistd", action="store_true", help="run our daemon as twistd -n atopgpud (the plugin) "
                        "instead of the atopgpud command the shipped unit runs")
    args = parser.parse_args()
    args.case = args.case or list(CASES)
    print(f"$ {shlex.join(['python', *sys.argv])}\n# {time.strftime('%Y-%m-%d %H:%M %Z')}\n", flush=True)
    work = workdir()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    try:
        results = memory_run(args, work) if args.memory_run else compare(args, work)
    except BenchError as error:
        print(f"perf: {error}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
