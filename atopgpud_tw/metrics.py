"""``/metrics``: the daemon's counters in the Prometheus text format (``--metrics``).

A `BoardCollector` reads the `Board` and the poller when Prometheus scrapes, and
only then: nobody scraping costs nothing per poll.  The page is rendered in the
reactor thread, the one thread that changes the Board, so a scrape always sees
one poll's figures whole (prometheus_client's own Twisted resource would render
in a thread pool, racing the poller).

The counters are the cumulative figures atop gets, scaled to base units:
``gpuperccum`` (a sum of per-sample percentages) times the poll interval is in
percent-seconds, so ``rate()`` of it is the average busy percentage, and the
ratio of two increases is exactly atop's figure.  A value the device cannot
report (-1 on the wire) is left out rather than exported as -1.  Every metric
is listed in docs/metrics.md.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from twisted.web.resource import EncodingResourceWrapper, Resource
from twisted.web.server import GzipEncoderFactory, Request, Site

from atopgpud_tw import __version__
from atopgpud_tw.board import Board
from atopgpud_tw.counters import DeviceTotals
from atopgpud_tw.metrics_health import HealthCache, HealthCollector, HealthWaiting

KIB = 1024
GPU_LABELS = ["index", "busid", "type"]
PROCESS_LABELS = ["index", "busid", "pid"]


class PollStatistics(Protocol):
    """What the collector needs of the poller (`PollerService` has it)."""

    polls: int
    failed_polls: dict[str, int]


def _known(value: int | None) -> bool:
    """A figure worth exporting: decided (not None) and supported (not -1)."""
    return value is not None and value >= 0


class CallStatistics(Protocol):
    """What the collector needs of the NVML hang watchdog (`HangWatchdog` has it)."""

    hung_calls: int

    def running_seconds(self) -> float: ...


class BoardCollector:
    """A prometheus_client collector over a Board, read at scrape time.

    `calls` is the NVML reader's hang watchdog; the nvidia-smi reader has none.
    """

    def __init__(
        self,
        board: Board,
        poller: PollStatistics,
        interval: float,
        processes: bool = False,
        calls: CallStatistics | None = None,
    ) -> None:
        self.board = board
        self.poller = poller
        self.interval = interval
        self.processes = processes
        self.calls = calls

    def collect(self) -> Iterator[Metric]:
        """Every family, built afresh from the Board as it is now."""
        yield from self._health()
        if self.calls is not None:
            yield GaugeMetricFamily("atopgpud_nvml_call_seconds", "Seconds the NVML call in progress has "
                                    "been running (0 between calls).", value=self.calls.running_seconds())
            yield CounterMetricFamily("atopgpud_nvml_hung_calls", "NVML calls that ran --hang-warning "
                                      "seconds or more.", value=self.calls.hung_calls)
        yield from self._gpus(self.board.counters.devices)
        if self.processes:
            yield from self._processes(self.board.counters.devices)

    def _health(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("atopgpud_build_info", "The daemon's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily("atopgpud_poll_interval_seconds", "Seconds between polls (--interval).",
                                value=self.interval)
        yield CounterMetricFamily("atopgpud_polls", "Polls that produced a reading.", value=self.poller.polls)
        failed = CounterMetricFamily("atopgpud_failed_polls", "Polls that failed, by cause.",
                                     labels=["cause"])
        for cause, count in sorted(self.poller.failed_polls.items()):
            failed.add_metric([cause], count)
        yield failed
        yield GaugeMetricFamily("atopgpud_clients_connected", "Connections from atop (or atopgpu) now open.",
                                value=len(self.board.clients))
        yield CounterMetricFamily("atopgpud_replies_cut", "S replies that left out processes to stay within "
                                  "atop's 8192-byte limit.", value=self.board.replies_cut)
        yield CounterMetricFamily("atopgpud_exited_dropped", "Exited-process reports dropped from full "
                                  "client queues (--max-exited).", value=self.board.exited_dropped)

    def _gpus(self, devices: list[DeviceTotals]) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=GPU_LABELS)

        def counter(name: str, text: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, text, labels=GPU_LABELS)

        present = gauge("atopgpud_gpu_present", "1 if the GPU was read in the last poll, 0 if it is gone.")
        busy = gauge("atopgpud_gpu_busy_percent", "GPU busy percentage of the last sample.")
        mem_busy = gauge("atopgpud_gpu_memory_busy_percent", "Memory-controller busy percentage of the last "
                         "sample.")
        used = gauge("atopgpud_gpu_memory_used_bytes", "Memory in use at the last sample.")
        total = gauge("atopgpud_gpu_memory_total_bytes", "Memory on the GPU.")
        samples = counter("atopgpud_gpu_samples", "Samples taken of the GPU (atop's gpusamples).")
        busy_cum = counter("atopgpud_gpu_busy_percent_seconds", "Per-sample GPU busy percentages summed "
                           "(atop's gpuperccum) times the poll interval.")
        mem_busy_cum = counter("atopgpud_gpu_memory_busy_percent_seconds", "Per-sample memory-controller "
                               "busy percentages summed (atop's memperccum) times the poll interval.")
        used_cum = counter("atopgpud_gpu_memory_used_byte_seconds", "Per-sample memory in use summed "
                           "(atop's memusedcum) times the poll interval.")
        for index, device in enumerate(devices):
            labels = [str(index), device.busid, device.name]
            present.add_metric(labels, 1 if device.present else 0)
            if device.present:
                # the last sample of a GPU that is gone is not "now"
                if _known(device.gpu_busy_now):
                    busy.add_metric(labels, device.gpu_busy_now)
                if _known(device.mem_busy_now):
                    mem_busy.add_metric(labels, device.mem_busy_now)
                used.add_metric(labels, device.memory_used_kib * KIB)
            total.add_metric(labels, device.memory_total_kib * KIB)
            samples.add_metric(labels, device.samples)
            if _known(device.gpu_busy_cum):
                busy_cum.add_metric(labels, device.gpu_busy_cum * self.interval)
            if _known(device.mem_busy_cum):
                mem_busy_cum.add_metric(labels, device.mem_busy_cum * self.interval)
            used_cum.add_metric(labels, device.memory_used_cum_kib * KIB * self.interval)
        yield from (present, busy, mem_busy, used, total, samples, busy_cum, mem_busy_cum, used_cum)

    def _processes(self, devices: list[DeviceTotals]) -> Iterator[Metric]:
        memory = GaugeMetricFamily("atopgpud_process_memory_used_bytes", "GPU memory the process used at its "
                                   "last sample.", labels=PROCESS_LABELS)
        samples = CounterMetricFamily("atopgpud_process_samples", "Samples in which the process was seen on "
                                      "the GPU.", labels=PROCESS_LABELS)
        busy = CounterMetricFamily("atopgpud_process_busy_percent_seconds", "The process's per-sample GPU "
                                   "busy percentages summed, times the poll interval.", labels=PROCESS_LABELS)
        mem_busy = CounterMetricFamily("atopgpud_process_memory_busy_percent_seconds", "The process's "
                                       "per-sample memory busy percentages summed, times the poll interval.",
                                       labels=PROCESS_LABELS)
        for index, device in enumerate(devices):
            for pid, totals in sorted(device.processes.items()):
                labels = [str(index), device.busid, str(pid)]
                if _known(totals.memory_now_kib):
                    memory.add_metric(labels, totals.memory_now_kib * KIB)
                samples.add_metric(labels, totals.samples)
                if _known(totals.gpu_busy_cum):
                    busy.add_metric(labels, totals.gpu_busy_cum * self.interval)
                if _known(totals.mem_busy_cum):
                    mem_busy.add_metric(labels, totals.mem_busy_cum * self.interval)
        yield from (memory, samples, busy, mem_busy)


class MetricsResource(Resource):
    """``GET /metrics``: the registry in the format the scraper asks for."""

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Request) -> bytes:
        encoder, content_type = choose_encoder(request.getHeader("accept") or "")
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return encoder(self.registry)

    def render_HEAD(self, request: Request) -> bytes:
        # no collection for a request that gets no body
        _, content_type = choose_encoder(request.getHeader("accept") or "")
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return b""


class _Index(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"atopgpud: Prometheus metrics are at /metrics\n"


class MetricsSite(Site):
    """The metrics web site, without an access-log line per scrape."""

    noisy = False

    def log(self, request: Request) -> None:
        pass  # a scrape every few seconds is not worth a log line


def make_registry(
    board: Board,
    poller: PollStatistics,
    interval: float,
    processes: bool = False,
    calls: CallStatistics | None = None,
    health: HealthCache | None = None,
) -> CollectorRegistry:
    """A registry holding only this daemon's collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BoardCollector(board, poller, interval, processes, calls))
    if health is not None:
        registry.register(HealthCollector(health))
    return registry


def make_site(
    board: Board,
    poller: PollStatistics,
    interval: float,
    processes: bool = False,
    calls: CallStatistics | None = None,
    health: HealthCache | None = None,
) -> Site:
    """The web site served on ``--metrics``: ``/metrics``, gzip when asked for."""
    root = Resource()
    root.putChild(b"", _Index())
    metrics: Resource = MetricsResource(make_registry(board, poller, interval, processes, calls, health))
    if health is not None:
        metrics = HealthWaiting(metrics, health)  # health figures read first, within a bound
    root.putChild(b"metrics", EncodingResourceWrapper(metrics, [GzipEncoderFactory()]))
    site = MetricsSite(root)
    site.displayTracebacks = False
    return site
