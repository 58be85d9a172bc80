"""``--web-config``: the metrics site under TLS and basic auth, re-read when the file changes.

`secure_site` reads the file at start-up (a bad one: one line on standard error,
exit status 2), wraps the site (`basicauth.Protected` at its root,
`tls.TLSSiteFactory` around it under ``tls_server_config``) and returns the
`WebSecurity` service that re-reads it when the file or a certificate changes and
on SIGHUP.  A reload that fails keeps the last good configuration, in one line.
Turning TLS on or off is refused the same way (a port does not change protocol
under its clients), and so is turning basic auth off: a file emptied (what
``> FILE`` does first) or cut after ``basic_auth_users:`` parses as no users.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from OpenSSL import SSL
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.server.web.basicauth import PasswordChecks, Protected
from atopgpud_tw.server.web.tls import Contexts, TLSChannel, TLSSiteFactory, build_context
from atopgpud_tw.server.web.webconfig import WebConfig, WebConfigError, read

#: seconds between looks at the file and its certificates
WATCH_INTERVAL = 1.0

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
    files = config.tls.files() if config.tls is not None else ()
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
    """Keeps the metrics site's TLS context and users those of the file, re-read on change and SIGHUP.

    A reload is built in a thread (`run`: the reactor's pool; YAML, hashes, certificates and the TLS
    context cost some 80 ms, which atop would wait for) and applied on the reactor; reloads are coalesced:
    at most one is built at a time and one starts per `interval`, so a burst of SIGHUPs is one or two
    builds, the last one reading the file as the burst left it."""

    log = ClassLogger("atopgpud_tw.websecure.WebSecurity")

    def __init__(self, path: str, loaded: Loaded, root: Protected, contexts: Contexts | None, reactor: Any,
                 interval: float = WATCH_INTERVAL, run: Callable[..., Deferred[Any]] | None = None) -> None:
        self.path = path
        self.loaded = loaded
        self.root = root
        self.contexts = contexts
        self.reactor = reactor
        self.interval = interval
        self.run = run or self._in_thread
        self.reloads = 0
        self.failed_reloads = 0
        #: reloads built (tried), whatever came of them
        self.builds = 0
        self._watch: LoopingCall | None = None
        self._tried: Signature = loaded.signature
        #: the certificate files watched: the last good configuration's, or those of a newer file that
        #: failed (a certificate it names may yet appear)
        self._watched: tuple[str, ...] = loaded.config.tls.files() if loaded.config.tls is not None else ()
        self._building = False
        self._began = float("-inf")
        #: why a reload was asked for while another was built or within `interval` of the last: done next
        self._asked: str | None = None
        self._stopped = False

    def _in_thread(self, work: Callable[..., Any], *args: Any) -> Deferred[Any]:
        return deferToThreadPool(self.reactor, self.reactor.getThreadPool(), work, *args)

    def startService(self) -> None:
        super().startService()
        self._watch = LoopingCall(self.look)
        self._watch.clock = self.reactor
        self._watch.start(self.interval, now=False)

    def stopService(self) -> None:
        super().stopService()
        self._stopped = True
        if self._watch is not None and self._watch.running:
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
        tls = self.loaded.config.tls
        built = self.run(attempt, self.path, tls.files() if tls is not None else ())
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
                raise WebConfigError(
                    "turns TLS " + ("off" if loaded.context is None else "on")
                    + ", which only a restart can do"
                )
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
    """The metrics site under the web configuration at `path`, and the service that reloads it.

    A configuration that cannot be used ends start-up: one line, exit status 2."""
    try:
        loaded = load(path)
        if loaded.context is not None and endpoint.startswith("ssl:"):
            raise WebConfigError("tls_server_config is given and --metrics is an ssl: endpoint: "
                                 "give one of them (tcp: with tls_server_config)")
    except WebConfigError as error:
        sys.stderr.write(f"atopgpud: --web-config {path}: {error}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    root = Protected(site.resource, loaded.config, PasswordChecks(reactor), reactor)
    site.resource = root
    contexts = None
    factory = site
    if loaded.context is not None:
        contexts = Contexts(loaded.context)
        site.protocol = TLSChannel
        factory = TLSSiteFactory(contexts, False, site, reactor)
    security = WebSecurity(path, loaded, root, contexts, reactor)
    security.log.info("--web-config {path}: {what}", path=path, what=loaded.config.describe())
    return factory, security
