"""The metrics web server's bounds, on StringTransport and task.Clock: connections,
slow heads, bodies, unread pipelined replies, and the page rendered once per poll."""

from __future__ import annotations

import gzip
import zlib

from metrics_text import FakePoller
from snapshots import dev, proc, snap
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import make_site
from atopgpud_tw.server.web.webbounds import PageWriter, WebLimits

GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def at_once(render):
    return succeed(render())


def site_with(processes: int = 1, in_thread=at_once, **limits):
    board = Board()
    board.fold(snap(dev(processes=tuple(proc(pid) for pid in range(1, processes + 1)))))
    clock = Clock()
    site = make_site(board, FakePoller(), 1.0, processes=True, limits=WebLimits(**limits), clock=clock,
                     in_thread=in_thread)
    return site, board, clock


def connect(site):
    channel = site.buildProtocol(None)
    transport = StringTransport()
    if channel is None:  # refused: the port closes the socket
        transport.loseConnection()
        return None, transport
    channel.makeConnection(transport)
    return channel, transport


class Events(list):
    def __enter__(self) -> Events:
        globalLogPublisher.addObserver(self.append)
        return self

    def __exit__(self, *exc: object) -> None:
        globalLogPublisher.removeObserver(self.append)

    def count(self, text: str) -> int:  # type: ignore[override]
        return sum(text in e.get("log_format", "") for e in self)


def replies(transport: StringTransport) -> int:
    return transport.value().count(b"HTTP/1.1 200 OK")


def test_connections_beyond_the_cap_are_closed_one_line_per_burst():
    """Beyond --metrics-max-clients a connection is closed unread; a burst logs twice at most."""
    site, _, clock = site_with(max_clients=2)
    with Events() as events:
        kept = [connect(site) for _ in range(2)]
        refused = [connect(site) for _ in range(40)]
        clock.advance(11)
    assert all(t.disconnecting for _, t in refused)
    assert not any(t.disconnecting for _, t in kept)
    assert events.count("refusing metrics connections") == 1
    assert events.count("more {what} in that burst") == 1
    kept[0][0].connectionLost(None)
    _, transport = connect(site)
    assert not transport.disconnecting


def test_a_head_sent_slowly_is_cut_at_its_deadline():
    """A byte a second keeps no connection past the head deadline, whatever the idle timeout."""
    site, _, clock = site_with(head_timeout=10.0)
    with Events() as events:
        channels = [connect(site) for _ in range(5)]
        for second in range(12):
            for channel, _ in channels:
                channel.dataReceived(b"GET /metrics HTTP/1.1\r\nX-Slow: "[second : second + 1])
            clock.advance(1)
    assert all(t.disconnecting for _, t in channels)
    assert events.count("no request headers within") == 1


def test_a_keep_alive_connection_may_wait_between_requests():
    """The head deadline runs from a request's first byte, not from the previous reply."""
    site, _, clock = site_with(head_timeout=10.0)
    channel, transport = connect(site)
    channel.dataReceived(GET)
    clock.advance(30)
    channel.dataReceived(GET)
    assert replies(transport) == 2
    assert not transport.disconnecting


def test_a_request_body_is_refused_never_spooled():
    """A chunked body, or one larger than the limit, gets 413 and the connection closes."""
    for head in (
        b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n",
    ):
        site, _, _ = site_with(max_body=1024)
        with Events() as events:
            channel, transport = connect(site)
            channel.dataReceived(head + b"1000\r\n" + b"x" * 4096)
            channel.dataReceived(b"x" * 100_000)
        assert transport.value().startswith(b"HTTP/1.1 413 ")
        assert transport.disconnecting
        assert events.count("refusing a metrics request") == 1
        assert not channel.requests or channel.requests[-1].content is None


def test_an_oversized_head_is_refused():
    """Headers beyond the head limit get 400 and the connection closes, logged once."""
    site, _, _ = site_with(max_head=8192)
    with Events() as events:
        channel, transport = connect(site)
        channel.dataReceived(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"x" * 9000 + b"\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 400 ")
    assert transport.disconnecting
    assert events.count("a malformed head") == 1


