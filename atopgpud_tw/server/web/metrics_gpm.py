"""GPU Performance Monitoring on ``/metrics``: exact cumulative counters per GPU and per MIG instance.

Each poll's GPM figures are exact averages over the seconds between two GPM
samples (readers/nvml/gpm.py); `gpm_counters.GpmTotals` sums them times those
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

from atopgpud_tw.server.atop.board import Board

GPU_LABELS = ["index", "busid", "type", "uuid"]
#: figure -> (series name, what it is): percentages summed as percent-seconds
PERCENTS = (
    ("graphics", "atopgpud_gpu_gpm_graphics_percent_seconds", "graphics or compute activity (any engine busy)"),
    ("sm", "atopgpud_gpu_gpm_sm_active_percent_seconds", "SM activity (the share of SMs busy)"),
    ("sm_occupancy", "atopgpud_gpu_gpm_sm_occupancy_percent_seconds", "SM occupancy (warps resident of the most)"),
    ("tensor", "atopgpud_gpu_gpm_tensor_active_percent_seconds", "tensor pipe activity (any tensor operation)"),
    ("dram", "atopgpud_gpu_gpm_dram_bandwidth_percent_seconds", "DRAM bandwidth used of the most"),
    ("fp64", "atopgpud_gpu_gpm_fp64_active_percent_seconds", "FP64 pipe activity (not tensor)"),
    ("fp32", "atopgpud_gpu_gpm_fp32_active_percent_seconds", "FP32 pipe activity (not tensor)"),
    ("fp16", "atopgpud_gpu_gpm_fp16_active_percent_seconds", "FP16 pipe activity (not tensor)"),
)
#: figure -> (series name, what it is): MiB/s summed as bytes
BYTES = (
    ("pcie_tx", "atopgpud_gpu_gpm_pcie_transmit_bytes", "PCIe bytes sent by the GPU"),
    ("pcie_rx", "atopgpud_gpu_gpm_pcie_receive_bytes", "PCIe bytes received by the GPU"),
    ("nvlink_tx", "atopgpud_gpu_gpm_nvlink_transmit_bytes", "NVLink bytes written, all links"),
    ("nvlink_rx", "atopgpud_gpu_gpm_nvlink_receive_bytes", "NVLink bytes read, all links"),
)


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
            (name, CounterMetricFamily(series, f"GPM: {text}, exact over each poll, times the seconds it covers, "
                                       "summed: rate() is the average percentage.", labels=GPU_LABELS))
            for name, series, text in PERCENTS
        ] + [
            (name, CounterMetricFamily(series, f"GPM: {text}, exact over each poll, summed.", labels=GPU_LABELS))
            for name, series, text in BYTES
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
