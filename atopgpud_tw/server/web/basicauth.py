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

A bcrypt check costs tens of milliseconds of CPU by design, so it never runs in
the reactor's thread, which serves atop (docs/metrics.md, "What a password
costs"): `PasswordChecks` runs them in a pool of `THREADS` daemon threads (bcrypt
lets go of the GIL), at most `MAX_PENDING` running or queued, beyond that "busy"
(503) at once, the places shared fairly by client (`access.peer_key`).  A verdict
is kept `CACHE_SECONDS` under a SHA-256 of the user, the stored hash and the
password, a right one renewed by each use; checks of the same credentials at once
share one run.  Credentials once found right are checked again in a thread of
their own, outside the bound, so a flood of wrong passwords never stands in the
real scraper's way.  An unknown user, or a password over `MAX_PASSWORD` bytes (no
bcrypt hash can be of it), is refused without a check.  Stopping waits for no
check (`_Pool`): SIGTERM with checks pending exits at once.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable

import bcrypt
from twisted.cred.checkers import ICredentialsChecker
from twisted.cred.credentials import IUsernamePassword, UsernamePassword
from twisted.cred.error import LoginFailed, UnauthorizedLogin
from twisted.cred.portal import IRealm, Portal
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.guard import BasicCredentialFactory
from twisted.web.resource import IResource, Resource, getChildForRequest
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.system.access import address_name
from atopgpud_tw.server.web.metrics import plain
from atopgpud_tw.server.web.webbounds import Bursts
from atopgpud_tw.server.web.webconfig import WebConfig

THREADS = 2
MAX_PENDING = 8
CACHE_SECONDS = 60.0
CACHE_ENTRIES = 1024
#: the longest password bcrypt hashes, in bytes
MAX_PASSWORD = 72


class _Pool(ThreadPool):
    """A thread pool whose stop waits for nobody: daemon threads, not joined; work still queued is dropped."""

    threadFactory = functools.partial(threading.Thread, daemon=True)  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = threading.Event()

    def stop(self) -> None:
        self.stopping.set()  # a queued check sees it and returns at once
        self.joined = True  # no new work
        self.started = False
        self._team.quit()  # idle workers end; a busy one ends after its check, and the process need not wait


class Busy(Exception):
    """Too many checks pending: try again (503)."""


