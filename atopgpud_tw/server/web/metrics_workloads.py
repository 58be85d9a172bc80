"""On ``/metrics`` (``--workloads``): each workload's exact GPU time, by GPU (workloads.py).

Collected with the GPU series, once per poll; the families are listed in
docs/metrics.md ("Workloads").
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from atopgpud_tw.counters import Counters
from atopgpud_tw.server.web.metrics_health import HealthCache
from atopgpud_tw.workloads import WorkloadBook

KIB = 1024
WORKLOAD_LABELS = ["index", "busid", "uuid", "kind", "workload"]
ENERGY = ("atopgpud_gpu_energy_joules_total", ())


def card_energy(counters: Counters, health: HealthCache | None) -> dict[int, float]:
    """Each whole card's energy counter as last read with the health figures, by device index."""
    if health is None:
        return {}
    found = {}
    for index, device in enumerate(counters.devices):
        reading = health.readings.get(device.key)
        if reading is not None and not reading.lost:
            joules = reading.values.get(ENERGY)  # type: ignore[call-overload]
            if joules is not None:
                found[index] = float(joules)
    return found


class WorkloadCollector:
    """The workload families, from a `WorkloadBook`."""

    def __init__(self, book: WorkloadBook, health: HealthCache | None = None) -> None:
        self.book = book
        self.health = health

    def collect(self) -> Iterator[Metric]:
        book = self.book
        devices = book.counters.devices
        rows = book.rows()
        book.share_energy(card_energy(book.counters, self.health), rows)

        def counter(name: str, text: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, text, labels=WORKLOAD_LABELS)

        busy = counter("atopgpud_workload_busy_percent_seconds", "The GPU busy percent-seconds of the "
                       "workload's processes on the GPU, exited ones included: rate() is its busy percentage.")
        mem_busy = counter("atopgpud_workload_memory_busy_percent_seconds", "The memory busy percent-seconds "
                           "of the workload's processes on the GPU, exited ones included.")
        memory = counter("atopgpud_workload_memory_used_byte_seconds", "The GPU memory times seconds held by "
                         "the workload's processes on the GPU, exited ones included.")
        seen = counter("atopgpud_workload_processes", "The workload's processes seen on the GPU.")
        ended = counter("atopgpud_workload_processes_ended", "The workload's processes that ended on the GPU.")
        energy = counter("atopgpud_workload_energy_joules", "The GPU's energy shared out to the workload by its "
                         "share of the GPU busy time of the GPU's processes (docs/metrics.md).")
        shown = 0
        for row in rows:
            sums = row.sums
            if sums.device_index >= len(devices):
                continue
            shown += 1
            device = devices[sums.device_index]
            labels = [str(sums.device_index), device.busid, device.info.uuid, sums.kind, sums.name]
            busy.add_metric(labels, row.busy)
            mem_busy.add_metric(labels, row.mem_busy)
            memory.add_metric(labels, row.memory_kib * KIB)
            seen.add_metric(labels, sums.seen)
            ended.add_metric(labels, sums.ended)
            energy.add_metric(labels, sums.energy_joules)
        yield from (busy, mem_busy, memory, seen, ended, energy)
        yield GaugeMetricFamily("atopgpud_workload_series", "Workload series on the page, other included "
                                "(--workload-limit bounds the named ones; the rest are summed under "
                                "workload=\"other\").", value=shown)
        yield CounterMetricFamily("atopgpud_workloads_expired", "Workloads that left the page after "
                                  "--workload-expiry seconds without a process; their sums went into "
                                  "workload=\"other\".", value=book.expired)