def test_a_small_body_is_read_from_memory():
    """A request with a few body bytes is answered (405 for POST), its body in memory."""
    site, _, _ = site_with()
    channel, transport = connect(site)
    channel.dataReceived(b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
    assert b" 405 " in transport.value().split(b"\r\n")[0]


def test_pipelined_requests_wait_for_the_client_to_read():
    """A client that does not read gets one reply; the next follows only when it reads."""
    site, _, _ = site_with()
    channel, transport = connect(site)
    channel.pauseProducing()  # what the transport does when its buffer is full
    channel.dataReceived(GET * 1000)
    assert replies(transport) == 1
    assert transport.producerState == "paused"  # nothing more is read meanwhile
    channel.resumeProducing()
    assert replies(transport) == 1000  # StringTransport never pauses again


def test_a_reply_left_unread_ends_the_connection_once_logged():
    """A reply the transport could not take within the deadline closes the connection."""
    site, _, clock = site_with(reply_timeout=30.0)
    with Events() as events:
        pairs = [connect(site) for _ in range(3)]
        for channel, _ in pairs:
            channel.pauseProducing()
            channel.dataReceived(GET * 50)
        clock.advance(31)
    assert all(t.disconnecting for _, t in pairs)
    assert events.count("its reply unread") == 1


class SlowReader(StringTransport):
    """A transport that pauses its producer once 64 KiB are written and not yet taken."""

    taken = 0

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.value()) - self.taken > 64 * 1024 and self.producer is not None:
            self.producer.pauseProducing()


def test_large_pages_are_written_as_the_client_reads():
    """A big --metrics-processes page goes out a chunk at a time while the client reads."""
    site, _, _ = site_with(processes=2000)
    channel = site.buildProtocol(None)
    transport = SlowReader()
    channel.makeConnection(transport)
    channel.dataReceived(GET * 2)
    head = transport.value().partition(b"\r\n\r\n")[0]
    (length,) = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    assert length > 200_000
    batches = [len(transport.value())]
    while batches[-1]:
        transport.taken = len(transport.value())
        channel.resumeProducing()  # the client read what was written
        batches.append(len(transport.value()) - transport.taken)
    assert max(batches) <= 64 * 1024 + PageWriter.chunk
    assert len(batches) > 2 * length // (64 * 1024 + PageWriter.chunk)
    assert replies(transport) == 2
    assert transport.value().count(b"atopgpud_process_busy_percent_seconds_total{") == 4000