@implementer(ICredentialsChecker)
class PasswordChecks:
    """bcrypt checks in a bounded pool of their own, their verdicts cached a while; `twisted.cred`'s
    checker of `users` (a login's avatar id: the user name; `Busy` or `UnauthorizedLogin` when refused)."""

    credentialInterfaces = (IUsernamePassword,)
    log = ClassLogger("atopgpud_tw.passwords.PasswordChecks")

    def __init__(self, reactor: Any, threads: int = THREADS, max_pending: int = MAX_PENDING,
                 cache_seconds: float = CACHE_SECONDS, now: Callable[[], float] = time.monotonic) -> None:
        self.reactor = reactor
        self.max_pending = max_pending
        self.cache_seconds = cache_seconds
        self.now = now
        self.threads = threads
        self.pool, self.known_pool = self._pools()
        #: the keys of credentials found right since the users last changed, oldest first
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self.pending: dict[bytes, Deferred[bool | None]] = {}
        self.pending_known: dict[bytes, Deferred[bool | None]] = {}
        #: for each check in `pending`, oldest first: the peer it is counted to, and what skips it
        self.owners: dict[bytes, tuple[str, threading.Event]] = {}
        self.verdicts: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self.checked = 0
        self.refused = 0
        self._started = False
        self._failed = BurstLog(reactor)
        #: the users and their hashes `requestAvatarId` checks against
        self.users: dict[str, bytes] = {}

    def requestAvatarId(self, credentials: Any) -> Deferred[bytes | tuple[()]]:
        """`twisted.cred`: the user's name if the password is right (the client's address, when the
        credentials carry one as `peer`, is whom a pending check is counted to)."""
        user = credentials.username
        verdict = self.check(user, credentials.password, self.users, getattr(credentials, "peer", ""))
        if isinstance(verdict, Deferred):
            return verdict.addCallback(_avatar, user)
        return maybeDeferred(_avatar, verdict, user)

    def _pools(self) -> tuple[_Pool, _Pool]:
        """The checking pool, and the one for credentials once found right: one thread, no bound
        but the number of such credentials."""
        return (_Pool(minthreads=0, maxthreads=self.threads, name="atopgpud-bcrypt"),
                _Pool(minthreads=0, maxthreads=1, name="atopgpud-bcrypt-known"))

    def start(self) -> None:
        if not self._started:
            self._started = True
            if self.pool.stopping.is_set():  # started again after a stop: pools of their own
                self.pool, self.known_pool = self._pools()
            self.pool.start()
            self.known_pool.start()

    def stop(self) -> None:
        self._failed.stop()
        if self._started:
            self._started = False
            self.pool.stop()
            self.known_pool.stop()

    def check(self, user: bytes, password: bytes, users: dict[str, bytes],
              peer: str = "") -> bool | Deferred[bool | None] | None:
        """True or False at once when known; a Deferred when bcrypt must run (its None: pushed out, busy);
        None when too many are pending.  `peer` (the client's address) is whom a pending check is counted to."""
        name = user.decode("utf-8", "replace")
        stored = users.get(name)
        if stored is None or not hmac.compare_digest(name.encode("utf-8", "replace"), user):
            return False  # an unknown user: no check
        if len(password) > MAX_PASSWORD:
            return False  # no bcrypt hash is of such a password
        key = hashlib.sha256(b"\0".join((user, stored, password))).digest()
        cached = self.verdicts.get(key)
        if cached is not None:
            if cached[1] > self.now():
                self.verdicts.move_to_end(key)
                if cached[0]:  # renewed by use: the scraper's verdict does not lapse while it scrapes
                    self.verdicts[key] = (True, self.now() + self.cache_seconds)
                return cached[0]
            del self.verdicts[key]
        known = key in self.known
        pending = self.pending_known if known else self.pending
        running = pending.get(key)
        if running is not None:
            return _share(running)
        if not known and len(self.pending) >= self.max_pending and not self._make_room(peer):
            self.refused += 1
            return None
        self.start()
        self.checked += 1
        pool = self.known_pool if known else self.pool
        outcome: Deferred[bool | None] = Deferred()
        pending[key] = outcome
        cancelled = threading.Event()
        if not known:
            self.owners[key] = (peer, cancelled)

        def settled(right: bool | None) -> None:
            if pending.get(key) is outcome:  # not pushed out meanwhile
                del pending[key]
                self.owners.pop(key, None)
                outcome.callback(right)

        def verdict(right: bool | None) -> None:
            if right is not None:
                self._keep(key, right)
            settled(right)

        def failed(failure: Any) -> None:
            self._failed.event(lambda: self.log.error("a bcrypt check failed: {error}",
                                                      error=failure.getErrorMessage()),
                               "bcrypt checks failed")
            settled(False)

        deferToThreadPool(self.reactor, pool, _bcrypt_check, password, stored, pool.stopping,
                          cancelled).addCallbacks(verdict, failed)
        return _share(outcome)

    def _make_room(self, peer: str) -> bool:
        """Every pending place is taken: push out the newest check of the peer holding the most, if `peer`
        holds fewer than it (so one address's flood never keeps another's check out); False if none."""
        held = Counter(owner for owner, _ in self.owners.values())
        top, most = held.most_common(1)[0] if held else ("", 0)
        if held[peer] + 1 >= most:
            return False
        victim = next(key for key in reversed(self.owners) if self.owners[key][0] == top)
        self.owners.pop(victim)[1].set()  # a queued check is skipped; one running ends unheard
        self.pending.pop(victim).callback(None)
        return True

    def _keep(self, key: bytes, right: bool) -> None:
        self.verdicts[key] = (right, self.now() + self.cache_seconds)
        while len(self.verdicts) > CACHE_ENTRIES:
            self.verdicts.popitem(last=False)
        if right:
            self.known[key] = None
            self.known.move_to_end(key)
            while len(self.known) > CACHE_ENTRIES:
                self.known.popitem(last=False)

    def forget(self) -> None:
        """Drop every cached verdict and every credential known right (the users changed)."""
        self.verdicts.clear()
        self.known.clear()


def _avatar(verdict: bool | None, user: bytes) -> bytes | tuple[()]:
    if verdict is None:
        raise Busy()
    if not verdict:
        raise UnauthorizedLogin()
    return user


def _bcrypt_check(password: bytes, stored: bytes, *skip: threading.Event) -> bool | None:
    if any(event.is_set() for event in skip):
        return None  # queued when the daemon stopped, or pushed out: nobody waits for the verdict
    # $2y$ (htpasswd's) is $2b$ by another name; bcrypt reads both, the prefix changed only for clarity
    return bcrypt.checkpw(password, stored)


def _share(source: Deferred[bool | None]) -> Deferred[bool | None]:
    """A Deferred of `source`'s verdict that leaves `source` for others to wait on."""
    shared: Deferred[bool | None] = Deferred()

    def passed(value: bool | None) -> bool | None:
        shared.callback(value)
        return value

    source.addCallback(passed)
    return shared


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
