#!/usr/bin/env python3
"""How close the cumulative average comes to the truth for bursty GPU load.

    python bench/fidelity.py [--seconds 60] [--seeds 5]

For each timeline (sub-second bursts, repeated), each driver sample period and
each amount of poll jitter, the simulator plays the timeline and the NVML reader
polls it once a second for `--seconds`, on a simulated clock (no waiting):

- ours: the driver's sample buffer (nvmlDeviceGetSamples and process samples
  since the last poll), as the daemon does;
- point: what the reference daemon does: the rates call, which covers only
  the driver's last sample period; per process, every sample
  nvmlDeviceGetProcessUtilization returns since the newest timestamp seen is
  added to the process's sum, and the sum is divided by the polls.

It prints the cumulative average atop would compute over the run (gpuperccum /
samples, and the same for one process) against the timeline's true average,
and the worst error over the seeds (each seed: another phase of the polls
against the timeline, other jitter).
"""

from __future__ import annotations

import argparse
import random
import sys

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding
from atopgpud_tw.sim.scenario import Timeline


def irregular(seed: int, seconds: float = 120.0) -> dict:
    """Bursts of 20 to 300 ms at random gaps of 50 ms to 2 s (not periodic)."""
    rng = random.Random(seed)
    busy, t = [], rng.uniform(0, 0.5)
    while t < seconds - 0.4:
        length = rng.uniform(0.02, 0.3)
        busy.append([round(t, 4), round(t + length, 4)])
        t += length + rng.uniform(0.05, 2.0)
    return {"period": seconds, "busy": busy}


TIMELINES = {
    "100 ms every 700 ms (inference)": {"period": 0.7, "busy": [[0.0, 0.1]]},
    "100 ms every 1 s": {"period": 1.0, "busy": [[0.0, 0.1]]},
    "50 ms every 500 ms": {"period": 0.5, "busy": [[0.0, 0.05]]},
    "20 ms every 250 ms (short kernels)": {"period": 0.25, "busy": [[0.0, 0.02]]},
    "300 ms every 2 s": {"period": 2.0, "busy": [[0.2, 0.5]]},
    "600 ms of each second at 80 %": {"period": 1.0, "busy": [[0.3, 0.9]], "level": 80},
    "busy but a 150 ms gap each second": {"period": 1.0, "busy": [[0.15, 1.0]]},
    "irregular bursts": irregular(7),
}


def run(
    timeline: dict, period: float, samples: bool, seconds: int, jitter: float, seed: int
) -> tuple[float, float, float]:
    """(true average, GPU average, process average) over the run, as atop would compute them.

    The truth is the timeline's busy share from one second before the first poll
    (what the first poll stands for) to the last poll.  `samples` False is the
    reference's method (see the module docstring).
    """
    rng = random.Random(seed)
    clock = [0.0]
    scenario = parse_scenario(
        {
            "gpus": [
                {
                    "gpu_timeline": timeline,
                    "sample_period": period,
                    "samples_supported": samples,
                    "processes": [{"pid": 4242, "memory_mib": 1, "sm_timeline": timeline}],
                }
            ]
        }
    )
    nvml = simulated_binding(scenario, clock=lambda: clock[0])
    reader = NvmlReader(nvml, reactor=None)
    reader.open()
    counters = Counters()
    phase = 20.0 + rng.uniform(0.0, 1.0)  # the driver's buffer has a past, as on a running host
    highstamp, reference_sum = 1000, 0
    times = [phase + second + rng.uniform(-jitter, jitter) for second in range(seconds + 1)]
    spec = scenario.gpus[0].gpu_timeline
    truth = spec.percent(times[0] - 1.0, times[-1])
    for when in times:
        clock[0] = when
        counters.fold(reader.read(clock[0])[0])
        if not samples:
            try:
                found = nvml.nvmlDeviceGetProcessUtilization(nvml.nvmlDeviceGetHandleByIndex(0), highstamp)
            except nvml.NVMLError:
                found = []
            for sample in found:
                highstamp = max(highstamp, sample.timeStamp)
                reference_sum += sample.smUtil
    device = counters.devices[0]
    process = device.processes[4242]
    if not samples:
        return truth, device.gpu_busy_total / device.samples, reference_sum / process.samples
    return truth, device.gpu_busy_total / device.samples, process.gpu_busy_cum / process.samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--periods", default="0.1667,0.5", help="driver sample periods, seconds")
    parser.add_argument("--jitter", default="0,0.01,0.05", help="poll jitter, +- seconds")
    args = parser.parse_args()
    periods = [float(p) for p in args.periods.split(",")]
    jitters = [float(j) for j in args.jitter.split(",")]
    worst_ours = 0.0
    print(f"{args.seconds} s per run, {args.seeds} seeds; errors in percentage points (worst over seeds)")
    print(f"{'timeline':38} {'period':>6} {'jitter':>6} {'average':>7} {'ours GPU':>9} {'ours proc':>9} "
          f"{'point GPU':>9} {'point proc':>10}")
    for name, timeline in TIMELINES.items():
        average = Timeline(timeline["period"], tuple(map(tuple, timeline["busy"])), timeline.get("level", 100)).average
        for period in periods:
            for jitter in jitters:
                errors = {"ours": [0.0, 0.0], "point": [0.0, 0.0]}
                for seed in range(args.seeds):
                    for method, samples in (("ours", True), ("point", False)):
                        truth, gpu, proc = run(timeline, period, samples, args.seconds, jitter, seed)
                        worst = errors[method]
                        worst[0] = max(worst[0], abs(gpu - truth))
                        worst[1] = max(worst[1], abs(proc - truth))
                worst_ours = max(worst_ours, *errors["ours"])
                print(f"{name:38} {period:6.3f} {jitter:6.3f} {average:7.2f} {errors['ours'][0]:9.2f} "
                      f"{errors['ours'][1]:9.2f} {errors['point'][0]:9.2f} {errors['point'][1]:10.2f}")
    print(f"worst error of ours: {worst_ours:.2f} percentage points")
    return 0 if worst_ours <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
