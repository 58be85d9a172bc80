"""Basic authentication and the rate limit on the metrics listener: the site's root under ``--web-config``.

`Protected` answers 429 beyond ``rate_limit`` (a token bucket, as the
toolkit's), sets ``http_server_config.headers``, then passes the request on or
answers 401 or 503 (too many password checks pending), for every page.  The
password is checked through `twisted.cred` (``twisted.web.guard``'s header
decoding, a `Portal` over the bcrypt checker, `Protected` its realm).
``twisted.web.guard.HTTPAuthSessionWrapper`` does not serve: it makes any login
failure but a refusal a 500 (the checker's "busy" must be a 503 with
``Retry-After``), and has no place for the rate limit, the headers, the client's
address the checks are queued by, or the damped log lines.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.cred.credentials import UsernamePassword
from twisted.cred.error import LoginFailed, UnauthorizedLogin
from twisted.cred.portal import IRealm, Portal
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.guard import BasicCredentialFactory
from twisted.web.resource import IResource, Resource, getChildForRequest
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.server.system.access import address_name
from atopgpud_tw.server.web.metrics import plain
from atopgpud_tw.server.web.passwords import MAX_PASSWORD, Busy, PasswordChecks
from atopgpud_tw.server.web.webbounds import Bursts
from atopgpud_tw.server.web.webconfig import WebConfig

_BASIC = BasicCredentialFactory(b"atopgpud")


class Credentials(UsernamePassword):
    """A user and password, and the address of the client that gave them (the checks are queued by it)."""

    def __init__(self, username: bytes, password: bytes, peer: str = "") -> None:
        super().__init__(username, password)
        self.peer = peer


def credentials(request: Request) -> UsernamePassword | None:
    """The user and password of a request's ``Authorization: Basic`` header; None without one."""
    scheme, _, encoded = (request.getHeader(b"authorization") or b"").partition(b" ")
    if scheme.lower() != _BASIC.scheme:
        return None
    try:
        return _BASIC.decode(encoded.strip(), request)  # type: ignore[no-any-return]
    except LoginFailed:
        return None


class _Answer(Resource):
    """A short plain-text reply: 401, 429 or 503."""

    isLeaf = True

    def __init__(self, code: int, text: str, headers: dict[bytes, bytes]) -> None:
        super().__init__()
        self.code = code
        self.text = text
        self.headers = headers

    def render(self, request: Request) -> bytes:
        request.setResponseCode(self.code)
        for name, value in self.headers.items():
            request.setHeader(name, value)
        return plain(request, self.text)


UNAUTHORIZED = _Answer(401, "Unauthorized\n", {b"www-authenticate": b'Basic realm="atopgpud"'})
TOO_MANY = _Answer(429, "Too Many Requests\n", {b"retry-after": b"1"})
BUSY = _Answer(503, "Too many password checks at once; try again\n", {b"retry-after": b"1"})


class TokenBucket:
    """``rate_limit``: `burst` tokens, one more every `interval` seconds; a request takes one."""

    def __init__(self, interval: float, burst: int, clock: IReactorTime) -> None:
        self.interval = interval
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.stamp = clock.seconds()

    def take(self) -> bool:
        now = self.clock.seconds()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) / self.interval)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class _Waiting(Resource):
    """The request while its password is checked: rendered once the answer (a resource) is in."""

    isLeaf = True

    def __init__(self, answer: Deferred[IResource]) -> None:
        super().__init__()
        self.answer = answer

    def render(self, request: Request) -> Any:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        self.answer.addCallback(lambda answer: None if gone else request.render(answer))
        return NOT_DONE_YET


