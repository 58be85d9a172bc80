"""GPU Performance Monitoring on ``/metrics``: exact cumulative counters per GPU and per MIG instance.

Each poll's GPM figures are exact averages over the seconds between two GPM
samples (readers/nvml/gpm.py); `counters.GpmTotals` sums them times those
seconds.  So ``rate()`` of a ``*_percent_seconds`` counter is the true average
percentage over the range, and ``rate()`` of a ``*_bytes`` counter the bytes
per second, whatever the polls did; ``rate(atopgpud_gpu_gpm_seconds_total)`` is
the share of the time GPM covered (1 while every poll's sample worked).  A
device without GPM has none of these series, and a host without GPM none of
the families.  They change only when a poll is folded in: the page's polled part.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from atopgpud_tw.figures import GPM_FIGURES
from atopgpud_tw.server.atop.board import Board

GPU_LABELS = ["index", "busid", "type", "uuid"]
#: figure -> (series name, help), one family per row of the table's GPM rows (figures.GPM_FIGURES), in
#: their order
SERIES = tuple((f.gpm.name, f.family.name.removesuffix("_total"), f.family.help)
               for f in GPM_FIGURES if f.gpm is not None)
#: the percentages, summed as percent-seconds, and the MiB/s, summed as bytes
PERCENTS = tuple(s for s, f in zip(SERIES, GPM_FIGURES) if f.gpm is not None and not f.gpm.rate)
BYTES = tuple(s for s, f in zip(SERIES, GPM_FIGURES) if f.gpm is not None and f.gpm.rate)


class GpmCollector:
    """The GPM sums of every GPU and MIG instance that has them, read from the Board at scrape time."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        devices = [(index, d) for index, d in enumerate(self.board.counters.devices) if d.gpm is not None]
        if not devices:
            return
        seconds = CounterMetricFamily("atopgpud_gpu_gpm_seconds", "Seconds GPM's figures cover (each poll's "
                                      "span between two GPM samples), summed.", labels=GPU_LABELS)
        families = [
            (name, CounterMetricFamily(series, text, labels=GPU_LABELS)) for name, series, text in SERIES
        ]
        for index, device in devices:
            totals = device.gpm
            assert totals is not None
            labels = [str(index), device.busid, device.name, device.info.uuid]
            seconds.add_metric(labels, totals.seconds)
            for name, family in families:
                if name in totals.sums:
                    family.add_metric(labels, totals.sums[name])
        yield seconds
        yield from (family for _, family in families)
