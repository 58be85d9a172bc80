"""``/metrics``: the daemon's counters in the Prometheus text format (``--metrics``), and the site's other pages.

A `BoardCollector` reads the `Board` and the poller when Prometheus scrapes, in the reactor thread, the one
that changes the Board, so a scrape sees one poll's figures whole (prometheus_client's own Twisted resource
collects in a thread pool, racing the poller).  The counters are atop's cumulative figures in base units,
except that the ``*_seconds`` series sum each sample's figure times the seconds it covers
(`counters.Counters.fold`): ``rate()`` of them is the average busy percentage even when polls run late or
fail (atop's own sums are `atop_sums`).  A value the device cannot report (-1 on the wire) is left out, not
exported as -1.  docs/metrics.md lists every metric.

The health series are read when scraped (`HealthCache`), waited for at most `HEALTH_WAIT` seconds (a call
stuck in the driver delays a scrape that long and no more; older figures are marked stale), and not at all
while the hang watchdog counts the reader's call as hung.  `MetricsPage` renders the daemon's own figures for
every scrape, the health figures at most once per `HEALTH_TTL` seconds, and the GPU and process series
(hundreds of kilobytes with ``--metrics-processes``) in a thread once per poll and format, while the reactor
answers atop; a gzip page is compressed once for the scrapes that find the same parts.

``/-/healthy`` (also ``/healthz``) answers 200 whenever the reactor answers; ``/-/ready`` 200 once the first
poll is folded in, while the latest poll worked, the reader waits for nothing and a GPU was read in one of the
last few polls, else 503 and why on one line; ``/`` links them; any other path is a 404.
"""

from __future__ import annotations

import functools
import gzip as gzip_format
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, TypeGuard, Union

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import pages
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from atopgpud_tw import distribution_version
from atopgpud_tw.counters import Counters, DeviceTotals, ProcessTotals
from atopgpud_tw.figures import GPM_FIGURES, INFO, INVENTORY, MIG_INFO, families
from atopgpud_tw.health import CardHealth
from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.base import IReader
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.webbounds import BoundedChannel, BoundedRequest, PageWriter, WebGuard, WebLimits
from atopgpud_tw.snapshot import UNKNOWN_CONTEXT

if TYPE_CHECKING:
    from atopgpud_tw.workloads import WorkloadBook  # --workloads alone loads it

KIB = 1024
PLAIN = b"text/plain; charset=utf-8"
#: what "the seconds it covers" means, in the help text of the *_seconds series
_SPAN = " (since the previous sample, on the poll schedule: a late or failed poll makes the next sample cover more)"
GPU_LABELS = ["index", "busid", "type", "uuid"]
WORKLOAD_LABELS = ["index", "busid", "uuid", "kind", "workload"]
PROCESS_LABELS = ["index", "busid", "pid", "uuid"]
#: what --metrics-process-context adds to them
CONTEXT_LABELS = ["user", "comm", "workload"]
#: the inventory series' labels: what a card (or MIG instance) is
INFO_LABELS = list(INFO.labels)
#: figure -> (series name, help), one GPM family per GPM row of the figures table (figures.GPM_FIGURES), in
#: their order
GPM_SERIES = tuple((f.gpm.name, f.family.name.removesuffix("_total"), f.family.help)
                   for f in GPM_FIGURES if f.gpm is not None)
ENERGY = ("atopgpud_gpu_energy_joules_total", ())


class PollStatistics(Protocol):
    """What the site reads of the poller (`PollerService` has it); readiness reads ``failing`` (the cause the
    latest poll failed with), ``waiting`` (what the reader waits for, such as the NVIDIA driver) and ``unread``
    (why no GPU was read in the last few polls) when present."""

    polls: int
    failed_polls: dict[str, int]


def _known(value: int | None) -> TypeGuard[int]:
    """A figure worth exporting: decided (not None) and supported (not -1)."""
    return value is not None and value >= 0


def _gpu_labels(index: int, device: DeviceTotals) -> list[str]:
    return [str(index), device.busid, device.name, device.info.uuid]


