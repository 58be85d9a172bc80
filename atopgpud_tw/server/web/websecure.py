"""``--web-config``: the metrics site under TLS and basic auth, re-read when the file changes.

`secure_site` reads the file at start-up (a bad one: one line on standard error,
exit status 2), wraps the site (`basicauth.Protected` at its root,
`TLSSiteFactory` around it under ``tls_server_config``) and returns the
`WebSecurity` service that re-reads it when the file or a certificate changes and
on SIGHUP.  A reload that fails keeps the last good configuration, in one line.
Turning TLS on or off is refused the same way (a port does not change protocol
under its clients), and so is turning basic auth off: a file emptied (what
``> FILE`` does first) or cut after ``basic_auth_users:`` parses as no users.

`build_context` makes the context through Twisted's `CertificateOptions` (the
certificates read with ``cryptography``, so that a bad file is one line);
`Contexts` hands the current one to each new connection, so a reload changes the
next handshake and leaves open connections as they are; `TLSSiteFactory` is
Twisted's TLS around the metrics site, and `TLSChannel` bounds the handshakes.
client_auth_type maps onto OpenSSL's verify modes with Go's meanings
(https://pkg.go.dev/crypto/tls#ClientAuthType; docs/metrics.md).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHandshakeListener, IOpenSSLServerConnectionCreator
from twisted.internet.protocol import connectionDone
from twisted.internet.ssl import AcceptableCiphers, CertificateOptions, TLSVersion
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.regularfile import read_regular
from atopgpud_tw.server.system.access import peer_name
from atopgpud_tw.server.web import webconfig
from atopgpud_tw.server.web.basicauth import PasswordChecks, Protected
from atopgpud_tw.server.web.webbounds import BoundedChannel
from atopgpud_tw.server.web.webconfig import TLSSettings, WebConfig, WebConfigError

_VERSIONS = {"TLS10": TLSVersion.TLSv1_0, "TLS11": TLSVersion.TLSv1_1, "TLS12": TLSVersion.TLSv1_2,
             "TLS13": TLSVersion.TLSv1_3}
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
        return read_regular(path, webconfig.MAX_SIZE), f"tls_server_config.{what}_file {path}"
    except OSError as error:
        cause = error.strerror or error
        raise WebConfigError(f"tls_server_config.{what}_file {path}: cannot be read ({cause})") from None


def _certificates(data: bytes, name: str) -> list[x509.Certificate]:
    try:
        found = x509.load_pem_x509_certificates(data)
    except ValueError:
        found = []
    if not found:
        raise WebConfigError(f"{name}: no PEM certificate in it")
    return found


def build_context(settings: TLSSettings) -> SSL.Context:
    """A server context for `settings`; WebConfigError (one line) for certificates or keys that will not do.

    Twisted's `CertificateOptions` makes it (certificate chain, key, versions, ciphers, sessions); the client
    certificates are set on its context after (`_client_certificates`), as it can neither ask for a
    certificate it does not verify (RequestClientCert, RequireAnyClientCert) nor check client_allowed_sans,
    and it always prefers the server's order of suites (prefer_server_cipher_suites: false is taken and
    has no effect, as in Go since 1.18)."""
    chain_data, chain_name = _pem(settings.cert, settings.cert_file, "cert")
    chain = _certificates(chain_data, chain_name)
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
            enableSessionTickets=True, insecurelyLowerMinimumTo=_VERSIONS[settings.min_version],
            lowerMaximumSecurityTo=_VERSIONS[settings.max_version],
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
        data, name = _pem(settings.client_ca, settings.client_ca_file, "client_ca")
        store = context.get_cert_store()
        assert store is not None
        authorities = _certificates(data, name)
        # no list of authorities in the certificate request (pyOpenSSL deprecates its X509Name): a
        # client sends the certificate it was configured with, as Prometheus and curl do
        for authority in authorities:
            try:
                store.add_cert(crypto.X509.from_cryptography(authority))
            except crypto.Error:
                pass  # the same authority twice in the file
    flags = SSL.VERIFY_PEER | (SSL.VERIFY_FAIL_IF_NO_PEER_CERT if mode in webconfig.CERT_REQUIRED else 0)
    verify = mode in webconfig.CERT_VERIFIED
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
    names: list[str] = []
    for kind in (x509.DNSName, x509.RFC822Name, x509.UniformResourceIdentifier):
        names.extend(extension.get_values_for_type(kind))
    names.extend(str(address) for address in extension.get_values_for_type(x509.IPAddress))
    return names


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
        if inner is None:  # the site is full: closed before any handshake
            return None
        return self.protocol(self, inner)


@implementer(IHandshakeListener)
class TLSChannel(BoundedChannel):
    """The metrics site's channel under TLS: the handshake must end within
    `WebLimits.handshake_timeout`, at most `WebLimits.max_handshakes_per_peer` are in
    flight per peer (`BoundedChannel.peer`), and a failed one is logged once per burst."""

    def __init__(self) -> None:
        super().__init__()
        self._handshake: Any = None
        self._shaken = False

    def connectionMade(self) -> None:
        super().connectionMade()
        if self in self.guard.channels:
            self._handshake = self.guard.clock.callLater(self.limits.handshake_timeout, self._too_slow)
            flight = self.guard.handshakes.setdefault(self.peer, [])
            flight.append(self)
            if len(flight) > self.limits.max_handshakes_per_peer:
                oldest = flight[0]
                oldest._stop_waiting()
                self.guard.cut(
                    "metrics TLS handshakes cut: too many from one address",
                    "closing a metrics connection from {peer}: over {most} TLS handshakes in flight from {address}",
                    peer=peer_name(oldest.transport), most=self.limits.max_handshakes_per_peer,
                    address=self.peer,
                )
                oldest.transport.abortConnection()

    def handshakeCompleted(self) -> None:
        """Called by Twisted's TLS (`IHandshakeListener`)."""
        self._shaken = True
        self._stop_waiting()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_waiting()
        if not self._shaken and self in self.guard.channels and reason is not None and reason.check(SSL.Error):
            self.guard.cut(
                "metrics TLS handshakes failed",
                "refusing a metrics connection from {peer}: TLS handshake failed ({cause})",
                peer=peer_name(self.transport), cause=_cause(reason.value),
            )
        super().connectionLost(reason)

    def _stop_waiting(self) -> None:
        if self._handshake is not None and self._handshake.active():
            self._handshake.cancel()
        self._handshake = None
        flight = self.guard.handshakes.get(self.peer)
        if flight is not None and self in flight:
            flight.remove(self)
            if not flight:
                del self.guard.handshakes[self.peer]

    def _too_slow(self) -> None:
        self._stop_waiting()
        self.guard.cut(
            "metrics TLS handshakes cut: too slow",
            "closing a metrics connection from {peer}: no TLS handshake within {seconds} s",
            peer=peer_name(self.transport), seconds=self.limits.handshake_timeout,
        )
        self.transport.abortConnection()


def _cause(error: BaseException) -> str:
    """OpenSSL's reason for a failed handshake in its words: 'http request', 'peer did not return a certificate'."""
    args = getattr(error, "args", ())
    if args and isinstance(args[0], list) and args[0] and isinstance(args[0][-1], tuple):
        return str(args[0][-1][-1])
    return str(error) or type(error).__name__


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
        config = webconfig.read(path)
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
