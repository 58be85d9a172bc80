#!/usr/bin/env python3
"""How close the cumulative average comes to the truth for bursty GPU load.

    python bench/fidelity.py [--seconds 60] [--seeds 5] [--behaviours all]

For each timeline (sub-second bursts, repeated), each driver sample period and
each driver behaviour (jitter, late or missing samples, boundaries next to the
polls, another sample clock, process utilization listed once per call, a
sample buffer that runs dry while idle or answers NOT_FOUND for ever), the
simulator plays the timeline and the NVML reader polls it once a second
(a few milliseconds early or late) for `--seconds`, on a simulated clock (no
waiting):

- ours: the driver's sample buffer (nvmlDeviceGetSamples and process samples
  since the last poll), as the daemon does;
- point: what the reference daemon does: the rates call, which covers only
  the driver's last sample period; per process, every sample
  nvmlDeviceGetProcessUtilization returns since the newest timestamp seen is
  added to the process's sum, and the sum is divided by the polls.

It prints the cumulative average atop would compute over the run (gpuperccum /
samples, and the same for one process) against the timeline's true average,
and the worst error over the seeds (each seed: another phase of the polls
against the timeline, other jitter).  Targets: ours within 1 point of the truth
where the driver's period is at most half the poll interval; where it is
longer, ours no further from the truth than the rates call (point), which is
all a driver measuring once a period can tell.

    python bench/fidelity.py --gpm [--seconds 60] [--seeds 5]

compares, on a GPU with GPM (Hopper and later), the two figures that could
feed atop's busy counter: the sample buffer's fold (ours) and GPM's graphics
activity over each poll (readers/nvml/gpm.py), rounded to the integer atop
gets.  For each, the error of the run's average (atop's gpuperccum / samples
over the polls both have) and the worst error of one poll's figure against
the timeline's true busy share of that poll's own span (docs/fidelity.md,
"Which figure feeds atop's busy counter").
"""

from __future__ import annotations

import argparse
import random
import sys

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml import gpm as gpm_reader
from atopgpud_tw.readers.nvml.reader import NvmlReader
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


#: driver behaviours: GPU fields added to the timeline's GPU (one-offs happen 30 s in)
BEHAVIOURS = {
    "plain": {},
    "jitter 5 ms": {"sample_jitter_ms": 5},
    "one late 100 ms": {"late_samples": [[50.0, 100]]},
    "one missing": {"missing_samples": [50.0]},
    "bounds 3 ms after": {"sample_phase": 0.003},
    "bounds 3 ms before": {"sample_phase": -0.003},
    "boottime clock": {"sample_clock": "boottime"},
    "per-call processes": {"process_utilization": "per-call"},
    "dry when idle": {"idle_samples": False},
    "NOT_FOUND always": {"samples_not_found": True},
}


#: behaviours that leave the reader no sample buffer: the rates call is all there is
NO_BUFFER = ("NOT_FOUND always",)


def run(
    timeline: dict,
    period: float,
    samples: bool,
    seconds: int,
    jitter: float,
    seed: int,
    behaviour: dict | None = None,
) -> tuple[float, float, float]:
    """(true average, GPU average, process average) over the run, as atop would compute them.

    The truth is the timeline's busy share from one second before the first poll
    (what the first poll stands for) to the last poll.  `samples` False is the
    reference's method (see the module docstring).
    """
    rng = random.Random(seed)
    clock = [0.0]
    fields = dict(behaviour or {})
    if fields.get("sample_phase", 0) < 0:
        fields["sample_phase"] += period  # just before a boundary that falls on a poll
    gpu = {
        "gpu_timeline": timeline,
        "sample_period": period,
        "samples_supported": samples,
        "processes": [{"pid": 4242, "memory_mib": 1, "sm_timeline": timeline}],
        **fields,
    }
    scenario = parse_scenario({"gpus": [gpu]})
    nvml = simulated_binding(scenario, clock=lambda: clock[0])
    reader = NvmlReader(nvml, reactor=None)
    reader.open()
    counters = Counters()
    # the driver's buffer has a past, as on a running host; with a behaviour at
    # the period boundaries, the polls fall on them
    phase = 20.0 + (0.0 if "sample_phase" in fields else rng.uniform(0.0, 1.0))
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