def _add_busy_seconds(busy: CounterMetricFamily, mem_busy: CounterMetricFamily, labels: list[str],
                      totals: DeviceTotals | ProcessTotals, timed: bool, interval: float) -> None:
    """A GPU's or a process's GPU and memory busy percent-seconds, those it knows: the seconds each
    sample covers where the polls are timed, else `interval` seconds a sample."""
    if _known(totals.gpu_busy_cum):
        busy.add_metric(labels, totals.gpu_busy_seconds if timed else totals.gpu_busy_cum * interval)
    if _known(totals.mem_busy_cum):
        mem_busy.add_metric(labels, totals.mem_busy_seconds if timed else totals.mem_busy_cum * interval)


class CallStatistics(Protocol):
    """What the collector needs of the NVML hang watchdog (`HangWatchdog` has it)."""

    hung_calls: int

    def running_seconds(self) -> float: ...


class BoardCollector:
    """A prometheus_client collector over a Board, read at scrape time; `calls`: the NVML reader's hang watchdog."""

    def __init__(
        self,
        board: Board,
        poller: PollStatistics,
        interval: float,
        processes: bool = False,
        calls: CallStatistics | None = None,
        process_context: bool = False,
    ) -> None:
        self.board = board
        self.poller = poller
        self.interval = interval
        self.processes = processes
        self.calls = calls
        #: per-process series labelled with their user, comm and workload (--metrics-process-context)
        self.process_context = process_context
        #: how the workload label names a process's workload (--workloads; "auto" when off)
        self.grouping = "auto"

    def collect(self) -> Iterator[Metric]:
        """Every family, built afresh from the Board as it is now."""
        yield from self.live()
        yield from self.polled()

    def polled(self) -> Iterator[Metric]:
        """The families that change only when a poll is folded in."""
        yield from self._gpus(self.board.counters.devices)
        if self.processes:
            yield from self._processes(self.board.counters.devices)

    def live(self) -> Iterator[Metric]:
        """The families that may change between polls (clients, a call in progress)."""
        info = GaugeMetricFamily("atopgpud_build_info", "The daemon's version.", labels=["version"])
        info.add_metric([distribution_version()], 1)
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
        yield GaugeMetricFamily("atopgpud_exited_queued", "Exited-process reports queued for clients, all "
                                "clients together.", value=sum(len(q.entries) for q in self.board.clients))
        yield GaugeMetricFamily("atopgpud_clients_behind", "Clients whose exited processes did not all fit in "
                                "their latest reply (the rest go in their next ones).",
                                value=len(self.board.behind))
        if self.calls is not None:
            yield GaugeMetricFamily("atopgpud_nvml_call_seconds", "Seconds the NVML call in progress has "
                                    "been running (0 between calls).", value=self.calls.running_seconds())
            yield CounterMetricFamily("atopgpud_nvml_hung_calls", "NVML calls that ran --hang-warning "
                                      "seconds or more.", value=self.calls.hung_calls)

    def _gpus(self, devices: list[DeviceTotals]) -> Iterator[Metric]:
        gauge = functools.partial(GaugeMetricFamily, labels=GPU_LABELS)
        counter = functools.partial(CounterMetricFamily, labels=GPU_LABELS)
        present = gauge("atopgpud_gpu_present", "1 if the GPU was read in the last poll, 0 if it is gone.")
        busy = gauge("atopgpud_gpu_busy_percent", "GPU busy percentage of the last sample.")
        mem_busy = gauge("atopgpud_gpu_memory_busy_percent", "Memory-controller busy percentage of the last "
                         "sample.")
        used = gauge("atopgpud_gpu_memory_used_bytes", "Memory in use at the last sample.")
        total = gauge("atopgpud_gpu_memory_total_bytes", "Memory on the GPU.")
        free = gauge("atopgpud_gpu_memory_free_bytes", "Memory free at the last sample, as the driver reports "
                     "it (total less used and reserved).")
        reserved = gauge("atopgpud_gpu_memory_reserved_bytes", "Memory the driver reserves for itself at the "
                         "last sample (not in used; where the driver reports it).")
        samples = counter("atopgpud_gpu_samples", "Samples taken of the GPU (atop's gpusamples).")
        busy_cum = counter("atopgpud_gpu_busy_percent_seconds", "Each sample's GPU busy percentage times the "
                           f"seconds it covers{_SPAN}, summed: rate() is the busy percentage.")
        mem_busy_cum = counter("atopgpud_gpu_memory_busy_percent_seconds", "Each sample's memory-controller "
                               f"busy percentage times the seconds it covers{_SPAN}, summed.")
        used_cum = counter("atopgpud_gpu_memory_used_byte_seconds", "Each sample's memory in use times the "
                           f"seconds it covers{_SPAN}, summed.")
        timed, interval = self.board.counters.timed, self.interval
        info = GaugeMetricFamily(INFO.name, INFO.help, labels=INFO_LABELS)
        mig_info = GaugeMetricFamily(MIG_INFO.name, MIG_INFO.help, labels=list(MIG_INFO.labels))
        for index, device in enumerate(devices):
            labels = _gpu_labels(index, device)
            what = device.info
            shown = {row.label: getattr(what, row.attribute) for row in INVENTORY}
            info.add_metric([str(index), device.busid, what.uuid, device.name,
                             *(shown[label] for label in INFO_LABELS[4:])], 1)
            if what.parent_uuid or what.gpu_instance:
                mig_info.add_metric([str(index), device.busid, what.uuid, what.parent_uuid, what.gpu_instance,
                                     what.compute_instance, what.mig_profile], 1)
            present.add_metric(labels, 1 if device.present else 0)
            if device.present:
                # the last sample of a GPU that is gone is not "now"
                if _known(device.gpu_busy_now):
                    busy.add_metric(labels, device.gpu_busy_now)
                if _known(device.mem_busy_now):
                    mem_busy.add_metric(labels, device.mem_busy_now)
                used.add_metric(labels, device.memory_used_kib * KIB)
                if device.memory_free_kib is not None:
                    free.add_metric(labels, device.memory_free_kib * KIB)
                if device.memory_reserved_kib is not None:
                    reserved.add_metric(labels, device.memory_reserved_kib * KIB)
            total.add_metric(labels, device.memory_total_kib * KIB)
            samples.add_metric(labels, device.samples)
            _add_busy_seconds(busy_cum, mem_busy_cum, labels, device, timed, interval)
            kib_seconds = device.memory_used_kib_seconds if timed else device.memory_used_cum_kib * interval
            used_cum.add_metric(labels, kib_seconds * KIB)
        yield from (info, mig_info, present, busy, mem_busy, used, total, free, reserved, samples, busy_cum,
                    mem_busy_cum, used_cum)

    def _processes(self, devices: list[DeviceTotals]) -> Iterator[Metric]:
        names = PROCESS_LABELS + CONTEXT_LABELS if self.process_context else PROCESS_LABELS
        memory = GaugeMetricFamily("atopgpud_process_memory_used_bytes", "GPU memory the process used at its "
                                   "last sample.", labels=names)
        samples = CounterMetricFamily("atopgpud_process_samples", "Samples in which the process was seen on "
                                      "the GPU.", labels=names)
        busy = CounterMetricFamily("atopgpud_process_busy_percent_seconds", "Each sample's GPU busy percentage "
                                   f"of the process times the seconds it covers{_SPAN}, summed.",
                                   labels=names)
        mem_busy = CounterMetricFamily("atopgpud_process_memory_busy_percent_seconds", "Each sample's memory "
                                       f"busy percentage of the process times the seconds it covers{_SPAN}, "
                                       "summed.", labels=names)
        counters = self.board.counters
        timed, interval = counters.timed and counters.weigh_processes, self.interval
        for index, device in enumerate(devices):
            for pid, totals in sorted(device.processes.items()):
                labels = [str(index), device.busid, str(pid), device.info.uuid]
                if self.process_context:
                    # who it is (--metrics-process-context): its user, comm and workload
                    context = totals.context or UNKNOWN_CONTEXT
                    kind, name = context.workload(self.grouping)
                    labels += [context.user_name, context.comm, f"{kind}:{name}"]
                if _known(totals.memory_now_kib):
                    memory.add_metric(labels, totals.memory_now_kib * KIB)
                samples.add_metric(labels, totals.samples)
                _add_busy_seconds(busy, mem_busy, labels, totals, timed, interval)
        yield from (memory, samples, busy, mem_busy)