def scrape(site, accept: bytes = b"", encoding: bytes = b"") -> bytes:
    channel, transport = connect(site)
    headers = b"Accept: " + accept + b"\r\n" if accept else b""
    headers += b"Accept-Encoding: " + encoding + b"\r\n" if encoding else b""
    channel.dataReceived(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n" + headers + b"\r\n")
    head, _, body = transport.value().partition(b"\r\n\r\n")
    if b"content-encoding: gzip" in head.lower():
        assert zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(body) == gzip.decompress(body)
        return gzip.decompress(body)
    return body


def test_gzip_pages_are_the_plain_page_compressed():
    """A gzip page (fresh part, then the cached one) decompresses to the plain page, in each format."""
    for processes in (1, 2000):
        site, _, _ = site_with(processes=processes)
        for accept in (b"", b"application/openmetrics-text; version=1.0.0"):
            assert scrape(site, accept, b"gzip") == scrape(site, accept)
    site, _, _ = site_with()
    assert scrape(site, b"application/openmetrics-text; version=1.0.0", b"gzip").endswith(b"# EOF\n")


def test_a_gzip_page_is_compressed_once_for_the_scrapes_of_a_poll():
    """The whole page is one gzip member, compressed once: the next scrape with the same parts gets the same
    bytes without compressing again; a change of a fresh figure is compressed anew."""
    site, board, _ = site_with(processes=3)
    page = site.resource.children[b"metrics"].page
    kind = "text/plain; version=0.0.4; charset=utf-8"
    scrape(site, b"", b"gzip")
    first = page._gzipped[kind][1]
    assert scrape(site, b"", b"gzip") == gzip.decompress(first) and page._gzipped[kind][1] is first
    board.attach()
    assert b"atopgpud_clients_connected 1.0" in scrape(site, b"", b"gzip") and page._gzipped[kind][1] is not first


def test_the_polled_part_is_rendered_once_per_poll():
    """Scrapes of one poll share one rendering of the GPU series; a poll renders anew;
    the health series are fresh on every scrape."""
    site, board, _ = site_with(processes=3)
    first = scrape(site)
    board.attach()  # a client connects between polls
    second = scrape(site)
    assert b"atopgpud_clients_connected 1.0" in second
    assert first.partition(b"# HELP atopgpud_gpu_present")[2] == second.partition(b"# HELP atopgpud_gpu_present")[2]
    page = site.resource.children[b"metrics"].page
    cached = page._cache["text/plain; version=0.0.4; charset=utf-8"].text
    assert scrape(site).endswith(cached) and page._cache["text/plain; version=0.0.4; charset=utf-8"].text is cached
    board.fold(snap(dev(gpu=90, processes=(proc(1),))))
    assert b'atopgpud_gpu_busy_percent{busid' in scrape(site)
    assert page._cache["text/plain; version=0.0.4; charset=utf-8"].text is not cached


def test_scrapes_during_a_rendering_wait_for_that_one():
    """Scrapes that come while a poll's page is rendered (in a thread) share that rendering."""
    started = []

    def later(render):
        done = Deferred()
        started.append((render, done))
        return done

    site, board, _ = site_with(processes=50, in_thread=later)
    pairs = [connect(site) for _ in range(10)]
    for channel, _ in pairs:
        channel.dataReceived(GET)
    assert len(started) == 1
    assert not any(t.value() for _, t in pairs)  # nothing yet: the page is being rendered
    render, done = started.pop()
    done.callback(render())
    bodies = {t.value().partition(b"\r\n\r\n")[2] for _, t in pairs}
    assert len(bodies) == 1 and b"atopgpud_process_samples_total" in bodies.pop()
    pairs[0][0].dataReceived(GET)  # the same poll: from the cache, at once
    assert not started and replies(pairs[0][1]) == 2
    board.fold(snap(dev(gpu=90)))
    pairs[0][0].dataReceived(GET)
    assert len(started) == 1


def test_metrics_max_clients_option_reaches_the_site():
    """--metrics-max-clients sets the site's cap; its default is 32."""
    from twisted.internet.testing import MemoryReactorClock

    from atopgpud_tw import tap

    for args, cap in (([], 32), (["--metrics-max-clients", "3"], 3)):
        options = tap.Options()
        options.parseOptions(["--reader", "sim", "--listen", "unix:@test-name", "--metrics", "tcp:9445", *args])
        reactor = MemoryReactorClock()
        for child in tap.makeService(options, reactor=reactor):
            if hasattr(child, "endpoint"):
                child.startService()
        ((_, site, _, _),) = reactor.tcpServers
        assert site.guard.limits.max_clients == cap


def test_the_health_part_is_rendered_once_per_ttl_however_many_scrape():
    """Hundreds of scrapes at once cost one rendering of the GPUs' health series; the
    daemon's own figures stay fresh on every scrape; the page is the same as one
    rendered whole, plain and gzip."""
    import gzip as gzip_module

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    from atopgpud_tw.server.web.metrics import HEALTH_TTL, MetricsPage

    collected = [0]
    clients = [0]

    class Health:
        def collect(self):
            collected[0] += 1
            yield GaugeMetricFamily("atopgpud_gpu_temperature_celsius", "t", value=collected[0])

    class Own:
        def collect(self):
            yield GaugeMetricFamily("atopgpud_clients_connected", "c", value=clients[0])

    live, health = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    live.register(Own())
    health.register(Health())
    now = [100.0]
    page = MetricsPage(live, health=health, clock=lambda: now[0])
    pages = []
    for scrape_number in range(300):
        clients[0] = scrape_number
        pages.append(page.render(generate_latest, "text/plain", gzip=scrape_number % 2 == 1))
    assert collected[0] == 1
    assert b"atopgpud_clients_connected 299.0" in gzip_module.decompress(pages[-1])
    whole = CollectorRegistry(auto_describe=False)
    whole.register(Own())
    whole.register(Health())
    collected[0] = 0
    assert gzip_module.decompress(pages[-1]) == generate_latest(whole)
    now[0] += HEALTH_TTL
    page.render(generate_latest, "text/plain", gzip=False)
    assert collected[0] == 2  # counted once by `whole` above, once now
