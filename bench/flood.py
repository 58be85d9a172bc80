#!/usr/bin/env python3
"""A connection flood from one local user: what an established atop and new clients see.

    .venv/bin/python bench/flood.py [--seconds 8] [--flood-user nobody] [--flooders 1] [--tcp]
                                    [--new-clients 40] [--no-pin] [--ours-path DIR] [--profile FILE.raw]
                                    [--strace FILE.txt] [--daemon-nice N]
                                    [-- DAEMON OPTIONS...]

The daemon (``twistd -n atopgpud --reader sim``, 2 GPUs x 20 processes) runs
pinned to CPU 0.  Each flooder is a forked child, pinned to CPU 1, that switches
to ``--flood-user`` (``root``: the bench's own user, as the clients are) and
loops: connect, send ``S\\x02``, set SO_LINGER 0 and close (a reset), for
``--seconds`` and at most ``--max-connections`` connections.  Its connect has a
0.1 s timeout; an EAGAIN (the listen backlog full) counts and it goes on.

Meanwhile, as the bench's own user:

- a probe connected before the flood asks ``S\\x02`` every 0.1 s and times
  each reply, from the send to the last byte;
- ``--new-clients`` clients, spread evenly over the flood, each connect with a
  2 s timeout (an EAGAIN on connect is a failure, as it is for a client that
  connects once), ask ``T\\x02`` then ``S\\x02`` and must get both within 2 s.
  With ``--atop-connect`` they connect as atop does, blocking: on a UNIX socket
  such a connect waits for room in a full backlog (here at most 2 s).

``--tcp`` floods and connects on TCP 127.0.0.1 (a free port) instead of the
abstract socket.  Options after ``--`` go to the daemon (``--allow-uid root``).
Everything is local (an abstract socket or loopback) and bounded in count and time.
``--profile`` records the daemon with py-spy over the flood (raw folded stacks,
`spy.py` summarises them); it costs the daemon nothing but takes CPU of its own.
``--daemon-nice N`` renices the daemon (on a busy machine, other processes
take its CPU: ``daemon_runqueue_wait_s`` says how long it waited for one, and
``probe_sleep_overshoot_max_ms`` how late the probe itself ran at worst).
``--strace FILE`` counts the daemon's system calls over the flood (``strace -c``;
it slows the daemon several times over: for the ratios, not the rates).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spy  # noqa: E402
from daemons import Ours, workdir  # noqa: E402
from loadgen import _read_reply  # noqa: E402
from perf import host  # noqa: E402

_LINGER_RESET = struct.pack("ii", 1, 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _socket(address: object) -> socket.socket:
    family = socket.AF_INET if isinstance(address, tuple) else socket.AF_UNIX
    return socket.socket(family, socket.SOCK_STREAM)


def _flood(address: object, user: str, cpu: int | None, until: float, limit: int, out: int) -> None:
    """The flooder's loop, in a forked child; writes its counts to the pipe `out` as JSON."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    account = pwd.getpwnam(user)
    if os.getuid() != account.pw_uid:
        os.setgroups([])
        os.setgid(account.pw_gid)
        os.setuid(account.pw_uid)
    connected = refused = other = 0
    request = b"S\x02"
    while connected + refused + other < limit and time.time() < until:
        sock = _socket(address)
        sock.settimeout(0.1)
        try:
            sock.connect(address)  # type: ignore[arg-type]
            sock.send(request)
            connected += 1
        except (BlockingIOError, TimeoutError):
            refused += 1
        except OSError:
            other += 1
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
        sock.close()
    os.write(out, json.dumps({"connected": connected, "eagain_or_timeout": refused, "other_errors": other}).encode())


def _probe(address: object, until: float, out: list[float], errors: list[str], overslept: list[float]) -> None:
    sock = _socket(address)
    sock.settimeout(5.0)
    view = memoryview(bytearray(1 << 17))
    try:
        sock.connect(address)  # type: ignore[arg-type]
        sock.sendall(b"T\x02")
        _read_reply(sock, view)
        out.clear()
        while time.time() < until:
            begin = time.perf_counter()
            sock.sendall(b"S\x02")
            _read_reply(sock, view)
            out.append(time.perf_counter() - begin)
            asleep = time.perf_counter()
            time.sleep(0.1)
            overslept.append(time.perf_counter() - asleep - 0.1)
    except (OSError, ValueError) as error:
        errors.append(f"{type(error).__name__}: {error}")
    finally:
        sock.close()