log = Logger(namespace="atopgpud_tw.metrics_health")

#: seconds a scrape waits for the figures it asked for
HEALTH_WAIT = 2.0
#: a reading this young is shown again rather than read again
FRESH = 0.5
CARD_LABELS = ["busid", "type", "uuid"]

#: metric -> (type, help, extra labels), in the order the page lists them: the table of figures' families
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    name: (family.kind, family.help, family.labels) for name, family in families().items()
}


class HealthCache:
    """The latest health reading of each card, refreshed when a scrape asks."""

    def __init__(self, source: IReader, clock: IReactorTime, wait: float = HEALTH_WAIT,
                 wall: Callable[[], float] = time.time) -> None:
        self.source = source
        #: the time of day, for when an XID was seen (the reactor's clock is monotonic)
        self.wall = wall
        self.clock = clock
        self.wait = wait
        self.readings: dict[str, CardHealth] = {}
        self.read_at: dict[str, float] = {}
        self.xids: dict[tuple[str, int], int] = {}
        #: the cards that report XID events
        self.xid_cards: set[str] = set()
        #: when each card's XID count last went up (the time of day, seconds since the epoch)
        self.xid_last: dict[str, float] = {}
        #: cards (and "xid") whose reading is out, by key
        self.pending: dict[str, Deferred] = {}
        self._problems: dict[str, ProblemLog] = {}
        #: readings whose job raised (a bug, or a binding gone wrong), logged once each
        self._failing: set[str] = set()

    def refresh(self) -> Deferred:
        """Ask for fresh readings; fires (with None) when all are in, or after `wait` seconds."""
        now = self.clock.seconds()
        offered: set[str] = set()

        def wanted(key: str) -> bool:
            offered.add(key)
            return key not in self.pending and now - self.read_at.get(key, -1e9) >= FRESH

        jobs = self.source.health(wanted)
        for key in set(self.readings) - offered - set(self.pending):
            # a card the reader no longer has (NVML being set up again, a card gone for good)
            del self.readings[key], self.read_at[key]
        for key, job in jobs:
            self.pending[key] = job
            job.addCallbacks(self._stored, self._failed, callbackArgs=(key,), errbackArgs=(key,))
        if "xid" not in self.pending:
            counting = self.source.xid_counts()
            if counting is not None:
                self.pending["xid"] = counting
                counting.addCallbacks(self._counted, self._failed, errbackArgs=("xid",))
        watchdog = self.source.watchdog
        if not self.pending or watchdog is not None and watchdog.running_seconds() >= min(watchdog.after, self.wait):
            return succeed(None)  # nothing to wait for, or the jobs queue behind a hung call (its watchdog says)
        done: Deferred = Deferred()
        # the jobs are not cancelled after `wait`: a job late for this scrape is for the next
        DeferredList(list(self.pending.values())).addCallback(lambda _: None if done.called else done.callback(None))
        return done.addTimeout(self.wait, self.clock, onTimeoutCancel=lambda result, timeout: None)

    def _stored(self, reading: CardHealth, key: str) -> None:
        self.pending.pop(key, None)
        self._failing.discard(key)
        self.readings[key] = reading
        self.read_at[key] = self.clock.seconds()
        self._problems.setdefault(key, ProblemLog("health", self.clock.seconds)).report(reading.problems)

    def _counted(self, outcome: tuple[dict[tuple[str, int], int], set[str]]) -> None:
        self.pending.pop("xid", None)
        self._failing.discard("xid")
        before = _totals(self.xids)
        self.xids, self.xid_cards = outcome
        for key, count in _totals(self.xids).items():
            if count > before.get(key, 0):
                self.xid_last[key] = self.wall()

    def _failed(self, failure: Any, key: str) -> None:
        self.pending.pop(key, None)
        if key not in self._failing:  # once until it works again, not at every scrape
            self._failing.add(key)
            log.failure("health: reading {key} failed", failure, key=key)

    def stale(self, key: str) -> bool:
        """Whether the figures shown for a card are older than the reading asked for."""
        return key in self.pending


