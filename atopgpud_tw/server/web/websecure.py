"""``--web-config``: the metrics site under TLS and basic auth, re-read when the file changes.

`secure_site` reads the file at start-up (a bad one: one line on standard error
and exit status 2), wraps the site (`basicauth.Protected` at its root,
`tls.TLSSiteFactory` around it when ``tls_server_config`` is given) and returns
the `WebSecurity` service that keeps it current: once a second it compares the
file's and the certificates' (inode, size, modification time) with the last
read, and re-reads on a change and on SIGHUP (`signals.SignalService`).  A
reload that fails keeps the last good configuration and says so in one line;
one that works says what it turned on.  Whether the listener speaks TLS is
fixed at start-up (a port does not change protocol under its clients): a
reload that turns TLS on or off is refused the same way.  So is one that would
turn basic auth off: a file emptied (what ``> FILE`` does first) or cut after
``basic_auth_users:`` parses as no users, and would have let every request in;
a restart turns it off on purpose.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from OpenSSL import SSL
from twisted.application.service import Service
from twisted.internet.task import LoopingCall

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.server.web.basicauth import Protected
from atopgpud_tw.server.web.passwords import PasswordChecks
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
    marks: list[tuple[int, int, int] | None] = []
    for name in (path, *files):
        try:
            status = os.stat(name)
        except OSError:
            marks.append(None)
            continue
        marks.append((status.st_ino, status.st_size, status.st_mtime_ns))
    return tuple(marks)


def load(path: str) -> Loaded:
    """Read and check the whole configuration: the file, then its certificates and keys."""
    before = signature(path, ())
    config = read(path)
    files = config.tls.files() if config.tls is not None else ()
    context = build_context(config.tls) if config.tls is not None else None
    return Loaded(config, context, before + signature(path, files)[1:])


class WebSecurity(Service):
    """Keeps the metrics site's TLS context and users those of the file, re-read on change and SIGHUP."""

    log = ClassLogger("atopgpud_tw.websecure.WebSecurity")

    def __init__(self, path: str, loaded: Loaded, root: Protected, contexts: Contexts | None, reactor: Any,
                 interval: float = WATCH_INTERVAL) -> None:
        self.path = path
        self.loaded = loaded
        self.root = root
        self.contexts = contexts
        self.reactor = reactor
        self.interval = interval
        self.reloads = 0
        self.failed_reloads = 0
        self._watch: LoopingCall | None = None
        self._tried: Signature = loaded.signature
        #: the certificate files watched: the last good configuration's, or those of a newer file that
        #: failed (a certificate it names may yet appear)
        self._watched: tuple[str, ...] = loaded.config.tls.files() if loaded.config.tls is not None else ()

    def startService(self) -> None:
        super().startService()
        self._watch = LoopingCall(self.look)
        self._watch.clock = self.reactor
        self._watch.start(self.interval, now=False)

    def stopService(self) -> None:
        super().stopService()
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        self.root.checks.stop()
        self.root.stop()

    def look(self) -> None:
        """Re-read if the file or a certificate changed since the last try."""
        if signature(self.path, self._watched) != self._tried:
            self.reload("changed")

    def _files_named(self) -> tuple[str, ...]:
        try:
            config = read(self.path)
        except WebConfigError:
            config = self.loaded.config
        return config.tls.files() if config.tls is not None else ()

    def hangup(self) -> None:
        """SIGHUP: re-read, changed or not."""
        self.reload("SIGHUP")

    def reload(self, why: str) -> bool:
        """Read the file again and use it if it is whole; otherwise keep the last good one and say so."""
        self._watched = self._files_named()
        self._tried = signature(self.path, self._watched)
        try:
            loaded = load(self.path)
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
            return False
        self._tried = loaded.signature
        self._watched = loaded.config.tls.files() if loaded.config.tls is not None else ()
        if self.contexts is not None and loaded.context is not None:
            self.contexts.context = loaded.context
        if loaded.config.users != self.loaded.config.users:
            self.root.checks.forget()
        self.root.config = loaded.config
        self.loaded = loaded
        self.reloads += 1
        self.log.info("--web-config {path} reloaded ({why}): {what}", path=self.path, why=why,
                      what=loaded.config.describe())
        return True


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
