"""The metrics web server's bounds: what one HTTP client, and all of them, may take.

twisted.web alone holds a client for as long as it trickles header bytes, spools
a request body of any size to a file, and answers pipelined requests whether or
not the client reads the replies; the reactor that serves atop must not pay for
that.  `BoundedChannel` caps the connections, gives a request's head a deadline,
takes no body beyond a few bytes (none chunked; in memory), and answers a client
that does not read one reply at a time, ending the connection when a reply stays
unread past a deadline (`WebLimits`); each refusal or cut is logged once per
burst.  Holding the next pipelined request reads two attributes of HTTPChannel's
flow control (``_waitingForTransport``, ``_networkProducer``, there since Twisted
17.9); tests/test_metrics_bounds.py pins the behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import Any

from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.error import UnsupportedMethod
from twisted.web.http import NOT_ALLOWED, NOT_IMPLEMENTED, HTTPChannel
from twisted.web.pages import errorPage
from twisted.web.resource import IResource
from twisted.web.server import Request, supportedMethods
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.system.access import SockDiag, peer_key, peer_name


@dataclass(frozen=True)
class WebLimits:
    """What the metrics clients may take."""

    max_clients: int = 32
    #: seconds from the first byte of a request to the end of its headers
    head_timeout: float = 10.0
    #: seconds from the end of a request's headers until the transport took its reply
    reply_timeout: float = 30.0
    #: request body bytes accepted (a scrape sends none)
    max_body: int = 1024
    #: request line and headers, bytes
    max_head: int = 8192
    #: seconds from a TLS connection's start to the end of its handshake (a scraper's takes milliseconds)
    handshake_timeout: float = 5.0
    #: TLS handshakes in flight from one peer address; a newer one closes that peer's oldest
    max_handshakes_per_peer: int = 4


class Bursts:
    """A `BurstLog` per cause: the first of each burst of refusals or cuts logged with `log`."""

    def __init__(self, clock: IReactorTime, log: Logger) -> None:
        self.clock = clock
        self.logger = log
        self._bursts: dict[str, BurstLog] = {}

    def cut(self, what: str, line: str, **fields: Any) -> None:
        """Count one refusal or cut of cause `what`; log it if it starts a burst."""
        burst = self._bursts.get(what)
        if burst is None:  # (made on a cause's first cut only: this runs on every refusal in a flood)
            burst = self._bursts[what] = BurstLog(self.clock)
        burst.event(lambda: self.logger.warn(line, **fields), what)

    def stop(self) -> None:
        for burst in self._bursts.values():
            burst.stop()


class WebGuard(Bursts):
    """The shared side of the bounds: the connections open, and a burst log per cause."""

    log = ClassLogger("atopgpud_tw.webbounds.WebGuard")

    def __init__(self, limits: WebLimits, clock: IReactorTime) -> None:
        super().__init__(clock, self.log)
        self.limits = limits
        self.channels: set[BoundedChannel] = set()
        #: per peer address, the TLS connections whose handshake is in flight, oldest first
        self.handshakes: dict[str, list[Any]] = {}
        #: tells a local TCP client's uid (`BoundedChannel.peer`)
        self.diag = SockDiag()

    def room(self) -> bool:
        """Whether another connection may open; a refusal is logged once per burst."""
        if len(self.channels) < self.limits.max_clients:
            return True
        self.cut("connections refused (--metrics-max-clients)",
                 "refusing metrics connections: {count} open (--metrics-max-clients)", count=len(self.channels))
        return False

    def stop(self) -> None:
        super().stop()
        self.diag.close()


class BoundedRequest(Request):
    """A request whose body (at most `WebLimits.max_body` bytes) is kept in memory,
    and whose method, if the resource lacks it, gets an HTML-escaped error page."""

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()  # type: ignore[assignment]  # Twisted declares it None until a body comes

    def render(self, resrc: IResource) -> None:
        super().render(_MethodsChecked(resrc))


class _MethodsChecked:
    """A resource whose missing method gets `twisted.web.pages.errorPage` (405 with ``Allow``, or 501), not
    Request.render's deprecated page that does not escape HTML; a HEAD on a GET-only one is Twisted's to fake."""

    def __init__(self, inner: IResource) -> None:
        self.inner = inner

    def render(self, request: Request) -> Any:
        try:
            return self.inner.render(request)
        except UnsupportedMethod as error:
            allowed: list[bytes] = list(error.allowedMethods)
            if request.method == b"HEAD" and b"GET" in allowed:
                raise
            method = request.method.decode("latin-1")
            if request.method not in supportedMethods:
                page = errorPage(NOT_IMPLEMENTED, "Not Implemented", f"No {method} request is served here.")
            else:
                request.setHeader(b"allow", b", ".join(allowed))
                names = ", ".join(name.decode("latin-1") for name in allowed)
                page = errorPage(NOT_ALLOWED, "Method Not Allowed", f"{method} is not allowed here, only {names}.")
            return page.render(request)


#: a deadline's cause and line, by what it waits for
_EXPIRED = {
    "head": ("metrics requests cut: headers too slow",
             "closing a metrics connection from {peer}: no request headers within {seconds} s"),
    "reply": ("metrics replies cut: left unread",
              "closing a metrics connection from {peer}: its reply unread after {seconds} s"),
    "handshake": ("metrics TLS handshakes cut: too slow",
                  "closing a metrics connection from {peer}: no TLS handshake within {seconds} s"),
}


class BoundedChannel(HTTPChannel):
    """An HTTP connection within `WebLimits`; its site has a `guard` (`WebGuard`)."""

    guard: WebGuard
    #: a connected stream transport (TCP or UNIX)
    transport: Any

    def __init__(self) -> None:
        super().__init__()
        self._deadline: Any = None
        self._awaiting_head = True
        self._held: Request | None = None
        self._cut = False
        self.peer = ""

    @property
    def limits(self) -> WebLimits:
        return self.guard.limits

    def cut(self, what: str, line: str, **fields: Any) -> None:
        """`WebGuard.cut` of a refusal or cut of this connection, its ``{peer}`` named."""
        self.guard.cut(what, line, peer=peer_name(self.transport), **fields)

    def connectionMade(self) -> None:
        self.totalHeadersSize = self.limits.max_head
        self.guard.channels.add(self)  # the site's buildProtocol made room for it
        #: whom this connection's shares are counted to (TLS handshakes, password checks): `access.peer_key`
        self.peer = peer_key(self.transport, self.guard.diag)
        super().connectionMade()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._disarm()
        self._held = None
        self.guard.channels.discard(self)
        super().connectionLost(reason)

    def dataReceived(self, data: bytes) -> None:
        if self._cut:
            return
        if self._awaiting_head and self._deadline is None:
            self._arm(self.limits.head_timeout, "head")
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._awaiting_head = False
        self._disarm()
        if self.length is None or self.length > self.limits.max_body:
            # None: chunked, of no stated size
            self._refuse_body()
            return
        self._arm(self.limits.reply_timeout, "reply")
        super().allHeadersReceived()

    def requestDone(self, request: Request) -> None:
        if self.persistent and self._waitingForTransport:
            # the client has not read the last reply: the next pipelined request
            # waits (unread, the transport paused) until it does
            self._held = request
            self._networkProducer.pauseProducing()
            return
        self._disarm()
        self._awaiting_head = True
        super().requestDone(request)

    def resumeProducing(self) -> None:
        super().resumeProducing()
        held, self._held = self._held, None
        if held is not None and not self._cut:
            self.requestDone(held)

    def _respondToBadRequestAndDisconnect(self) -> None:
        # twisted.web's answer to a malformed or oversized head: 400, then close
        self.cut("metrics requests refused: malformed",
                 "refusing a metrics request from {peer}: a malformed head, or one over {limit} bytes",
                 limit=self.limits.max_head)
        self._cut = True
        self._disarm()
        super()._respondToBadRequestAndDisconnect()

    def timeoutConnection(self) -> None:
        self.cut("idle metrics connections closed", "closing an idle metrics connection from {peer}")
        self._close()

    # -- deadlines --

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.guard.clock.callLater(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self.cut(*_EXPIRED[what], seconds=seconds)
        self._close()

    def _refuse_body(self) -> None:
        self.cut("metrics requests refused: a body",
                 "refusing a metrics request from {peer}: a body of {size} (at most {limit} bytes)",
                 size="unstated size" if self.length is None else f"{self.length} bytes", limit=self.limits.max_body)
        self._cut = True
        self.transport.write(b"HTTP/1.1 413 Content Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        self.transport.loseConnection()

    def _close(self) -> None:
        self._cut = True
        self._disarm()
        self.transport.abortConnection()


@implementer(IPushProducer)
class PageWriter:
    """Writes a body a chunk at a time while the transport takes it, then finishes
    the request: a page of megabytes sits once in memory, not again in the
    transport's buffer, and a client that stops reading stops the writing."""

    chunk = 16 * 1024

    def __init__(self, request: Request, body: bytes) -> None:
        self.request = request
        self.body = memoryview(body)
        self.offset = 0
        self.paused = False
        self.stopped = False

    def start(self) -> None:
        self.request.registerProducer(self, True)  # paused at once if the transport is full
        self._write()

    def _write(self) -> None:
        while not self.paused and not self.stopped and self.offset < len(self.body):
            piece = self.body[self.offset : self.offset + self.chunk].tobytes()
            self.offset += self.chunk
            self.request.write(piece)  # may pause us before it returns
        if self.offset >= len(self.body) and not self.stopped:
            self.stopped = True
            self.request.unregisterProducer()
            self.request.finish()

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        self._write()

    def stopProducing(self) -> None:
        self.stopped = True  # the connection is gone