def health_families(cache: HealthCache) -> Iterator[Metric]:
    """The health families of the cards `cache` holds, read at scrape time."""
    families: dict[str, Any] = {}
    for name, (kind, text, extra) in FAMILIES.items():
        make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily  # a counter drops its _total
        families[name] = make(name, text, labels=CARD_LABELS + list(extra))
    stale = GaugeMetricFamily("atopgpud_gpu_health_stale", "1 if the health figures shown are from an "
                              "earlier reading: the latest did not answer in time.", labels=CARD_LABELS)
    age = GaugeMetricFamily("atopgpud_gpu_health_age_seconds", "Seconds since the health figures shown "
                            "were read.", labels=CARD_LABELS)
    xid = CounterMetricFamily("atopgpud_gpu_xid_errors", "XID critical errors the driver reported, by XID "
                              "code, since the daemon started.", labels=CARD_LABELS + ["xid"])
    now = cache.clock.seconds()
    cards = {}
    for key, reading in sorted(cache.readings.items(), key=lambda item: item[1].busid):
        labels = [reading.busid, reading.name, reading.uuid]
        cards[key] = labels
        stale.add_metric(labels, 1 if cache.stale(key) else 0)
        age.add_metric(labels, max(0.0, now - cache.read_at[key]))
        for (series, pairs), value in reading.values.items():
            families[series].add_metric(labels + [v for _, v in pairs], value)
    events = CounterMetricFamily("atopgpud_gpu_xid_events", "XID critical errors of every code the driver "
                                 "reported since the daemon started (0 from the start, for alerts).",
                                 labels=CARD_LABELS)
    for (key, code), count in sorted(cache.xids.items()):
        if key in cards:
            xid.add_metric(cards[key] + [str(code)], count)
    totals = {**dict.fromkeys(cache.xid_cards, 0), **_totals(cache.xids)}
    last = GaugeMetricFamily("atopgpud_gpu_xid_last_seconds", "When the daemon last saw an XID critical error "
                             "of the GPU, in seconds since the epoch (absent until the first).",
                             labels=CARD_LABELS)
    for key in sorted(set(totals) & set(cards), key=cards.__getitem__):
        events.add_metric(cards[key], totals[key])
        if key in cache.xid_last:
            last.add_metric(cards[key], cache.xid_last[key])
    yield from families.values()
    yield from (xid, events, stale, age, last)