def _new_client(address: object, atop_connect: bool = False) -> str | None:
    """None if a fresh client is answered ``T`` and ``S`` within 2 s each; else what went wrong.

    `atop_connect`: connect as atop 2.13 does (gpucom.c), a blocking connect, which on a
    UNIX socket waits for room in a full backlog instead of failing (bounded here at 2 s
    by SO_SNDTIMEO); else a non-blocking one with a 2 s timeout, refused (EAGAIN) at once
    when the backlog is full."""
    sock = _socket(address)
    view = memoryview(bytearray(1 << 17))
    if atop_connect:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 2, 0))
    else:
        sock.settimeout(2.0)
    try:
        sock.connect(address)  # type: ignore[arg-type]
        sock.settimeout(2.0)
    except BlockingIOError:
        sock.close()
        return "EAGAIN on connect"
    except OSError as error:
        sock.close()
        return f"connect: {type(error).__name__}"
    try:
        for request in (b"T\x02", b"S\x02"):
            sock.sendall(request)
            _read_reply(sock, view)
    except (OSError, ValueError) as error:
        return f"reply: {type(error).__name__}"
    finally:
        sock.close()
    return None


def kernel_counts() -> dict[str, int]:
    """The host's counters of what the network stack dropped or sent again (all sockets, not only ours)."""
    counts = {"softnet_dropped": 0}
    with open("/proc/net/softnet_stat") as softnet:
        for line in softnet:
            counts["softnet_dropped"] += int(line.split()[1], 16)
    tables = (("/proc/net/snmp", ("RetransSegs",)), ("/proc/net/netstat", ("ListenOverflows", "ListenDrops")))
    for path, wanted in tables:
        with open(path) as table:
            lines = table.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            for name, value in zip(names.split()[1:], values.split()[1:]):
                if name in wanted:
                    counts[name] = int(value)
    return counts


