#!/usr/bin/env python3
"""How long atop waits when its connection starts the daemon (socket activation).

    .venv/bin/python bench/activation.py [--runs 10] [--smi-delay 0.5] [--before TREE] [--case nvml]

systemd-socket-activate holds an abstract socket as atopgpud.socket does; a
client connects (which starts the daemon), sends ``T`` and times the reply.
atop gives up after 2 s.  Readers: ``nvml`` (the real nvidia-ml-py over the
simulated libnvidia-ml, ``--reader sim``) and ``nvidia-smi`` (a stand-in that
prints tests/fixtures/smi/agree-mixed-host.xml after ``--smi-delay`` seconds,
what one real ``nvidia-smi -q -x`` run takes on the host being modelled; the
daemon runs it, and ``-L`` on a MIG host, once before it serves).  ``--before
TREE`` also starts the daemon from another copy of the source tree (put first on
its PYTHONPATH, which systemd-socket-activate passes on only when told to), one
run of each in turn, and gives both; ``--case nvml`` runs the first case alone.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATOPGPUD = str(Path(sys.executable).with_name("atopgpud"))
REPORT = ROOT / "tests" / "fixtures" / "smi" / "agree-mixed-host.xml"
LISTING = ROOT / "tests" / "fixtures" / "smi" / "agree-mixed-host-list.txt"


def stand_in(folder: Path, delay: float) -> Path:
    binary = folder / "nvidia-smi"
    binary.write_text(
        "#!/bin/sh\n"
        f"sleep {delay}\n"
        f'if [ "$1" = -L ]; then cat {LISTING}; else cat {REPORT}; fi\n'
    )
    binary.chmod(0o755)
    return binary


def one_run(args: list[str], tree: str | None = None) -> float:
    """Seconds from connect to the end of the T reply, on a fresh activation (of the
    daemon from `tree`, if given)."""
    name = f"atopgpud-activation-{uuid.uuid4().hex[:10]}"
    setenv = [f"--setenv=PYTHONPATH={tree}"] if tree else []
    proc = subprocess.Popen(
        ["systemd-socket-activate", f"--listen=@{name}", "--fdname=atopgpud.socket", *setenv, "--", ATOPGPUD,
         "--listen", f"unix:@{name}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stderr is not None
        proc.stderr.readline()  # "Listening on @NAME as 3."
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(30)
            start = time.monotonic()
            client.connect(b"\0" + name.encode())
            client.sendall(b"T\x02")
            prelude = client.recv(4)
            size = int.from_bytes(prelude[1:4], "big")
            got = 0
            while got < size:
                got += len(client.recv(size - got))
            return time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smi-delay", type=float, default=0.5)
    parser.add_argument("--before", metavar="TREE", help="also run the daemon from this source tree, in turn")
    parser.add_argument("--case", choices=["nvml"], help="the nvml case alone")
    options = parser.parse_args()
    if shutil.which("systemd-socket-activate") is None:
        raise SystemExit("activation.py: needs systemd-socket-activate (package systemd)")
    with tempfile.TemporaryDirectory(prefix="atopgpud-activation-") as folder:
        smi = stand_in(Path(folder), options.smi_delay)
        cases = {
            "nvml (sim library)": ["--reader", "sim"],
            "nvidia-smi (stand-in, no delay)": ["--reader", "nvidia-smi", "--nvidia-smi", str(stand_in_fast(folder))],
            f"nvidia-smi (stand-in, {options.smi_delay} s per run)": ["--reader", "nvidia-smi", "--nvidia-smi",
                                                                       str(smi)],
        }
        if options.case:
            cases = dict(list(cases.items())[:1])
        print(f"activation -> first T reply, {options.runs} runs each (atop waits 2 s)")
        trees: list[str | None] = [None, options.before] if options.before else [None]
        for label, args in cases.items():
            times: dict[str | None, list[float]] = {tree: [] for tree in trees}
            for run in range(options.runs):
                for tree in trees[run % len(trees):] + trees[:run % len(trees)]:
                    times[tree].append(one_run(args, tree))
            for tree in trees:
                shown = label if tree is None else f"  {tree}"
                print(f"  {shown:40} median {statistics.median(times[tree]) * 1000:7.0f} ms   "
                      f"max {max(times[tree]) * 1000:7.0f} ms")


def stand_in_fast(folder: str) -> Path:
    fast = Path(folder) / "fast"
    fast.mkdir()
    return stand_in(fast, 0)


if __name__ == "__main__":
    main()
