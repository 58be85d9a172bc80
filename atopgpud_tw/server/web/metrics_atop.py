"""atop's own busy sums on ``/metrics``: ``gpuperccum`` and ``memperccum`` exactly as ``S`` gives them.

The ``*_percent_seconds`` series weigh each sample by the seconds it covers
(rates over wall-clock time, right when polls run late); atop instead divides
the increase of a sum of one percentage per sample by that of ``gpusamples``.
These two counters are those sums, so that
``increase(..._percent_sum_total) / increase(atopgpud_gpu_samples_total)`` (or
the differences of two scrapes, as etc/prometheus's recording rules take
them) is atop's figure for any span, whatever the polls did.  They change only
when a poll is folded in, so they belong to the page's polled part.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from atopgpud_tw.server.atop.board import Board

GPU_LABELS = ["index", "busid", "type", "uuid"]


class AtopSumsCollector:
    """The busy sums of every GPU, read from the Board at scrape time."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        busy = CounterMetricFamily("atopgpud_gpu_busy_percent_sum", "Per-sample GPU busy percentages summed "
                                   "(atop's gpuperccum): its increase over that of the samples is atop's figure.",
                                   labels=GPU_LABELS)
        mem = CounterMetricFamily("atopgpud_gpu_memory_busy_percent_sum", "Per-sample memory-controller busy "
                                  "percentages summed (atop's memperccum).", labels=GPU_LABELS)
        for index, device in enumerate(self.board.counters.devices):
            labels = [str(index), device.busid, device.name, device.info.uuid]
            # -1 (the GPU cannot report it) has no series; None: not decided yet
            if device.gpu_busy_cum is not None and device.gpu_busy_cum >= 0:
                busy.add_metric(labels, device.gpu_busy_cum)
            if device.mem_busy_cum is not None and device.mem_busy_cum >= 0:
                mem.add_metric(labels, device.mem_busy_cum)
        yield from (busy, mem)