def run_gpm(timeline: dict, period: float, seconds: int, jitter: float, seed: int) -> dict[str, float]:
    """The errors of the fold and of GPM's graphics activity on one run (percentage points)."""
    rng = random.Random(seed)
    clock = [0.0]
    scenario = parse_scenario({"gpus": [{"gpu_timeline": timeline, "sample_period": period, "gpm": True}]})
    reader = NvmlReader(simulated_binding(scenario, clock=lambda: clock[0]), reactor=None)
    reader.open()
    spec = scenario.gpus[0].gpu_timeline
    phase = 20.0 + rng.uniform(0.0, 1.0)
    times = [phase + second + rng.uniform(-jitter, jitter) for second in range(seconds + 1)]
    fold, gpm, truths = [], [], []
    # the busy figure as the fold has it, GPM's figures beside it
    gpm_reader.WHOLE_CARD_BUSY_FROM_GPM = False
    for before, when in zip(times, times[1:]):
        clock[0] = when
        device = reader.read(when)[0].devices[0]
        graphics = None if device.gpm is None else device.gpm.get("graphics")
        if graphics is None or device.gpu_busy is None:
            continue  # the first poll: GPM has no figure yet
        fold.append(device.gpu_busy)
        gpm.append(round(graphics))
        truths.append(spec.percent(before, when))
    reader.close()
    gpm_reader.WHOLE_CARD_BUSY_FROM_GPM = True
    truth = sum(truths) / len(truths)
    return {
        "fold run": abs(sum(fold) / len(fold) - truth),
        "gpm run": abs(sum(gpm) / len(gpm) - truth),
        "fold poll": max(abs(f - t) for f, t in zip(fold, truths)),
        "gpm poll": max(abs(g - t) for g, t in zip(gpm, truths)),
    }


def cases(periods: str) -> list[tuple[str, dict, float, float]]:
    """Every timeline at every driver period of `periods` (seconds, comma-separated): its name, its
    spec, its true average and the period."""
    each = [float(p) for p in periods.split(",")]
    found = []
    for name, timeline in TIMELINES.items():
        # the true long-run busy percentage: the simulator's own, over one period
        spells = Timeline(timeline["period"], tuple(map(tuple, timeline["busy"])), timeline.get("level", 100))
        average = spells.percent(0.0, spells.period)
        found += [(name, timeline, average, period) for period in each]
    return found


def main_gpm(args: argparse.Namespace) -> int:
    print(f"{args.seconds} s per run, {args.seeds} seeds, polls +-{args.jitter * 1000:.0f} ms; errors in "
          "percentage points (worst over seeds): of the run's average, and of one poll against its own span")
    print(f"{'timeline':36} {'period':>6} {'truth':>6} {'fold run':>8} {'GPM run':>8} {'fold poll':>9} "
          f"{'GPM poll':>8}")
    for name, timeline, average, period in cases(args.periods):
        worst = {"fold run": 0.0, "gpm run": 0.0, "fold poll": 0.0, "gpm poll": 0.0}
        for seed in range(args.seeds):
            for key, value in run_gpm(timeline, period, args.seconds, args.jitter, seed).items():
                worst[key] = max(worst[key], value)
        print(f"{name:36} {period:6.3f} {average:6.2f} {worst['fold run']:8.2f} {worst['gpm run']:8.2f} "
              f"{worst['fold poll']:9.2f} {worst['gpm poll']:8.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--periods", default="0.1667,0.5,1,1.3", help="driver sample periods, seconds")
    parser.add_argument("--jitter", type=float, default=0.004, help="poll jitter, +- seconds")
    parser.add_argument("--behaviours", default="all", help="comma-separated names, or all: " + ", ".join(BEHAVIOURS))
    parser.add_argument("--gpm", action="store_true", help="compare the fold with GPM's graphics activity")
    args = parser.parse_args()
    if args.gpm:
        return main_gpm(args)
    names = list(BEHAVIOURS) if args.behaviours == "all" else args.behaviours.split(",")
    missed = []
    print(f"{args.seconds} s per run, {args.seeds} seeds, polls +-{args.jitter * 1000:.0f} ms; "
          "errors in percentage points (worst over seeds)")
    print(f"{'timeline':36} {'period':>6} {'behaviour':18} {'truth':>6} {'ours GPU':>8} {'ours proc':>9} "
          f"{'point GPU':>9} {'point proc':>10}")
    for name, timeline, average, period in cases(args.periods):
        for behaviour in names:
            errors = {"ours": [0.0, 0.0], "point": [0.0, 0.0]}
            for seed in range(args.seeds):
                for method, samples in (("ours", True), ("point", False)):
                    truth, gpu, proc = run(
                        timeline, period, samples, args.seconds, args.jitter, seed, BEHAVIOURS[behaviour]
                    )
                    worst = errors[method]
                    worst[0] = max(worst[0], abs(gpu - truth))
                    worst[1] = max(worst[1], abs(proc - truth))
            ours, point = errors["ours"], errors["point"]
            if period <= 0.5 and behaviour not in NO_BUFFER:
                bad = max(ours) > 1.0
            else:
                bad = ours[0] > max(1.0, point[0]) or ours[1] > max(1.0, point[1])
            if bad:
                missed.append(f"{name}, {period} s, {behaviour}")
            print(f"{name:36} {period:6.3f} {behaviour:18} {average:6.2f} {ours[0]:8.2f} {ours[1]:9.2f} "
                  f"{point[0]:9.2f} {point[1]:10.2f}{'  MISSED' if bad else ''}")
    print(f"targets missed: {len(missed)}")
    for line in missed:
        print(f"  {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