def _totals(counts: dict[tuple[str, int], int]) -> dict[str, int]:
    """XID counts of every code together, by card."""
    totals: dict[str, int] = {}
    for (key, _), count in counts.items():
        totals[key] = totals.get(key, 0) + count
    return totals


def atop_sums(board: Board) -> Iterator[Metric]:
    """atop's own busy sums, ``gpuperccum`` and ``memperccum`` exactly as ``S`` gives them: the increase of
    either over that of ``gpusamples`` is atop's figure for any span, whatever the polls did."""
    busy = CounterMetricFamily("atopgpud_gpu_busy_percent_sum", "Per-sample GPU busy percentages summed "
                               "(atop's gpuperccum): its increase over that of the samples is atop's figure.",
                               labels=GPU_LABELS)
    mem = CounterMetricFamily("atopgpud_gpu_memory_busy_percent_sum", "Per-sample memory-controller busy "
                              "percentages summed (atop's memperccum).", labels=GPU_LABELS)
    for index, device in enumerate(board.counters.devices):
        if _known(device.gpu_busy_cum):
            busy.add_metric(_gpu_labels(index, device), device.gpu_busy_cum)
        if _known(device.mem_busy_cum):
            mem.add_metric(_gpu_labels(index, device), device.mem_busy_cum)
    yield from (busy, mem)


def gpm_families(board: Board) -> Iterator[Metric]:
    """GPM's exact sums per GPU and MIG instance that has GPM (`counters.GpmTotals`: each poll's exact
    averages times the seconds they cover, so rate() is exact whatever the polls did); none without GPM."""
    devices = board.counters.devices
    if all(device.gpm is None for device in devices):
        return
    seconds = CounterMetricFamily("atopgpud_gpu_gpm_seconds", "Seconds GPM's figures cover (each poll's "
                                  "span between two GPM samples), summed.", labels=GPU_LABELS)
    families = [(name, CounterMetricFamily(series, text, labels=GPU_LABELS)) for name, series, text in GPM_SERIES]
    for index, device in enumerate(devices):
        if (totals := device.gpm) is not None:
            labels = _gpu_labels(index, device)
            seconds.add_metric(labels, totals.seconds)
            for name, family in families:
                if name in totals.sums:
                    family.add_metric(labels, totals.sums[name])
    yield seconds
    yield from (family for _, family in families)


