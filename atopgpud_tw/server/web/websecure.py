"""``--web-config FILE``: the metrics site under TLS, basic auth and a rate limit, re-read when the file changes.

The file is the YAML of the Prometheus exporter toolkit
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md; docs/metrics.md,
"TLS and basic authentication", has the keys and the costs), parsed as strictly as the toolkit's Go parser
(`WebConfigError`: one line).  It and its certificates are read only as regular files of at most `MAX_SIZE`
bytes (a FIFO would hang the reactor at a reload, ``/dev/zero`` fill memory).

`secure_site` reads it at start-up (a bad one: one line, exit status 2) and returns the `WebSecurity` service
that re-reads it when the file or a certificate changes and on SIGHUP; a reload that fails, or turns TLS on or
off (a port keeps its protocol), or basic auth off (a file emptied by ``> FILE``), keeps the last good
configuration, in one line.  `Contexts` hands the current TLS context to each new connection, so a reload
changes the next handshake only.

`Protected` checks passwords through `twisted.cred`, not its ``HTTPAuthSessionWrapper``, which makes any login
failure but a refusal a 500 and has no place for the rate limit, the headers, the client's address or the damped
log lines.  A bcrypt check costs tens of milliseconds of CPU by design: `PasswordChecks` runs them in `THREADS`
daemon threads, at most `MAX_PENDING` pending (beyond: 503), the places shared fairly by client, and keeps the
verdicts a while, a right one renewed by each use, so a flood of wrong passwords never stands in the scraper's way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import re
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Collection, Mapping

import bcrypt
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.application.service import Service
from twisted.cred.checkers import ICredentialsChecker
from twisted.cred.credentials import IUsernamePassword, UsernamePassword
from twisted.cred.error import LoginFailed, UnauthorizedLogin
from twisted.cred.portal import IRealm, Portal
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IHandshakeListener, IOpenSSLServerConnectionCreator, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.internet.ssl import AcceptableCiphers, CertificateOptions, TLSVersion
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.guard import BasicCredentialFactory
from twisted.web.resource import IResource, Resource, getChildForRequest
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from atopgpud_tw.checks import flag, integer, kind, read_regular
from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.system.access import address_name, peer_name
from atopgpud_tw.server.web.metrics import plain
from atopgpud_tw.server.web.webbounds import BoundedChannel, Bursts

#: the largest web configuration, or certificate file, read (a real one is a few KiB)
MAX_SIZE = 1024 * 1024
#: client_auth_type values, as Go's crypto/tls names them and means them (https://pkg.go.dev/crypto/tls#ClientAuthType;
#: RequireClientCert: the toolkit's old name)
CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven",
                     "RequireAndVerifyClientCert")
_AUTH_ALIASES = {"RequireClientCert": "RequireAnyClientCert", "": "NoClientCert"}
#: the client auth types that demand a certificate of every client
CERT_REQUIRED = ("RequireAnyClientCert", "RequireAndVerifyClientCert")
#: the client auth types that check a client's certificate against client_ca
CERT_VERIFIED = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
#: the toolkit's names of the TLS versions, oldest first
TLS_VERSIONS = {"TLS10": TLSVersion.TLSv1_0, "TLS11": TLSVersion.TLSv1_1, "TLS12": TLSVersion.TLSv1_2,
                "TLS13": TLSVersion.TLSv1_3}
#: the headers the toolkit lets a file set, and the values it allows (None: any)
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
#: keys of the toolkit's format this daemon does not implement, and why
UNSUPPORTED = {
    "tls_server_config.curve_preferences": "curve_preferences is not supported (OpenSSL's default groups are used)",
}
#: a Go duration: 1s, 250ms, 1m30s
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: a bcrypt hash in the modular crypt format: $2a$, $2b$ or $2y$ (htpasswd -B), cost, 53 characters
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
#: the lowest and highest bcrypt cost taken: each step doubles a check (cost 10: some 80 ms, 14: some 1.3 s of a
#: core), and a cost of 31 would hold a checking thread for days and a stop behind it
MIN_COST = 4
MAX_COST = 14


class WebConfigError(ValueError):
    """A web configuration that cannot be used; its text is one line."""


@dataclass(frozen=True)
class TLSSettings:
    """``tls_server_config``: PEM text given inline, or a file (absolute) to read it from."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_allowed_sans: tuple[str, ...] | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[str, ...]:
        """The files the certificates are read from: a change to any is a reload."""
        return tuple(path for path in (self.cert_file, self.key_file, self.client_ca_file) if path)


