"""``atopgpu``: show what a running atopgpud reports, as a table or as JSON, with atop's
averages (a sum's change over the sample count's) since start or over each --watch interval
(docs/atopgpu.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from itertools import islice
from typing import Any, Callable, NoReturn, Sequence

from atopgpud_tw import codec
from atopgpud_tw.atopgpu.connection import (
    DEFAULT_CONNECT,
    ClientError,
    Connection,
    Reading,
    command_name,
    parse_endpoint,
    take_reading,
)

_NO_DEVICE = codec.DeviceStats(0, 0, 0, 0, 0, 0, 0, 0, ())


def _average(cum: int, base: int, samples: int) -> float | None:
    """A sum's change per sample; None when unsupported or nothing was sampled."""
    return None if cum < 0 or base < 0 or samples <= 0 else round((cum - base) / samples, 2)


def _process_sums(proc: codec.ProcessStats, version: int) -> tuple[int, int, int, int]:
    """(samples, gpu busy sum, memory busy sum, memory sum) as atop derives them: version 1 sends
    averages, which atop multiplies by the sample count."""
    times = proc.samples if version == 1 else 1
    gpu, mem = (busy * times if busy >= 0 else -1 for busy in (proc.gpu_busy, proc.mem_busy))
    return proc.samples, gpu, mem, proc.memory_cum_kib


def _process_report(
    proc: codec.ProcessStats, before: codec.ProcessStats | None, version: int,
    contexts: dict[int, codec.ProcessInfo] | None = None,
) -> dict[str, Any]:
    now = _process_sums(proc, version)
    base = _process_sums(before, version) if before is not None else (0, 0, 0, 0)
    if now[0] < base[0]:
        base = (0, 0, 0, 0)  # a new process with a reused pid
    samples = now[0] - base[0]
    who = (contexts or {}).get(proc.pid)
    return {
        "pid": proc.pid,
        "state": "exited" if proc.state == "E" else "active",
        "type": None if version == 1 else proc.kind,
        "command": (who.comm if who is not None and who.comm else None) or command_name(proc.pid),
        "user": who.user or None if who is not None else None,
        "uid": who.uid if who is not None and who.uid >= 0 else None,
        "workload": _workload(who),
        "sums": [samples, *(_change(a, b) for a, b in zip(now[1:], base[1:]))],
        "memory_kib": proc.memory_now_kib if proc.memory_now_kib >= 0 else None,
        "samples": samples,
        "gpu_busy_avg": _average(now[1], base[1], samples),
        "mem_busy_avg": _average(now[2], base[2], samples),
        "memory_avg_kib": _average(now[3], base[3], samples),
        "counters": {
            "samples": proc.samples,
            "gpubusy": proc.gpu_busy,
            "membusy": proc.mem_busy,
            "memcum": proc.memory_cum_kib,
        },
    }


def _workload(who: codec.ProcessInfo | None) -> str | None:
    """``KIND:NAME`` of a process's workload, ``unknown`` for one the daemon could not read; None: not told."""
    if who is None or not who.kind:
        return None
    return "unknown" if who.kind == "unknown" else f"{who.kind}:{who.workload}"


def _change(now: int, base: int) -> int | None:
    """A sum's change over the span; None when unsupported."""
    return None if now < 0 or base < 0 else now - base


def _gpu_report(
    index: int, kind: codec.DeviceType, dev: codec.DeviceStats, before: codec.DeviceStats | None, version: int,
    contexts: dict[int, codec.ProcessInfo] | None = None,
) -> dict[str, Any]:
    base = before if before is not None and before.samples <= dev.samples else _NO_DEVICE
    samples = dev.samples - base.samples
    earlier = {p.pid: p for p in (before.processes if before is not None else ())}
    return {
        "index": index,
        "busid": kind.busid,
        "type": kind.name,
        "task_support": kind.task_support,
        "gpu_busy_now": dev.gpu_busy_now if dev.gpu_busy_now >= 0 else None,
        "mem_busy_now": dev.mem_busy_now if dev.mem_busy_now >= 0 else None,
        "memory_total_kib": dev.memory_total_kib,
        "memory_used_kib": dev.memory_used_kib,
        "samples": samples,
        "gpu_busy_avg": _average(dev.gpu_busy_cum, base.gpu_busy_cum, samples),
        "mem_busy_avg": _average(dev.mem_busy_cum, base.mem_busy_cum, samples),
        "memory_used_avg_kib": _average(dev.memory_used_cum_kib, base.memory_used_cum_kib, samples),
        "counters": {
            "samples": dev.samples,
            "gpuperccum": dev.gpu_busy_cum,
            "memperccum": dev.mem_busy_cum,
            "memusedcum": dev.memory_used_cum_kib,
        },
        "processes": [_process_report(p, earlier.get(p.pid), version, contexts) for p in dev.processes],
    }


