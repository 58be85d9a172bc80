"""Checking a password against its bcrypt hash, at a bounded cost (``basic_auth_users``).

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
from twisted.cred.credentials import IUsernamePassword
from twisted.cred.error import UnauthorizedLogin
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog

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