@dataclass(frozen=True)
class WebConfig:
    """A parsed web configuration: TLS (None: plain HTTP), headers, users and their bcrypt hashes."""

    tls: TLSSettings | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    users: Mapping[str, bytes] = field(default_factory=dict)
    http2: bool = True
    #: (seconds per token, burst), None: no rate limit
    rate_limit: tuple[float, int] | None = None

    def files(self) -> tuple[str, ...]:
        """The certificate files, if any: a change to any is a reload."""
        return self.tls.files() if self.tls is not None else ()

    def describe(self) -> str:
        """What the configuration turns on, in a few words."""
        tls, users = self.tls, len(self.users)
        parts = ["plain HTTP" if tls is None else
                 f"TLS {tls.min_version} to {tls.max_version}, client certificates: {tls.client_auth_type}",
                 f"basic auth for {users} user{'s' if users != 1 else ''}" if users else "no basic auth"]
        if self.rate_limit is not None:
            parts.append(f"at most {self.rate_limit[1]} requests at once, one more every {self.rate_limit[0]:g} s")
        return ", ".join(parts)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice is an error (as Go's UnmarshalStrict has it)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        if isinstance(key, (list, dict)):
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: a key that is not a scalar")
        if key in seen:
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: {key!s} is given twice")
        seen[key] = loader.construct_object(value_node, deep=True)  # type: ignore[no-untyped-call]
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read(path: str) -> WebConfig:
    """The configuration in the file at `path` (relative file names are its folder's)."""
    try:
        text = read_regular(path, MAX_SIZE)
    except OSError as error:
        raise WebConfigError(f"cannot be read ({error.strerror or error})") from None
    return parse(text, os.path.dirname(os.path.abspath(path)))


def parse(text: bytes | str, folder: str) -> WebConfig:
    """A configuration from its YAML text; `folder` resolves relative file names."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506  # a safe loader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join((getattr(error, "problem", None) or str(error)).split())
        raise WebConfigError(f"not valid YAML: {where}{problem}") from None
    if document is None:
        return WebConfig()  # an empty file: plain HTTP, no users (as the toolkit has it)
    top = _table(document, "the file", ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"))
    tls = _tls(top.get("tls_server_config"), folder)
    http = _table(top.get("http_server_config"), "http_server_config", ("http2", "headers"))
    return WebConfig(tls=tls, http2=flag(http.get("http2", True), "http_server_config.http2", WebConfigError),
                     headers=_headers(http.get("headers")), users=_users(top.get("basic_auth_users")),
                     rate_limit=_rate(top.get("rate_limit")))


def _dict(value: Any, where: str, of: str = " of keys to values") -> dict[Any, Any]:
    if value is not None and not isinstance(value, dict):
        raise WebConfigError(f"{where} must be a mapping{of}, not {kind(value)}")
    return value or {}


def _table(value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    value = _dict(value, where)
    prefix = "" if where == "the file" else where + "."
    for key in value:
        name = f"{prefix}{key}"
        if not isinstance(key, str) or key not in known:
            supported = (k for k in known if f"{prefix}{k}" not in UNSUPPORTED)
            raise WebConfigError(f"unknown key {name!s} (known in {where}: {', '.join(supported)})")
        if name in UNSUPPORTED and value[key] is not None:
            raise WebConfigError(UNSUPPORTED[name])
    return value


def _string(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"{where} must be a string, not {kind(value)}")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise WebConfigError(f"{where} must be a list of strings")
    return tuple(value)


def _choice(value: Any, where: str, allowed: Collection[str], default: str) -> str:
    text = _string(value, where)
    if text is None:
        return default
    if text not in allowed:
        raise WebConfigError(f"{where}: {text!r} is not one of {', '.join(allowed)}")
    return text


def _tls(value: Any, folder: str) -> TLSSettings | None:
    # the keys in TLSSettings' order (the error for an unknown key lists them)
    table = _table(value, "tls_server_config", (*(f.name for f in fields(TLSSettings)), "curve_preferences"))
    where = "tls_server_config."
    given = {key: _string(table.get(key), where + key) for key in ("cert", "key", "client_ca", "cert_file",
                                                                  "key_file", "client_ca_file")}
    auth_text = _string(table.get("client_auth_type"), where + "client_auth_type") or ""
    if not any(given.values()) and not auth_text:
        return None  # as the toolkit has it: nothing that turns TLS on, plain HTTP
    for inline in ("cert", "key", "client_ca"):
        if given[inline] and given[inline + "_file"]:
            raise WebConfigError(f"{where}{inline} and {where}{inline}_file are both given: give one")
    for needed, what in (("cert", "certificate"), ("key", "private key")):
        if not (given[needed] or given[needed + "_file"]):
            raise WebConfigError(f"{where}{needed}_file (or {needed}) is missing: TLS needs the server's {what}")
    auth = _AUTH_ALIASES.get(auth_text, auth_text)
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(f"{where}client_auth_type: {auth_text!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    has_ca = bool(given["client_ca"] or given["client_ca_file"])
    if has_ca and auth == "NoClientCert":
        raise WebConfigError(f"{where}client_ca_file is given with client_auth_type NoClientCert: "
                             "set client_auth_type (RequireAndVerifyClientCert checks the clients)")
    if auth in CERT_VERIFIED and not has_ca:
        raise WebConfigError(f"{where}client_auth_type {auth} needs client_ca_file (or client_ca) to verify against")
    sans = _strings(table.get("client_allowed_sans"), where + "client_allowed_sans")
    if sans is not None and auth not in CERT_REQUIRED:
        raise WebConfigError(f"{where}client_allowed_sans needs client_auth_type RequireAnyClientCert or "
                             "RequireAndVerifyClientCert")
    low = _choice(table.get("min_version"), where + "min_version", TLS_VERSIONS, "TLS12")
    high = _choice(table.get("max_version"), where + "max_version", TLS_VERSIONS, "TLS13")
    if list(TLS_VERSIONS).index(low) > list(TLS_VERSIONS).index(high):
        raise WebConfigError(f"{where}min_version {low} is above max_version {high}")
    ciphers = _strings(table.get("cipher_suites"), where + "cipher_suites") or ()
    prefer = flag(table.get("prefer_server_cipher_suites", True), where + "prefer_server_cipher_suites", WebConfigError)
    given.update({name: os.path.join(folder, file) for name in ("cert_file", "key_file", "client_ca_file")
                  if (file := given[name])})
    return TLSSettings(**given, client_auth_type=auth, client_allowed_sans=sans, min_version=low, max_version=high,
                       cipher_suites=ciphers, prefer_server_cipher_suites=prefer)


def duration(text: Any, where: str) -> float:
    """Seconds of a Go duration string (``1s``, ``250ms``, ``1m30s``, ``0``)."""
    if type(text) is int and text == 0 or text == "0":
        return 0.0
    if not isinstance(text, str):
        raise WebConfigError(f"{where} must be a duration such as 1s or 250ms, not {kind(text)}")
    parts = list(_DURATION.finditer(text))
    if not parts or "".join(part.group(0) for part in parts) != text:
        raise WebConfigError(f"{where}: {text!r} is not a duration such as 1s or 250ms")
    return sum(float(part.group(1)) * _UNITS[part.group(2)] for part in parts)


def _rate(value: Any) -> tuple[float, int] | None:
    table = _table(value, "rate_limit", ("interval", "burst"))
    if not table:
        return None
    interval = duration(table.get("interval", 0), "rate_limit.interval")
    burst = integer(table.get("burst", 0), "rate_limit.burst", WebConfigError, words="a whole number from 0 up",
                    high=None)
    if interval == 0:
        return None  # as the toolkit has it: 0 turns the limiter off
    if burst == 0:
        raise WebConfigError("rate_limit.burst 0 would refuse every request: give 1 or more")
    return interval, burst


def _headers(value: Any) -> dict[str, str]:
    headers = {}
    for name, text in _dict(value, "http_server_config.headers", "").items():
        if name not in HEADERS:
            raise WebConfigError(f"http_server_config.headers: {name!s} cannot be set "
                                 f"(only {', '.join(HEADERS)})")
        text = _string(text, f"http_server_config.headers.{name}")
        if text is None:
            continue  # blank: unset, as the toolkit has it
        allowed = HEADERS[name]
        if allowed is not None and text not in allowed:
            raise WebConfigError(f"http_server_config.headers.{name}: {text!r} is not one of {', '.join(allowed)}")
        if "\n" in text or "\r" in text:
            raise WebConfigError(f"http_server_config.headers.{name}: a value on one line, please")
        headers[name] = text
    return headers


def _users(value: Any) -> dict[str, bytes]:
    users = {}
    for name, hashed in _dict(value, "basic_auth_users", " of user names to bcrypt hashes").items():
        if not isinstance(name, str) or not name or ":" in name:
            raise WebConfigError(f"basic_auth_users: {name!r} is not a user name (a string without ':')")
        if not isinstance(hashed, str):
            raise WebConfigError(f"basic_auth_users.{name}: a bcrypt hash is a string, not {kind(hashed)}")
        match = _BCRYPT.fullmatch(hashed.strip())
        if match is None:
            raise WebConfigError(f"basic_auth_users.{name}: not a bcrypt hash ($2y$10$ and 53 characters, "
                                 "as htpasswd -nBC 10 makes)")
        if not MIN_COST <= int(match.group(1)) <= MAX_COST:
            raise WebConfigError(f"basic_auth_users.{name}: bcrypt cost {match.group(1)} is not from {MIN_COST} "
                                 f"to {MAX_COST} (each step doubles the time of a check; htpasswd -nBC 10 is usual)")
        users[name] = hashed.strip().encode("ascii")
    return users


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
        self._failed = BurstLog(reactor)
        #: the users and their hashes `requestAvatarId` checks against
        self.users: dict[str, bytes] = {}

    def requestAvatarId(self, credentials: Any) -> Deferred[bytes | tuple[()]]:
        """`twisted.cred`: the user's name if the password is right (the client's address, when the
        credentials carry one as `peer`, is whom a pending check is counted to)."""
        user = credentials.username
        verdict = self.check(user, credentials.password, self.users, getattr(credentials, "peer", ""))
        return (verdict if isinstance(verdict, Deferred) else succeed(verdict)).addCallback(_avatar, user)

    def _pools(self) -> tuple[_Pool, _Pool]:
        """The checking pool, and the one for credentials once found right: one thread, no bound
        but the number of such credentials."""
        return (_Pool(minthreads=0, maxthreads=self.threads, name="atopgpud-bcrypt"),
                _Pool(minthreads=0, maxthreads=1, name="atopgpud-bcrypt-known"))

    def start(self) -> None:
        if not self.pool.started:
            if self.pool.stopping.is_set():  # started again after a stop: pools of their own
                self.pool, self.known_pool = self._pools()
            self.pool.start()
            self.known_pool.start()

    def stop(self) -> None:
        self._failed.stop()
        if self.pool.started:
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

        def settled(right: bool | None, checked: bool = True) -> None:
            if right is not None and checked:
                self._keep(key, right)
            if pending.get(key) is outcome:  # not pushed out meanwhile
                del pending[key]
                self.owners.pop(key, None)
                outcome.callback(right)

        def failed(failure: Any) -> None:
            self._failed.event(lambda: self.log.error("a bcrypt check failed: {error}",
                                                      error=failure.getErrorMessage()),
                               "bcrypt checks failed")
            settled(False, checked=False)  # refused, and not kept

        deferToThreadPool(self.reactor, pool, _bcrypt_check, password, stored, pool.stopping,
                          cancelled).addCallbacks(settled, failed)
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
    if scheme.lower() == _BASIC.scheme:
        with contextlib.suppress(LoginFailed):  # not base64, or no colon
            return _BASIC.decode(encoded.strip(), request)
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


@implementer(IRealm)
class Protected(Resource):
    """The site's root under a web configuration: headers, then basic auth, then `inner`'s pages (the realm's
    one avatar)."""

    log = ClassLogger("atopgpud_tw.basicauth.Protected")

    def __init__(self, inner: IResource, config: WebConfig, checks: PasswordChecks, clock: IReactorTime) -> None:
        super().__init__()
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
        return None if config.rate_limit is None else TokenBucket(*config.rate_limit, self.clock)

    def getChildWithDefault(self, name: bytes, request: Request) -> IResource:
        if self.bucket is not None and not self.bucket.take():
            self.bursts.cut("metrics requests answered 429 (rate_limit)",
                            "answering metrics requests 429: over rate_limit")
            return TOO_MANY  # before a password is checked, as the toolkit has it
        for header, value in self._config.headers.items():
            request.setHeader(header.encode("ascii"), value.encode("utf-8"))
        if not self._config.users:
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
        now: list[Any] = []
        login.addBoth(now.append)
        if now:  # a verdict known (or refused) at once: no waiting
            return self._answer(now[0], request, given.username, name)
        return _Waiting(login.addCallback(
            lambda _: getChildForRequest(self._answer(now[0], request, given.username, name), request)))

    def _answer(self, login: Any, request: Request, user: bytes, name: bytes) -> IResource:
        """What a login's outcome answers: the site's child `name`, 503 (checks busy) or 401."""
        if not isinstance(login, Failure):
            return self.inner.getChildWithDefault(name, request)  # the realm's one avatar
        if login.check(Busy):
            self.bursts.cut("metrics requests answered 503 (password checks pending)",
                            "answering metrics requests 503: {count} password checks already pending",
                            count=len(self.checks.pending))
            return BUSY
        if not login.check(UnauthorizedLogin):
            self.log.failure("a password check failed", login)
        self.bursts.cut("metrics requests refused: wrong password", "refusing metrics requests from {peer}: wrong "
                        "user name or password (user {user!r})", peer=self._peer(request),
                        user=user.decode("utf-8", "replace"))
        return UNAUTHORIZED

    @staticmethod
    def _peer(request: Request) -> str:
        return address_name(request.getClientAddress())

    def stop(self) -> None:
        self.bursts.stop()


#: Go's names of the TLS 1.2 (and older) suites it offers (https://pkg.go.dev/crypto/tls#CipherSuites),
#: as OpenSSL names them
CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
#: TLS 1.3's suites: Go takes their names and does not let them be configured; neither does this
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")


def _pem(text: str | None, path: str | None, what: str) -> tuple[bytes, str]:
    """The PEM bytes given inline or in a file, and how a message names them."""
    if text is not None:
        return text.encode("utf-8"), f"tls_server_config.{what}"
    assert path is not None
    try:
        return read_regular(path, MAX_SIZE), f"tls_server_config.{what}_file {path}"
    except OSError as error:
        cause = error.strerror or error
        raise WebConfigError(f"tls_server_config.{what}_file {path}: cannot be read ({cause})") from None


def _certificates(text: str | None, path: str | None, what: str) -> tuple[list[x509.Certificate], str]:
    data, name = _pem(text, path, what)
    try:
        found = x509.load_pem_x509_certificates(data)
    except ValueError:
        found = []
    if not found:
        raise WebConfigError(f"{name}: no PEM certificate in it")
    return found, name


def build_context(settings: TLSSettings) -> SSL.Context:
    """A server context for `settings`; WebConfigError (one line) for certificates or keys that will not do.
    The client certificates are set after `CertificateOptions`, which can neither ask for one it does not
    verify nor check client_allowed_sans (and always prefers the server's order of suites, as Go since 1.18)."""
    chain, chain_name = _certificates(settings.cert, settings.cert_file, "cert")
    key_data, key_name = _pem(settings.key, settings.key_file, "key")
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except (ValueError, TypeError) as error:
        cause = "it is encrypted" if "encrypted" in str(error).lower() or isinstance(error, TypeError) else \
            "no PEM private key in it"
        raise WebConfigError(f"{key_name}: {cause}") from None
    ciphers = [name for name in settings.cipher_suites if name not in TLS13_SUITES]
    unknown = [name for name in ciphers if name not in CIPHERS]
    if unknown:
        raise WebConfigError(f"tls_server_config.cipher_suites: {unknown[0]!r} is not a cipher suite "
                             "(Go's names, such as TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
    try:
        options = CertificateOptions(  # cryptography's objects, which pyOpenSSL takes (its own are deprecated)
            privateKey=key, certificate=chain[0], extraCertChain=chain[1:], enableSessions=True,  # type: ignore[arg-type]
            enableSessionTickets=True, insecurelyLowerMinimumTo=TLS_VERSIONS[settings.min_version],
            lowerMaximumSecurityTo=TLS_VERSIONS[settings.max_version],
            acceptableCiphers=AcceptableCiphers.fromOpenSSLCipherString(":".join(CIPHERS[name] for name in ciphers))
            if ciphers else None,
        )
    except ValueError:
        raise WebConfigError("tls_server_config.cipher_suites: OpenSSL offers none of them") from None
    try:
        context = options.getContext()
    except SSL.Error:
        raise WebConfigError(f"{key_name} is not the key of {chain_name}'s certificate") from None
    context.set_options(SSL.OP_NO_RENEGOTIATION)
    _client_certificates(context, settings)
    return context


def _client_certificates(context: SSL.Context, settings: TLSSettings) -> None:
    mode = settings.client_auth_type
    if mode == "NoClientCert":
        return
    if settings.client_ca is not None or settings.client_ca_file is not None:
        authorities, _ = _certificates(settings.client_ca, settings.client_ca_file, "client_ca")
        store = context.get_cert_store()
        assert store is not None
        # no list of authorities in the certificate request (pyOpenSSL deprecates its X509Name): a
        # client sends the certificate it was configured with, as Prometheus and curl do
        for authority in authorities:
            with contextlib.suppress(crypto.Error):  # the same authority twice in the file
                store.add_cert(crypto.X509.from_cryptography(authority))
    flags = SSL.VERIFY_PEER | (SSL.VERIFY_FAIL_IF_NO_PEER_CERT if mode in CERT_REQUIRED else 0)
    verify = mode in CERT_VERIFIED
    sans = settings.client_allowed_sans

    def check(connection: SSL.Connection, certificate: Any, errno: int, depth: int, ok: int) -> bool:
        if verify and not ok:
            return False
        if sans is not None and depth == 0:
            return bool(set(subject_names(certificate.to_cryptography())) & set(sans))
        return True

    context.set_verify(flags, check)


def subject_names(certificate: x509.Certificate) -> list[str]:
    """A certificate's subject alternative names (DNS, IP, e-mail, URI) as text, as Go matches them."""
    try:
        extension = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*extension.get_values_for_type(x509.DNSName), *extension.get_values_for_type(x509.RFC822Name),
            *extension.get_values_for_type(x509.UniformResourceIdentifier),
            *map(str, extension.get_values_for_type(x509.IPAddress))]


@implementer(IOpenSSLServerConnectionCreator)
class Contexts:
    """The current context; each new TLS connection is made from it."""

    def __init__(self, context: SSL.Context) -> None:
        self.context = context

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        return SSL.Connection(self.context, None)


class TLSSiteFactory(TLSMemoryBIOFactory):
    """TLS around the metrics site (or any factory that may refuse with None)."""

    noisy = False

    def buildProtocol(self, addr: Any) -> Any:
        inner = self.wrappedFactory.buildProtocol(addr)
        return None if inner is None else self.protocol(self, inner)  # None: the site is full, no handshake


@implementer(IHandshakeListener)
class TLSChannel(BoundedChannel):
    """The metrics site's channel under TLS: the handshake must end within
    `WebLimits.handshake_timeout`, at most `WebLimits.max_handshakes_per_peer` are in
    flight per peer (`BoundedChannel.peer`), and a failed one is logged once per burst."""

    _shaken = False

    def connectionMade(self) -> None:
        super().connectionMade()
        self._arm(self.limits.handshake_timeout, "handshake")  # no request's deadline runs before it ends
        flight = self.guard.handshakes.setdefault(self.peer, [])
        flight.append(self)
        if len(flight) > self.limits.max_handshakes_per_peer:
            oldest = flight[0]
            oldest._stop_waiting()
            self.guard.cut("metrics TLS handshakes cut: too many from one address",
                           "closing a metrics connection from {peer}: over {most} TLS handshakes in flight from "
                           "{address}", peer=peer_name(oldest.transport), most=self.limits.max_handshakes_per_peer,
                           address=self.peer)
            oldest.transport.abortConnection()

    def handshakeCompleted(self) -> None:
        """Called by Twisted's TLS (`IHandshakeListener`)."""
        self._shaken = True
        self._stop_waiting()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_waiting()
        if not self._shaken and reason is not None and reason.check(SSL.Error):
            self.cut("metrics TLS handshakes failed",
                     "refusing a metrics connection from {peer}: TLS handshake failed ({cause})",
                     cause=_cause(reason.value))
        super().connectionLost(reason)

    def _close(self) -> None:
        # (a handshake cut for its deadline no longer counts against its address's handshakes in flight,
        # though its connection is seen lost only later)
        self._stop_waiting()
        super()._close()

    def _stop_waiting(self) -> None:
        self._disarm()
        flight = self.guard.handshakes.get(self.peer)
        if flight is not None and self in flight:
            flight.remove(self)
            if not flight:
                del self.guard.handshakes[self.peer]


def _cause(error: BaseException) -> str:
    """OpenSSL's reason for a failed handshake in its words: 'http request', 'peer did not return a certificate'."""
    args = getattr(error, "args", ())
    if args and isinstance(args[0], list) and args[0] and isinstance(args[0][-1], tuple):
        return str(args[0][-1][-1])
    return str(error) or type(error).__name__


Signature = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class Loaded:
    """A configuration that was read whole, its TLS context built (None: plain HTTP)."""

    config: WebConfig
    context: SSL.Context | None
    signature: Signature


def signature(path: str, files: tuple[str, ...]) -> Signature:
    """What says the file or a certificate changed: each one's inode, size and mtime (None: missing)."""
    return tuple(_mark(name) for name in (path, *files))


def _mark(name: str) -> tuple[int, int, int] | None:
    try:
        status = os.stat(name)
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def attempt(path: str, fallback: tuple[str, ...] = ()) -> tuple[Loaded | WebConfigError, Signature, tuple[str, ...]]:
    """Read and check the whole configuration (the file, then its certificates and keys, the TLS context
    built): what came of it, the signature it was read at, and the certificate files to watch (those the
    file names, or `fallback` when the file cannot be read).  Blocking work: a reload runs it in a thread."""
    before = signature(path, ())
    try:
        config = read(path)
    except WebConfigError as error:
        return error, before + signature(path, fallback)[1:], fallback
    files = config.files()
    tried = before + signature(path, files)[1:]
    try:
        context = build_context(config.tls) if config.tls is not None else None
    except WebConfigError as error:
        return error, tried, files
    return Loaded(config, context, tried), tried, files


def load(path: str) -> Loaded:
    """The whole configuration at start-up; WebConfigError (one line) if it cannot be used."""
    loaded = attempt(path)[0]
    if isinstance(loaded, WebConfigError):
        raise loaded
    return loaded


class WebSecurity(Service):
    """Keeps the metrics site's TLS context and users those of the file, re-read on change and SIGHUP: built
    in a thread (`run`; some 80 ms atop would wait for), applied on the reactor, at most one built at a time
    and one started per `interval`, so a burst of SIGHUPs is one or two builds."""

    log = ClassLogger("atopgpud_tw.websecure.WebSecurity")
    #: seconds between looks at the file and its certificates
    interval = 1.0

    def __init__(self, path: str, loaded: Loaded, root: Protected, contexts: Contexts | None, reactor: Any,
                 run: Callable[..., Deferred[Any]] | None = None) -> None:
        self.path = path
        self.loaded = loaded
        self.root = root
        self.contexts = contexts
        self.reactor = reactor
        self.run = run or (lambda work, *args: deferToThreadPool(reactor, reactor.getThreadPool(), work, *args))
        self.reloads = 0
        self.failed_reloads = 0
        #: reloads built (tried), whatever came of them
        self.builds = 0
        self._watch = LoopingCall(self.look)
        self._watch.clock = reactor
        self._tried: Signature = loaded.signature
        #: the certificate files watched: the last good configuration's, or those of a newer file that
        #: failed (a certificate it names may yet appear)
        self._watched = loaded.config.files()
        self._building = False
        self._began = float("-inf")
        #: why a reload was asked for while another was built or within `interval` of the last: done next
        self._asked: str | None = None
        self._stopped = False

    def startService(self) -> None:
        super().startService()
        self._watch.start(self.interval, now=False)

    def stopService(self) -> None:
        super().stopService()
        self._stopped = True
        if self._watch.running:
            self._watch.stop()
        self.root.checks.stop()
        self.root.stop()

    def look(self) -> None:
        """Once a second: the reload asked for meanwhile, or one if the file or a certificate changed."""
        if self._asked is not None:
            self.reload(self._asked)
        elif not self._building and signature(self.path, self._watched) != self._tried:
            self.reload("changed")

    def hangup(self) -> None:
        """SIGHUP: re-read, changed or not."""
        self.reload("SIGHUP")

    def reload(self, why: str) -> None:
        """Build the configuration again in a thread, now or (coalesced) at the next look."""
        if self._building or self.reactor.seconds() - self._began < self.interval:
            self._asked = self._asked or why
            return
        self._asked = None
        self._building = True
        self._began = self.reactor.seconds()
        self.builds += 1
        built = self.run(attempt, self.path, self.loaded.config.files())
        built.addCallback(self._apply, why).addBoth(self._built)

    def _built(self, result: Any) -> Any:
        self._building = False
        return result

    def _apply(self, result: tuple[Loaded | WebConfigError, Signature, tuple[str, ...]], why: str) -> None:
        """Use what was built if it is whole; otherwise keep the last good configuration and say so."""
        loaded, self._tried, self._watched = result
        if self._stopped:
            return  # stopped while it was built
        try:
            if isinstance(loaded, WebConfigError):
                raise loaded
            if (loaded.context is None) != (self.contexts is None):
                turns = "off" if loaded.context is None else "on"
                raise WebConfigError(f"turns TLS {turns}, which only a restart can do")
            if self.loaded.config.users and not loaded.config.users:
                raise WebConfigError("turns basic auth off, which only a restart can do "
                                     "(no basic_auth_users: an emptied or half-written file?)")
        except WebConfigError as error:
            self.failed_reloads += 1
            self.log.warn("--web-config {path} ({why}): {error}; keeping the last good configuration",
                          path=self.path, why=why, error=error)
            return
        if self.contexts is not None and loaded.context is not None:
            self.contexts.context = loaded.context
        self.root.config = loaded.config
        self.loaded = loaded
        self.reloads += 1
        self.log.info("--web-config {path} reloaded ({why}): {what}", path=self.path, why=why,
                      what=loaded.config.describe())


def secure_site(path: str, site: Any, reactor: Any, endpoint: str = "") -> tuple[Any, WebSecurity]:
    """The metrics site under the web configuration at `path`, and the service that reloads it; a
    configuration that cannot be used ends start-up: one line, exit status 2."""
    try:
        loaded = load(path)
        if loaded.context is not None and endpoint.startswith("ssl:"):
            raise WebConfigError("tls_server_config is given and --metrics is an ssl: endpoint: "
                                 "give one of them (tcp: with tls_server_config)")
    except WebConfigError as error:
        print(f"atopgpud: --web-config {path}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    root = Protected(site.resource, loaded.config, PasswordChecks(reactor), reactor)
    site.resource = root
    contexts = None if loaded.context is None else Contexts(loaded.context)
    if contexts is not None:
        site.protocol = TLSChannel
    security = WebSecurity(path, loaded, root, contexts, reactor)
    security.log.info("--web-config {path}: {what}", path=path, what=loaded.config.describe())
    return site if contexts is None else TLSSiteFactory(contexts, False, site, reactor), security
