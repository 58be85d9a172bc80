"""The ``/metrics`` page, rendered once per poll and format however many scrape it.

Three parts: the daemon's own figures (polls, clients, an NVML call in progress)
are small and rendered for every scrape; the GPUs' health figures
(metrics_health.py) at most once per `HEALTH_TTL` seconds, so that hundreds of
scrapes at once cost one rendering; the GPU and process series, hundreds of
kilobytes with ``--metrics-processes``, are collected in the reactor thread (one
poll's figures, whole), then encoded in a thread once per poll and format while
the reactor answers atop, scrapes meanwhile waiting for that one rendering.  A
gzip page is compressed once and kept for the scrapes that find the same parts.
"""

from __future__ import annotations

import gzip as gzip_format
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Union

from prometheus_client.core import Metric
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

Encoder = Callable[[Any], bytes]
InThread = Callable[[Callable[[], "Rendered"]], "Deferred[Rendered]"]

_EOF = b"# EOF\n"
_GZIP_LEVEL = 6  # level 9 costs 3 to 8 times the CPU for the same size on these pages
#: seconds one rendering of the health part serves every scrape (given a clock)
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


def _at_once(render: Callable[[], Rendered]) -> Deferred[Rendered]:
    return succeed(render())


class MetricsPage:
    """The page in each format; `render` gives bytes, or a Deferred of them while
    the polled part of a new poll is being rendered."""

    def __init__(
        self,
        live: Collector,
        polled: Collector | None = None,
        generation: Callable[[], int] | None = None,
        in_thread: InThread | None = None,
        health: Collector | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.live = live
        self.health = health
        self.clock = clock
        #: the health part per format
        self._health: dict[str, Rendered] = {}
        self.polled = polled
        self.generation = generation
        self.in_thread = in_thread or _at_once
        self._cache: dict[str, Rendered] = {}
        self._pending: dict[tuple[str, int | None], list[Deferred[Rendered]]] = {}
        #: per format, the last gzip page and the parts it was made of
        self._gzipped: dict[str, tuple[tuple[Any, ...], bytes]] = {}

    def render(self, encoder: Encoder, content_type: str, gzip: bool) -> Union[bytes, Deferred[bytes]]:
        """The page in the format of `encoder`, gzip-compressed if asked."""
        head = encoder(self.live)
        if (self.health is not None or self.polled is not None) and head.endswith(_EOF):
            head = head[: -len(_EOF)]  # OpenMetrics ends once, after the last part
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
        now = self.clock() if self.clock is not None else None
        cached = self._health.get(content_type)
        if cached is not None and cached.stamp is not None and now is not None and 0 <= now - cached.stamp < HEALTH_TTL:
            return cached
        text = encoder(self.health)
        if self.polled is not None and text.endswith(_EOF):
            text = text[: -len(_EOF)]
        part = Rendered(now, text)
        if now is not None:
            self._health[content_type] = part
        return part

    def _polled(self, encoder: Encoder, content_type: str) -> Union[Rendered, Deferred[Rendered]]:
        generation = self.generation() if self.generation is not None else None
        cached = self._cache.get(content_type)
        if cached is not None and generation is not None and cached.stamp == generation:
            return cached
        key = (content_type, generation)
        waiting = self._pending.get(key)
        waiter: Deferred[Rendered] = Deferred()
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._pending[key] = [waiter]
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