def runqueue_wait(pid: int, only_main: bool = False) -> float:
    """Seconds the threads of `pid` (`only_main`: its first thread, the reactor's) have waited
    on a run queue (``/proc/PID/task/TID/schedstat``)."""
    total = 0
    for tid in [str(pid)] if only_main else os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def _summary(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"count": 0}
    ordered = sorted(latencies)
    return {
        "count": len(ordered),
        "p50_ms": round(1000 * ordered[len(ordered) // 2], 1),
        "max_ms": round(1000 * ordered[-1], 1),
        "over_100ms": sum(1 for value in ordered if value > 0.1),
    }


def run(args: argparse.Namespace, options: list[str]) -> dict:
    folder = workdir()
    scenario = folder / "flood.json"
    scenario.write_text(json.dumps(host(2, 20)))
    if args.tcp:
        port = _free_port()
        options = [*options, "--listen", f"tcp:{port}:interface=127.0.0.1"]
    daemon = Ours(scenario, folder, args.ours_path, tuple(options))
    daemon.start()
    address: object = ("127.0.0.1", port) if args.tcp else daemon.address
    pin = not args.no_pin and len(os.sched_getaffinity(0)) > 1
    try:
        if pin:
            for tid in os.listdir(f"/proc/{daemon.pid}/task"):
                os.sched_setaffinity(int(tid), {0})
        if args.daemon_nice:
            os.setpriority(os.PRIO_PROCESS, daemon.pid, args.daemon_nice)
        kernel_before = kernel_counts()
        waited_before = runqueue_wait(daemon.pid)
        reactor_waited_before = runqueue_wait(daemon.pid, only_main=True)
        until = time.time() + 1.0 + args.seconds
        probe_latencies: list[float] = []
        probe_errors: list[str] = []
        overslept: list[float] = []
        prober = threading.Thread(target=_probe, args=(address, until, probe_latencies, probe_errors, overslept))
        prober.start()
        time.sleep(0.5)
        flooders = []
        for _ in range(args.flooders):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(read_end)
                    _flood(address, args.flood_user, 1 if pin else None, until, args.max_connections, write_end)
                finally:
                    os._exit(0)
            os.close(write_end)
            flooders.append((pid, read_end))
        time.sleep(0.5)
        recording = spy.start(daemon.pid, args.seconds - 1.0, Path(args.profile)) if args.profile else None
        tracing = None
        if args.strace:
            tracing = subprocess.Popen(
                ["timeout", "-s", "INT", str(max(1, int(args.seconds - 1.0))), "strace", "-c", "-f", "-o", args.strace,
                 "-p", str(daemon.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        failures: dict[str, int] = {}
        answered = 0
        begin = time.time()
        step = max(0.0, (until - begin - 2.5)) / max(1, args.new_clients)
        for number in range(args.new_clients):
            time.sleep(max(0.0, begin + number * step - time.time()))
            failure = _new_client(address, args.atop_connect)
            if failure is None:
                answered += 1
            else:
                failures[failure] = failures.get(failure, 0) + 1
        prober.join()
        kernel_after = kernel_counts()
        waited = runqueue_wait(daemon.pid) - waited_before
        reactor_waited = runqueue_wait(daemon.pid, only_main=True) - reactor_waited_before
        floods = []
        for pid, read_end in flooders:
            with os.fdopen(read_end, "rb") as pipe:
                text = pipe.read()
            os.waitpid(pid, 0)
            floods.append(json.loads(text) if text else {"error": "flooder died"})
        for process in (recording, tracing):
            if process is not None:
                process.wait(timeout=30)
        cpu_after = open(f"/proc/{daemon.pid}/stat").read().rsplit(")", 1)[1].split()
    finally:
        daemon.stop()
    connected = sum(flood.get("connected", 0) for flood in floods)
    return {
        "address": "tcp 127.0.0.1" if args.tcp else "abstract socket",
        "daemon_options": options,
        "flood_user": args.flood_user,
        "pinned": pin,
        "flood_connections_per_s": round(connected / args.seconds),
        "flooders": floods,
        "probe": _summary(probe_latencies),
        "probe_errors": probe_errors,
        "new_clients_connect": "blocking, as atop" if args.atop_connect else "non-blocking",
        "new_clients_answered": f"{answered} of {args.new_clients}",
        "new_client_failures": failures,
        "kernel_counts_during": {key: kernel_after[key] - kernel_before.get(key, 0) for key in kernel_after},
        "daemon_nice": args.daemon_nice,
        #: the daemon's threads' time runnable but waiting for a CPU (other processes had it)
        "daemon_runqueue_wait_s": round(waited, 2),
        "reactor_thread_runqueue_wait_s": round(reactor_waited, 2),
        #: the probe's own scheduling delay: how much longer than 0.1 s its sleeps took, at worst
        "probe_sleep_overshoot_max_ms": round(1000 * max(overslept, default=0.0), 1),
        "load_average": open("/proc/loadavg").read().split()[:3],
        "daemon_cpu_s": (int(cpu_after[11]) + int(cpu_after[12])) / os.sysconf("SC_CLK_TCK"),
        "daemon_system_cpu_s": int(cpu_after[12]) / os.sysconf("SC_CLK_TCK"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--flood-user", default="nobody")
    parser.add_argument("--flooders", type=int, default=1)
    parser.add_argument("--max-connections", type=int, default=1_000_000, help="per flooder")
    parser.add_argument("--new-clients", type=int, default=40)
    parser.add_argument("--tcp", action="store_true")
    parser.add_argument("--atop-connect", action="store_true",
                        help="new clients connect as atop does: a blocking connect (waits for room in the backlog)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--ours-path", default=None)
    parser.add_argument("--profile", default=None, help="py-spy raw output of the daemon during the flood")
    parser.add_argument("--daemon-nice", type=int, default=0,
                        help="the daemon's nice value (-10: a larger share of its CPU against other work)")
    parser.add_argument("--strace", default=None, help="strace -c of the daemon's system calls during the flood")
    parser.add_argument("daemon_options", nargs="*")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = run(args, args.daemon_options)
    print(f"# {started}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