def report(reading: Reading, previous: Reading | None, endpoint: str, by: str | None = None) -> dict[str, Any]:
    """The JSON document for a reading: since start, or since `previous`; with `by`, the groups' too."""
    # a GPU keeps its place in T order; a different bus id there is another GPU
    pairs = enumerate(zip(previous.types, previous.stats)) if previous is not None else ()
    earlier = {(index, kind.busid): dev for index, (kind, dev) in pairs}
    doc: dict[str, Any] = {
        "endpoint": endpoint,
        "version": reading.version,
        "time": round(time.time(), 3),
        "span": "start" if previous is None else "interval",
        "seconds": None if previous is None else round(reading.taken - previous.taken, 3),
        "gpus": [
            _gpu_report(index, kind, dev, earlier.get((index, kind.busid)), reading.version, reading.contexts)
            for index, (kind, dev) in enumerate(zip(reading.types, reading.stats))
        ],
    }
    if by is not None:
        doc["by"] = by
        doc["groups"] = group_report(doc, by)
    for gpu in doc["gpus"]:
        for proc in gpu["processes"]:
            del proc["sums"]  # the groups' arithmetic only
    return doc


def group_report(doc: dict[str, Any], by: str) -> list[dict[str, Any]]:
    """Per GPU and group (`by`: user or workload), atop's arithmetic over the span: the group's
    processes' sums changed (exited ones included), over the GPU's samples in the span."""
    groups = []
    for gpu in doc["gpus"]:
        found: dict[str, dict[str, Any]] = {}
        for proc in gpu["processes"]:
            name = proc[by] or "-"
            group = found.setdefault(name, {"gpu": gpu["index"], "by": by, "name": name, "processes": 0,
                                            "sums": [0, 0, 0]})
            group["processes"] += 1
            for position, value in enumerate(proc["sums"][1:]):
                if value is None or group["sums"][position] is None:
                    group["sums"][position] = None
                else:
                    group["sums"][position] += value
        for name in sorted(found):
            group = found[name]
            sums = group.pop("sums")
            samples = gpu["samples"]
            group.update({key: None if value is None or samples <= 0 else round(value / samples, 2)
                          for key, value in zip(("gpu_busy_avg", "mem_busy_avg", "memory_avg_kib"), sums)})
            groups.append(group)
    return groups