def card_energy(counters: Counters, health: HealthCache | None) -> dict[int, float]:
    """Each whole card's energy counter as last read with the health figures, by device index."""
    found = {}
    for index, device in enumerate(counters.devices):
        reading = None if health is None else health.readings.get(device.key)
        joules = None if reading is None or reading.lost else reading.values.get(ENERGY)  # type: ignore[call-overload]
        if joules is not None:
            found[index] = float(joules)
    return found


def workload_families(book: WorkloadBook, health: HealthCache | None = None) -> Iterator[Metric]:
    """``--workloads``: each workload's exact GPU time, by GPU (workloads.py)."""
    devices = book.counters.devices
    rows = book.rows()
    book.share_energy(card_energy(book.counters, health), rows)

    counter = functools.partial(CounterMetricFamily, labels=WORKLOAD_LABELS)
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


Encoder = Callable[[Any], bytes]
InThread = Callable[[Callable[[], "Rendered"]], "Deferred[Rendered]"]

_EOF = b"# EOF\n"
_GZIP_LEVEL = 6  # level 9 costs 3 to 8 times the CPU for the same size on these pages
#: seconds one rendering of the health part serves every scrape
HEALTH_TTL = 0.5


@dataclass(frozen=True)
class Rendered:
    """A part in one format: the polled part of the poll `stamp` (its generation), or the health part
    rendered at `stamp` (the clock's time)."""

    stamp: float | None
    text: bytes


class Collector(Protocol):
    """What the encoders read: a registry, or anything with `collect`."""

    def collect(self) -> Iterable[Metric]: ...


@dataclass(frozen=True)
class Families:
    """Families a function makes, as a collector."""

    collect: Callable[[], Iterable[Metric]]


class MetricsPage:
    """The page in each format: bytes, or a Deferred of them while the polled part of a new poll is rendered."""

    def __init__(
        self,
        live: Collector,
        polled: Collector | None = None,
        generation: Callable[[], int] | None = None,
        in_thread: InThread | None = None,
        health: Collector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = live
        self.health = health
        self.clock = clock
        #: the health part per format
        self._health: dict[str, Rendered] = {}
        self.polled = polled
        self.generation = generation
        self.in_thread: InThread = in_thread or (lambda render: succeed(render()))
        self._cache: dict[str, Rendered] = {}
        self._pending: dict[tuple[str, int | None], list[Deferred[Rendered]]] = {}
        #: per format, the last gzip page and the parts it was made of
        self._gzipped: dict[str, tuple[tuple[Any, ...], bytes]] = {}

    def render(self, encoder: Encoder, content_type: str, gzip: bool) -> Union[bytes, Deferred[bytes]]:
        """The page in the format of `encoder`, gzip-compressed if asked."""
        head = encoder(self.live)
        if self.health is not None or self.polled is not None:
            head = head.removesuffix(_EOF)  # OpenMetrics ends once, after the last part
        parts: list[Any] = [head]
        if self.health is not None:
            parts.append(self._health_part(encoder, content_type))
        if self.polled is None:
            return self._join(parts, content_type, gzip)
        polled = self._polled(encoder, content_type)
        if isinstance(polled, Rendered):
            return self._join([*parts, polled], content_type, gzip)
        return polled.addCallback(lambda rendered: self._join([*parts, rendered], content_type, gzip))

    def _join(self, parts: list[Any], content_type: str, gzip: bool) -> bytes:
        """The page from its parts (the fresh text, then renderings), plain or gzip-compressed."""
        page = b"".join(part if isinstance(part, bytes) else part.text for part in parts)
        if not gzip:
            return page
        key = tuple(parts)  # renderings kept are the same objects: compared at once
        kept = self._gzipped.get(content_type)
        if kept is None or kept[0] != key:
            kept = self._gzipped[content_type] = (key, gzip_format.compress(page, _GZIP_LEVEL, mtime=0))
        return kept[1]

    def _health_part(self, encoder: Encoder, content_type: str) -> Rendered:
        assert self.health is not None
        now = self.clock()
        cached = self._health.get(content_type)
        if cached is not None and 0 <= now - (cached.stamp or 0) < HEALTH_TTL:
            return cached
        text = encoder(self.health)
        self._health[content_type] = Rendered(now, text.removesuffix(_EOF) if self.polled is not None else text)
        return self._health[content_type]

    def _polled(self, encoder: Encoder, content_type: str) -> Union[Rendered, Deferred[Rendered]]:
        generation = self.generation() if self.generation is not None else None
        cached = self._cache.get(content_type)
        if cached is not None and generation is not None and cached.stamp == generation:
            return cached
        key = (content_type, generation)
        waiter: Deferred[Rendered] = Deferred()
        self._pending.setdefault(key, []).append(waiter)
        if len(self._pending[key]) > 1:
            return waiter  # that rendering is under way
        assert self.polled is not None
        families = list(self.polled.collect())  # here, in the reactor thread: one poll's figures

        def render() -> Rendered:
            return Rendered(generation, encoder(Families(lambda: families)))

        self.in_thread(render).addBoth(self._rendered, key, content_type)
        return waiter

    def _rendered(self, result: Rendered | Failure, key: tuple[str, int | None], content_type: str) -> None:
        if isinstance(result, Rendered):
            cached = self._cache.get(content_type)
            if cached is None or cached.stamp is None or (result.stamp or 0) >= cached.stamp:
                self._cache[content_type] = result
        for waiter in self._pending.pop(key, []):
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)


