#!/usr/bin/env python3
"""What GPM adds to a poll: the NVML reader over the simulator, with and without GPM.

    .venv/bin/python bench/gpmcost.py [--cards 8] [--instances 0] [--polls 300]

Each card is an H200 busy a quarter of every 200 ms; with ``--instances N`` each
card is in MIG mode with N GPU instances.  The reader polls on a simulated clock
that advances one second per poll (no waiting); the CPU time per poll is
printed for the same host without ``gpm`` and with it.  The simulator's own
work is in both: the difference is what GPM costs through the real binding
(two GPM calls per card or GPU instance per poll, the metrics request's 12
entries written and read).
"""

from __future__ import annotations

import argparse
import time

from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding


def host(cards: int, instances: int, gpm: bool) -> dict:
    gpus = []
    for index in range(cards):
        gpu: dict = {"name": "NVIDIA H200", "busid": f"00000000:{0x17 + index:02X}:00.0",
                     "gpu_timeline": {"period": 0.2, "busy": [[0, 0.05]]}, "gpm": gpm}
        if instances:
            gpu["mig"] = [{"profile": "1g.18gb", "memory_total_mib": 18000, "gpu_instance": i + 1,
                           "gpu_util": 10 * i} for i in range(instances)]
        gpus.append(gpu)
    return {"gpus": gpus}


def per_poll(cards: int, instances: int, gpm: bool, polls: int) -> float:
    clock = [0.0]
    reader = NvmlReader(simulated_binding(parse_scenario(host(cards, instances, gpm)), clock=lambda: clock[0]),
                        reactor=None)
    reader.open()
    for second in range(1, 6):  # warm up: streams and buffers made
        clock[0] = float(second)
        reader.read(clock[0])
    began = time.process_time()
    for second in range(6, 6 + polls):
        clock[0] = float(second)
        reader.read(clock[0])
    took = (time.process_time() - began) / polls
    reader.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--instances", type=int, default=0)
    parser.add_argument("--polls", type=int, default=300)
    args = parser.parse_args()
    without = per_poll(args.cards, args.instances, False, args.polls)
    with_gpm = per_poll(args.cards, args.instances, True, args.polls)
    sources = args.cards * max(1, args.instances)
    print(f"{args.cards} cards, {args.instances} GPU instances each, {args.polls} polls: CPU per poll "
          f"{without * 1000:.2f} ms without GPM, {with_gpm * 1000:.2f} ms with it "
          f"(+{(with_gpm - without) * 1e6 / sources:.0f} us per GPM source)")


if __name__ == "__main__":
    main()
