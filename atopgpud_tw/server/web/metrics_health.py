"""The health and power series of ``/metrics``: read when scraped, never waited on for long.

A scrape asks the reader (`NvmlReader.health`) for each card's figures and the
XID counts, and waits at most `HEALTH_WAIT` seconds: a call stuck in the driver
delays a scrape by that long and no more, and cards whose figures are from an
earlier reading are marked (``atopgpud_gpu_health_stale 1``, and their age);
while the reader's thread is in a call the hang watchdog counts as hung, a scrape
does not wait.  A card whose reading is out is not asked again until it answers
(a stuck call piles no jobs up), and a reading younger than `FRESH` seconds is
reused.  docs/metrics.md lists the series.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from atopgpud_tw.figures import families
from atopgpud_tw.health import CardHealth
from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.base import IReader

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

        def fire(_: Any = None) -> None:
            if timer.active():
                timer.cancel()
            if not done.called:
                done.callback(None)

        timer = self.clock.callLater(self.wait, fire)
        # not cancelled after `wait`: a job late for this scrape is for the next
        DeferredList(list(self.pending.values())).addCallback(fire)
        return done

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


class HealthCollector:
    """A prometheus_client collector over a `HealthCache`, read at scrape time."""

    def __init__(self, cache: HealthCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Any] = {}
        for name, (kind, text, extra) in FAMILIES.items():
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[name] = make(name.removesuffix("_total") if kind == "counter" else name, text,
                                  labels=CARD_LABELS + list(extra))
        stale = GaugeMetricFamily("atopgpud_gpu_health_stale", "1 if the health figures shown are from an "
                                  "earlier reading: the latest did not answer in time.", labels=CARD_LABELS)
        age = GaugeMetricFamily("atopgpud_gpu_health_age_seconds", "Seconds since the health figures shown "
                                "were read.", labels=CARD_LABELS)
        xid = CounterMetricFamily("atopgpud_gpu_xid_errors", "XID critical errors the driver reported, by XID "
                                  "code, since the daemon started.", labels=CARD_LABELS + ["xid"])
        now = self.cache.clock.seconds()
        cards = {}
        for key, reading in sorted(self.cache.readings.items(), key=lambda item: item[1].busid):
            labels = [reading.busid, reading.name, reading.uuid]
            cards[key] = labels
            stale.add_metric(labels, 1 if self.cache.stale(key) else 0)
            age.add_metric(labels, max(0.0, now - self.cache.read_at[key]))
            for (series, pairs), value in reading.values.items():
                families[series].add_metric(labels + [v for _, v in pairs], value)
        events = CounterMetricFamily("atopgpud_gpu_xid_events", "XID critical errors of every code the driver "
                                     "reported since the daemon started (0 from the start, for alerts).",
                                     labels=CARD_LABELS)
        totals = dict.fromkeys(self.cache.xid_cards & set(cards), 0)
        for (key, code), count in sorted(self.cache.xids.items()):
            if key in cards:
                xid.add_metric(cards[key] + [str(code)], count)
                totals[key] = totals.get(key, 0) + count
        last = GaugeMetricFamily("atopgpud_gpu_xid_last_seconds", "When the daemon last saw an XID critical error "
                                 "of the GPU, in seconds since the epoch (absent until the first).",
                                 labels=CARD_LABELS)
        for key, count in sorted(totals.items(), key=lambda item: cards[item[0]]):
            events.add_metric(cards[key], count)
            if key in self.cache.xid_last:
                last.add_metric(cards[key], self.cache.xid_last[key])
        yield from families.values()
        yield from (xid, events, stale, age, last)


def _totals(counts: dict[tuple[str, int], int]) -> dict[str, int]:
    """XID counts of every code together, by card."""
    totals: dict[str, int] = {}
    for (key, _), count in counts.items():
        totals[key] = totals.get(key, 0) + count
    return totals


class HealthWaiting(Resource):
    """Wraps ``/metrics``: a GET first has the health figures refreshed (within the bound)."""

    isLeaf = True

    def __init__(self, inner: Resource, cache: HealthCache) -> None:
        super().__init__()
        self.inner = inner
        self.cache = cache

    def render_GET(self, request: Request) -> Any:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def send(_: Any) -> None:
            if gone:
                return  # the scraper hung up while the figures were read
            body = self.inner.render(request)
            if isinstance(body, bytes):
                request.write(body)
                request.finish()
            # else the page is written, and the request finished, by the inner resource

        def failed(failure: Any) -> None:
            log.failure("health: scrape failed", failure)
            if not gone:
                request.setResponseCode(500)
                request.finish()

        self.cache.refresh().addCallback(send).addErrback(failed)
        return NOT_DONE_YET

    def render_HEAD(self, request: Request) -> bytes:
        return self.inner.render(request)
