#!/usr/bin/env python3
"""Reply latency and RSS of the daemon on ``--reader nvidia-smi`` while it reads big reports.

    .venv/bin/python bench/smi_report.py [--case 5k 30mib-kept 100k 30mib-dropped] [--seconds 20]
                                          [--interval 1] [--source DIR]

A stand-in nvidia-smi (tests/fake_nvidia_smi.py through tests/smi_doubles.py)
prints a generated ``-q -x`` report at every poll:

- ``small``: 8 GPUs, 80 processes (22 KB): the floor, what a poll costs at all;
- ``5k``: 8 GPUs, 5,000 processes in all (about 1.3 MB);
- ``30mib-kept``: 8 GPUs, 8,000 processes with long names, 30 MiB: every
  process within the caps (readers/smi/stream.py), so all are read;
- ``100k``: 8 GPUs, 100,000 processes (about 26 MiB): more per GPU than is
  read, so each GPU's list is left out of the poll;
- ``30mib-dropped``: 8 GPUs, 30 MiB of ``<supported_clocks>`` the reader has no
  use for.

The daemon (``twistd -n atopgpud``, the installed package or ``--source DIR``,
an older tree ``git archive``d, to compare) polls every ``--interval``
seconds; a client like atop asks version 2 ``S`` every 20 ms on one
connection for ``--seconds`` and times each reply from send to its last byte.
Reported per case: the replies' median, 99th percentile and worst, how many
polls were folded in meanwhile, and the daemon's RSS now and at its peak
(VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from daemons import BenchError, ask, proc_figures, samples  # noqa: E402
from smi_doubles import FakeSmi  # noqa: E402

MIB = 2**20
CASES = {
    "small": (8, 80, 20, 0),
    # name: (GPUs, processes in all, bytes of each process name, bytes of clocks per GPU)
    "5k": (8, 5000, 20, 0),
    "30mib-kept": (8, 8000, 3700, 0),
    "100k": (8, 100_000, 20, 0),
    "30mib-dropped": (8, 0, 0, 30 * MIB // 8),
}

_GPU_HEAD = """\t<gpu id="00000000:{bus:02X}:00.0">
\t\t<product_name>NVIDIA Bench Board</product_name>
\t\t<mig_mode><current_mig>Disabled</current_mig><pending_mig>Disabled</pending_mig></mig_mode>
\t\t<uuid>GPU-00000000-0000-0000-0000-0000000000{bus:02x}</uuid>
\t\t<pci><pci_bus_id>00000000:{bus:02X}:00.0</pci_bus_id></pci>
\t\t<fb_memory_usage><total>81559 MiB</total><reserved>500 MiB</reserved>
\t\t\t<used>40000 MiB</used><free>41059 MiB</free></fb_memory_usage>
\t\t<utilization><gpu_util>37 %</gpu_util><memory_util>12 %</memory_util></utilization>
\t\t<temperature><gpu_temp>41 C</gpu_temp></temperature>
\t\t<gpu_power_readings><instant_power_draw>250.00 W</instant_power_draw></gpu_power_readings>
\t\t<clocks><graphics_clock>1980 MHz</graphics_clock><sm_clock>1980 MHz</sm_clock>
\t\t\t<mem_clock>2619 MHz</mem_clock></clocks>
"""
_PROCESS = """\t\t\t<process_info>
\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>
\t\t\t\t<compute_instance_id>N/A</compute_instance_id>
\t\t\t\t<pid>{pid}</pid>
\t\t\t\t<type>C</type>
\t\t\t\t<process_name>{name}</process_name>
\t\t\t\t<used_memory>{memory} MiB</used_memory>
\t\t\t</process_info>
"""
_CLOCK = (
    "\t\t\t<supported_mem_clock><value>2619 MHz</value>"
    "<supported_graphics_clock>1980 MHz</supported_graphics_clock></supported_mem_clock>\n"
)


def report(gpus: int, processes: int, name_bytes: int, clock_bytes: int) -> bytes:
    """A ``-q -x`` report of `gpus` GPUs sharing `processes` processes."""
    parts = ['<?xml version="1.0" ?>\n<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n<nvidia_smi_log>\n']
    pid = 1000
    for index in range(gpus):
        parts.append(_GPU_HEAD.format(bus=0x17 + index))
        parts.append("\t\t<supported_clocks>\n")
        parts.append(_CLOCK * (clock_bytes // len(_CLOCK)))
        parts.append("\t\t</supported_clocks>\n\t\t<processes>\n")
        share = processes // gpus + (1 if index < processes % gpus else 0)
        for _ in range(share):
            name = f"/opt/app/bin/worker-{pid}".ljust(name_bytes, "x")
            parts.append(_PROCESS.format(pid=pid, name=name, memory=pid % 997 + 1))
            pid += 1
        parts.append("\t\t</processes>\n\t</gpu>\n")
    parts.append("</nvidia_smi_log>\n")
    return "".join(parts).encode()


def start_daemon(binary: Path, interval: float, source: str | None, log: Path) -> tuple[subprocess.Popen, bytes]:
    name = f"atopgpud-bench-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    command = [
        str(Path(sys.executable).with_name("twistd")), "-n", "--pidfile=", "atopgpud",
        "--reader", "nvidia-smi", "--nvidia-smi", str(binary), "--smi-timeout", "20",
        "--interval", str(interval), "--listen", f"unix:@{name}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return proc, b"\0" + name.encode()


def wait_polls(proc: subprocess.Popen, address: bytes, wanted: int, log: Path, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the daemon exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if samples(address) >= wanted:
                return
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.1)
    raise BenchError(f"no {wanted} polls within {limit:.0f} s:\n{log.read_text()[-2000:]}")


def probe(address: bytes, seconds: float, pace: float = 0.02) -> list[float]:
    """Latencies of version 2 ``S`` requests, one every `pace` seconds, for `seconds`."""
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10.0)
        sock.connect(address)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            begin = time.perf_counter()
            ask(address, b"S\x02", sock=sock)
            out.append(time.perf_counter() - begin)
            time.sleep(pace)
    return out


def run_case(case: str, seconds: float, interval: float, source: str | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="atopgpud-bench-smi-"))
    fake = FakeSmi(work)
    data = report(*CASES[case])
    fake.report("", data)
    log = work / "daemon.log"
    proc, address = start_daemon(fake.binary, interval, source, log)
    try:
        wait_polls(proc, address, 2, log)
        before = samples(address)
        latencies = sorted(probe(address, seconds))
        polls = samples(address) - before
        figures = proc_figures(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "case": case,
        "report_bytes": len(data),
        "replies": len(latencies),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2),
        "max_ms": round(1000 * latencies[-1], 2),
        "polls": polls,
        "rss_mb": round(figures["VmRSS"] / 1024, 1),
        "peak_rss_mb": round(figures["VmHWM"] / 1024, 1),
        "cpu_s": round(figures["cpu"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--source", help="run the daemon from this source tree instead of the installed one")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {args.seconds:g} s per case, "
          f"polls every {args.interval:g} s, S every 20 ms", flush=True)
    try:
        for case in args.case:
            print(json.dumps(run_case(case, args.seconds, args.interval, args.source)), flush=True)
    except BenchError as error:
        print(f"smi_report: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