_ACCEPTS_GZIP = re.compile(rb"(?:^|[\s,])gzip(?:$|[\s,;])")
#: pages above this are written as the client reads them, a chunk at a time
_PRODUCED = 4 * PageWriter.chunk


class MetricsResource(Resource):
    """``GET /metrics``: the page in the format the scraper asks for, gzip if it accepts it; with `health`,
    once the health figures are refreshed (within the bound)."""

    isLeaf = True
    log = ClassLogger("atopgpud_tw.metrics.MetricsResource")

    def __init__(self, page: MetricsPage | Collector, health: HealthCache | None = None) -> None:
        super().__init__()
        self.page = page if isinstance(page, MetricsPage) else MetricsPage(page)
        self.health = health

    def render_GET(self, request: Request) -> bytes | int:
        lost: list[object] = []
        request.notifyFinish().addErrback(lost.append)
        if self.health is None:
            return self._render(request, lost)

        def send(_: Any) -> None:
            body = None if lost else self._render(request, lost)  # lost: the scraper hung up meanwhile
            if isinstance(body, bytes):
                request.write(body)
                request.finish()
            # else the page is written, and the request finished, as it is rendered

        self.health.refresh().addCallback(send).addErrback(self._failed, request, lost, log, "health: scrape failed")
        return NOT_DONE_YET

    @staticmethod
    def _failed(failure: Failure, request: Request, lost: list[object], logger: Logger, text: str) -> None:
        logger.failure(text, failure)
        if not lost:
            request.setResponseCode(500)
            request.finish()

    def _render(self, request: Request, lost: list[object]) -> bytes | int:
        encoder, content_type = choose_encoder(request.getHeader("accept") or "")
        gzip = bool(_ACCEPTS_GZIP.search(request.getHeader(b"accept-encoding") or b""))
        page = self.page.render(encoder, content_type, gzip)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        if gzip:
            request.setHeader(b"content-encoding", b"gzip")
        if isinstance(page, bytes) and len(page) <= _PRODUCED:
            return page

        def send(body: bytes) -> None:
            if lost:
                return  # the client left while the page was rendered
            # a big page (--metrics-processes) goes out as fast as the client takes it,
            # rather than all at once into the transport's buffer
            request.setHeader(b"content-length", str(len(body)).encode("ascii"))
            PageWriter(request, body).start()

        if isinstance(page, bytes):
            send(page)
        else:
            page.addCallbacks(send, self._failed, errbackArgs=(request, lost, self.log,
                                                               "rendering the metrics page failed"))
        return NOT_DONE_YET

    def render_HEAD(self, request: Request) -> bytes:
        # no collection for a request that gets no body
        _, content_type = choose_encoder(request.getHeader("accept") or "")
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return b""


def not_ready(poller: PollStatistics) -> str | None:
    """Why the daemon is not ready to be scraped, in a few words; None when it is."""
    failing: str | None = getattr(poller, "failing", None)
    if failing is not None:
        return f"the reader is failing: {failing}"
    waiting: str | None = getattr(poller, "waiting", None)
    if waiting is not None:
        return waiting
    if poller.polls == 0:
        return "waiting for the first poll"
    return getattr(poller, "unread", None)


def plain(request: Request, text: str) -> bytes:
    request.setHeader(b"content-type", PLAIN)
    request.setHeader(b"cache-control", b"no-store")
    return text.encode("utf-8", "replace")