@implementer(IResource, IRealm)
class Protected:
    """The site's root under a web configuration: headers, then basic auth, then `inner`'s pages (the realm's
    one avatar)."""

    isLeaf = False
    log = ClassLogger("atopgpud_tw.basicauth.Protected")

    def __init__(self, inner: IResource, config: WebConfig, checks: PasswordChecks, clock: IReactorTime) -> None:
        self.inner = inner
        self.checks = checks
        self.clock = clock
        self._config = config
        checks.users = dict(config.users)
        self.portal = Portal(self, [checks])
        self.bucket = self._bucket(config)
        self.bursts = Bursts(clock, self.log)

    @property
    def config(self) -> WebConfig:
        return self._config

    @config.setter
    def config(self, config: WebConfig) -> None:
        if config.rate_limit != self._config.rate_limit:
            self.bucket = self._bucket(config)
        if config.users != self._config.users:
            self.checks.forget()
            self.checks.users = dict(config.users)
        self._config = config

    def requestAvatar(self, avatarId: Any, mind: Any, *interfaces: Any) -> tuple[Any, IResource, Callable[[], None]]:
        """The realm's side of a login: every user gets the site."""
        return IResource, self.inner, lambda: None

    def _bucket(self, config: WebConfig) -> TokenBucket | None:
        if config.rate_limit is None:
            return None
        return TokenBucket(config.rate_limit[0], config.rate_limit[1], self.clock)

    def getChildWithDefault(self, name: bytes, request: Request) -> IResource:
        config = self.config
        if self.bucket is not None and not self.bucket.take():
            self.bursts.cut("metrics requests answered 429 (rate_limit)",
                            "answering metrics requests 429: over rate_limit")
            return TOO_MANY  # before a password is checked, as the toolkit has it
        for header, value in config.headers.items():
            request.setHeader(header.encode("ascii"), value.encode("utf-8"))
        if not config.users:
            return self.inner.getChildWithDefault(name, request)
        given = credentials(request)
        if given is None:
            return UNAUTHORIZED  # a first request without a password is no refusal worth a line

        if len(given.password) > MAX_PASSWORD:
            self.bursts.cut("metrics requests refused: password too long", "refusing metrics requests from {peer}: "
                            "a password of {size} bytes, over bcrypt's {most}", peer=self._peer(request),
                            size=len(given.password), most=MAX_PASSWORD)
            return UNAUTHORIZED
        # the checks are queued fairly by whom the connection is counted to (else by address)
        peer = getattr(getattr(request, "channel", None), "peer", None) or self._peer(request)
        login = self.portal.login(Credentials(given.username, given.password, peer), None, IResource)
        refused = self._refused(request, given.username)
        now: list[Any] = []
        login.addBoth(now.append)
        if now:  # a verdict known (or refused) at once: no waiting
            return self._answer(now[0], refused, lambda site: site.getChildWithDefault(name, request))
        return _Waiting(login.addCallback(lambda _: self._answer(
            now[0], refused, lambda site: getChildForRequest(site.getChildWithDefault(name, request), request))))

    def _answer(self, login: Any, refused: Callable[[], None], page: Callable[[IResource], IResource]) -> IResource:
        """What a login's outcome answers: the page, 503 (checks busy) or 401."""
        if not isinstance(login, Failure):
            return page(login[1])
        if login.check(Busy):
            self.bursts.cut("metrics requests answered 503 (password checks pending)",
                            "answering metrics requests 503: {count} password checks already pending",
                            count=len(self.checks.pending))
            return BUSY
        if not login.check(UnauthorizedLogin):
            self.log.failure("a password check failed", login)
        refused()
        return UNAUTHORIZED

    @staticmethod
    def _peer(request: Request) -> str:
        return address_name(request.getClientAddress())

    def _refused(self, request: Request, user: bytes) -> Callable[[], None]:
        peer = self._peer(request)
        return lambda: self.bursts.cut("metrics requests refused: wrong password", "refusing metrics requests from "
                                       "{peer}: wrong user name or password (user {user!r})", peer=peer,
                                       user=user.decode("utf-8", "replace"))

    def putChild(self, path: bytes, child: IResource) -> None:
        self.inner.putChild(path, child)

    def render(self, request: Request) -> Any:
        return self.inner.render(request)

    def stop(self) -> None:
        self.bursts.stop()