def columns(header: Sequence[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """Header and rows as aligned lines (the tables of every view): columns in `left` to the
    left, the rest right; every cell shown as data (`codec.printable`), as a daemon, a
    metrics page or another user's process names them."""
    table = [list(header), *([codec.printable(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i in left else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in table]


def _percent(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{value:.{decimals}f}%"


def _size(kib: float | None) -> str:
    if kib is None or kib < 0:
        return "-"
    if kib >= 1024 * 1024:
        return f"{kib / (1024 * 1024):.1f}G"
    if kib >= 1024:
        return f"{kib / 1024:.0f}M"
    return f"{kib:.0f}K"


_GPU_HEADER = ("GPU", "BUSID", "TYPE", "BUSY", "AVGBUSY", "MEMBUSY", "MEMUSED", "MEMTOTAL", "SAMPLES")
_PROC_HEADER = ("PID", "S", "T", "USER", "COMMAND", "WORKLOAD", "MEMORY", "AVGBUSY", "MEMBUSY", "SAMPLES")
_GROUP_HEADER = ("GPU", "GROUP", "PROCS", "AVGBUSY", "MEMBUSY", "AVGMEM")


def render_table(doc: dict[str, Any]) -> str:
    """The report as text: a row per GPU, its processes indented below it."""
    span = ("averages since the daemon started" if doc["span"] == "start"
            else f"averages over the last {doc['seconds']:.1f} s")
    lines = [f"atopgpud at {codec.printable(doc['endpoint'])} (API {doc['version']}), {span}"]
    gpu_rows, proc_rows = [], []
    for gpu in doc["gpus"]:
        gpu_rows.append([
            str(gpu["index"]), gpu["busid"], gpu["type"], _percent(gpu["gpu_busy_now"], 0),
            _percent(gpu["gpu_busy_avg"]), _percent(gpu["mem_busy_avg"]), _size(gpu["memory_used_kib"]),
            _size(gpu["memory_total_kib"]), str(gpu["samples"]),
        ])
        for proc in gpu["processes"]:
            proc_rows.append([
                str(proc["pid"]), "E" if proc["state"] == "exited" else "A", proc["type"] or "-",
                proc["user"] or "-", proc["command"] or "-", proc["workload"] or "-",
                _size(proc["memory_kib"]), _percent(proc["gpu_busy_avg"]),
                _percent(proc["mem_busy_avg"]), str(proc["samples"]),
            ])
    gpu_lines = columns(_GPU_HEADER, gpu_rows, {1, 2})
    procs = iter(columns(_PROC_HEADER, proc_rows, {1, 2, 3, 4, 5}))
    proc_header = next(procs)
    lines.append(gpu_lines[0])
    for gpu, line in zip(doc["gpus"], gpu_lines[1:]):
        lines.append(line)
        if gpu["processes"]:
            lines.extend("     " + text for text in [proc_header, *islice(procs, len(gpu["processes"]))])
    if not doc["gpus"]:
        lines.append("(no GPUs)")
    if "groups" in doc:
        rows = [[str(g["gpu"]), g["name"], str(g["processes"]), _percent(g["gpu_busy_avg"]),
                 _percent(g["mem_busy_avg"]), _size(g["memory_avg_kib"])] for g in doc["groups"]]
        lines.extend(["", f"by {doc['by']}:"])
        lines.extend(columns(_GROUP_HEADER, rows, {1}) if rows else ["(no processes)"])
    return "\n".join(lines)


#: --watch's shortest interval: shorter would only keep the daemon busy answering
MIN_WATCH = 0.05


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not MIN_WATCH <= number <= 1e6:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds from {MIN_WATCH:g} to 1e6")
    return number


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return int(value)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (no usage lines before it), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (try {self.prog} --help)\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="atopgpu",
        description="Show the GPU and per-process figures a running atopgpud serves to atop. "
        "'atopgpu doctor' checks instead why atop would show none (atopgpu doctor --help).",
    )
    parser.add_argument("--connect", default=DEFAULT_CONNECT, metavar="ENDPOINT",
                        help="where the daemon listens: unix:@NAME, unix:/path, "
                        "tcp:PORT:interface=HOST or tcp:HOST:PORT (default: %(default)s)")
    parser.add_argument("--version", type=int, choices=codec.VERSIONS, default=codec.NEWEST_VERSION,
                        metavar="N", help="the API version to ask for, 1 or 2 (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--by", choices=("user", "workload"), default=None,
                        help="also a table per GPU and user (or workload) of the group's average busy "
                        "figures and memory over the span, exited processes included")
    parser.add_argument("--watch", type=_positive, metavar="SECONDS",
                        help="report again every SECONDS (0.05 to 1e6), with figures over each interval")
    parser.add_argument("--count", type=_count, metavar="N", help="with --watch: stop after N reports")
    parser.add_argument("--health", action="store_true",
                        help="show each GPU's health and power figures (temperatures, power, clocks, "
                        "throttling, ECC, XID errors), fetched from the daemon's --metrics endpoint")
    parser.add_argument("--gpm", action="store_true",
                        help="show what each GPU and MIG instance really did (SM, tensor, DRAM, PCIe, NVLink "
                        "activity from GPM, Hopper and later), over --watch seconds (1 s without it), fetched "
                        "from the daemon's --metrics endpoint")
    parser.add_argument("--metrics-url", default=None, metavar="URL",
                        help="with --health or --gpm: the daemon's metrics page "
                        "(default: http://127.0.0.1:9445/metrics)")
    return parser


def _emit(doc: dict[str, Any], args: argparse.Namespace,
          render: Callable[[dict[str, Any]], str] = render_table) -> None:
    """One report: JSON (a line each under --watch), or rendered (a blank line after each under --watch)."""
    watching = args.watch is not None
    if args.json:
        text = json.dumps(doc, separators=(",", ":")) if watching else json.dumps(doc, indent=2)
    else:
        text = render(doc) + ("\n" if watching else "")
    print(text, flush=True)


def _repeat(args: argparse.Namespace, once: Callable[[], None], start: float | None = None) -> None:
    """`once` once, or every --watch seconds until --count reports: on a fixed grid from
    `start` (now by default), so that slow replies do not stretch the intervals."""
    shown, start = 0, time.monotonic() if start is None else start
    while True:
        once()
        shown += 1
        if args.watch is None or (args.count is not None and shown >= args.count):
            return
        time.sleep(max(0.0, start + shown * args.watch - time.monotonic()))


def run_gpm(args: argparse.Namespace) -> None:
    """--gpm: GPM's averages between readings of the metrics page, --watch (or 1) seconds apart."""
    from atopgpud_tw.atopgpu.health import DEFAULT_URL, fetch, gpm_counters, gpm_report, render_gpm

    url = args.metrics_url or DEFAULT_URL
    span = args.watch or 1.0
    start = time.monotonic()
    before = gpm_counters(fetch(url), url)

    def once() -> None:
        nonlocal before
        after = gpm_counters(fetch(url), url)
        _emit(gpm_report(before, after, url), args, render_gpm)
        before = after

    # the first report a span after the first reading, then on `_repeat`'s grid from there
    time.sleep(max(0.0, start + span - time.monotonic()))
    _repeat(args, once, start + span)


def run(args: argparse.Namespace) -> None:
    if args.health:  # the metrics page's health figures, once or every --watch seconds
        from atopgpud_tw.atopgpu.health import DEFAULT_URL, fetch, health_report, render_health

        url = args.metrics_url or DEFAULT_URL
        _repeat(args, lambda: _emit(health_report(fetch(url), url), args, render_health))
        return
    if args.gpm:
        run_gpm(args)
        return
    address = parse_endpoint(args.connect)
    told = True
    connection = Connection(address)
    previous: Reading | None = None

    def once() -> None:
        nonlocal connection, told, previous
        reading = take_reading(connection, args.version, contexts=told)
        if told and reading.contexts is None:
            # a daemon that does not know P closed the connection: go on without, on a new one
            told = False
            if args.watch is not None:
                connection.close()
                connection = Connection(address)
        _emit(report(reading, previous, args.connect, args.by), args)
        previous = reading

    try:
        _repeat(args, once)
    finally:
        connection.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: 0 on success, 1 no daemon, 2 bad usage, 3 bad reply; ``doctor``: its checks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        from atopgpud_tw.atopgpu.doctor import main as doctor

        return doctor(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.count is not None and args.watch is None:
        parser.error("--count needs --watch")
    if args.metrics_url is not None and not (args.health or args.gpm):
        parser.error("--metrics-url needs --health or --gpm")
    if args.health and args.gpm:
        parser.error("--health and --gpm are two views: give one")
    try:
        parse_endpoint(args.connect)
    except ValueError as error:
        parser.error(codec.printable(f"--connect {args.connect}: {error}"))
    try:
        run(args)
    except ClientError as error:
        # the message may quote what a daemon or a page sent: shown as data too
        sys.stderr.write(f"atopgpu: {codec.printable(str(error))}\n")
        return error.exit_status
    except KeyboardInterrupt:
        return 0 if args.watch is not None else 130
    except BrokenPipeError:
        # the reader of our output went away (| head): not an error worth a trace,
        # and the flush at exit must not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