class Healthy(Resource):
    """``GET /-/healthy``: 200 while the process serves."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return plain(request, "atopgpud is healthy\n")


class Ready(Resource):
    """``GET /-/ready``: 200 once the first poll is done and the reader is not failing, else 503 and why."""

    isLeaf = True

    def __init__(self, poller: PollStatistics) -> None:
        super().__init__()
        self.poller = poller

    def render_GET(self, request: Request) -> bytes:
        reason = not_ready(self.poller)
        if reason is None:
            return plain(request, "atopgpud is ready\n")
        request.setResponseCode(503)
        return plain(request, f"atopgpud is not ready: {' '.join(reason.split())}\n")


_INDEX = b"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>atopgpud</title></head>
<body><h1>atopgpud</h1>
<ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="-/healthy">/-/healthy</a>: 200 while the daemon serves</li>
<li><a href="-/ready">/-/ready</a>: 200 once it has polled its GPUs, else 503 and why</li>
</ul>
</body></html>
"""


class Index(Resource):
    """``GET /``: a small page linking the others."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return _INDEX


class Folder(Resource):
    """A path with children: itself and any child it lacks are 404s."""

    def getChild(self, path: bytes, request: Request) -> IResource:
        return pages.notFound()

    def render(self, request: Request) -> bytes | int:
        return pages.notFound().render(request)  # type: ignore[no-any-return]


def make_root(metrics: IResource, poller: PollStatistics) -> Resource:
    """The site's tree: ``/``, ``/metrics``, ``/-/healthy``, ``/healthz``, ``/-/ready``."""
    root = Folder()
    root.putChild(b"", Index())
    root.putChild(b"metrics", metrics)
    healthy = Healthy()
    dash = Folder()
    dash.putChild(b"healthy", healthy)
    dash.putChild(b"ready", Ready(poller))
    root.putChild(b"-", dash)
    root.putChild(b"healthz", healthy)
    return root


class MetricsSite(Site):
    """The metrics web site within `WebLimits`, without an access-log line per scrape."""

    noisy = False
    protocol = BoundedChannel  # type: ignore[assignment]  # Twisted types it as a callable
    requestFactory = BoundedRequest

    def __init__(self, resource: Resource, limits: WebLimits, clock: IReactorTime) -> None:
        super().__init__(resource, reactor=clock)
        self.guard = WebGuard(limits, clock)

    def buildProtocol(self, addr: Any) -> Any:
        if not self.guard.room():
            return None  # the socket is closed before a transport is made for it: the cheapest no
        channel = super().buildProtocol(addr)
        channel.guard = self.guard
        return channel

    def stopFactory(self) -> None:
        self.guard.stop()
        super().stopFactory()

    def log(self, request: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


def make_site(
    board: Board,
    poller: PollStatistics,
    interval: float,
    processes: bool = False,
    calls: CallStatistics | None = None,
    limits: WebLimits | None = None,
    clock: IReactorTime | None = None,
    in_thread: InThread | None = None,
    health: HealthCache | None = None,
    workloads: WorkloadBook | None = None,
    process_context: bool = False,
) -> Site:
    """The site on ``--metrics``: ``/metrics`` and the other pages (`make_root`); `in_thread` runs the
    encoding of the polled part (default: in the reactor's thread pool)."""
    collector = BoardCollector(board, poller, interval, processes, calls, process_context)
    if workloads is not None:
        collector.grouping = workloads.grouping
    reactor: Any = clock
    if reactor is None:
        from twisted.internet import reactor
    def polled() -> Iterator[Metric]:
        yield from collector.polled()
        yield from atop_sums(board)
        yield from gpm_families(board)
        if workloads is not None:
            yield from workload_families(workloads, health)

    page = MetricsPage(  # the health part read when scraped (at most every HEALTH_TTL)
        Families(collector.live), Families(polled), lambda: board.counters.generation,
        in_thread or (lambda render: deferToThreadPool(reactor, reactor.getThreadPool(), render)),
        None if health is None else Families(lambda: health_families(health)), reactor.seconds,
    )
    metrics = MetricsResource(page, health)
    site = MetricsSite(make_root(metrics, poller), limits or WebLimits(), reactor)  # with /, /-/healthy, /-/ready
    site.displayTracebacks = False
    return site
