"""Every driver behaviour through the installed daemon, each on a pair of GPUs of its own.

One daemon on the simulator, polling once a second as it does on a real host:
a client asks `S` twice, several seconds apart, and atop's arithmetic over that
interval (differences of cumulative counters over differences of samples) must
be within 1 point of the constant load for GPU busy, memory busy and every
process; every "now" figure seen in between within 2 points.
"""

from __future__ import annotations

import time

from daemon import run_daemon
from driver_behaviours import LOADS, behaviours, gpus

from atopgpud_tw import codec

#: the one-off behaviours (a late or a missing sample) happen this far into the run
ONE_OFF_AT = 4.0


def test_every_behaviour_through_the_installed_daemon(tmp_path):
    names = list(behaviours())
    cards = []
    for index, name in enumerate(names):
        cards.extend(gpus(name, at=ONE_OFF_AT, first=2 * index))
    loads = list(LOADS.values())
    with run_daemon(tmp_path, ["--interval", "1"], scenario={"gpus": cards}) as daemon:
        client = daemon.client()
        daemon.wait_samples(2)
        # atopgpu's request: all 40 GPUs, where atop is sent the first 32
        wide = codec.WIDE_REQUEST
        first = client.stats(wide)
        nows = []
        deadline = time.monotonic() + 7.5
        while time.monotonic() < deadline:
            time.sleep(0.5)
            nows.append(client.stats(wide))
        last = client.stats(wide)
        client.close()
        assert len(first) == len(last) == 2 * len(names)
        for index, (before, after) in enumerate(zip(first, last)):
            gpu_busy, mem_busy, procs = loads[index % 2]
            where = f"{names[index // 2]}, GPU {index % 2}"
            samples = after.samples - before.samples
            assert samples >= 5, where
            assert abs((after.gpu_busy_cum - before.gpu_busy_cum) / samples - gpu_busy) <= 1, where
            assert abs((after.mem_busy_cum - before.mem_busy_cum) / samples - mem_busy) <= 1, where
            earlier = {p.pid: p for p in before.processes}
            assert sorted(p.pid for p in after.processes) == sorted(procs), where
            for proc in after.processes:
                old = earlier[proc.pid]
                busy = (proc.gpu_busy - old.gpu_busy) / (proc.samples - old.samples)
                assert abs(busy - procs[proc.pid]) <= 1, f"{where}: pid {proc.pid} at {busy}"
            for stats in nows:
                device = stats[index]
                assert abs(device.gpu_busy_now - gpu_busy) <= 2, f"{where}: now {device.gpu_busy_now}"
                assert abs(device.mem_busy_now - mem_busy) <= 2, f"{where}: now {device.mem_busy_now}"
