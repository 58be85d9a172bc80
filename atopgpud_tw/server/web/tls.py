"""TLS on the metrics listener: an OpenSSL context from ``tls_server_config``, swapped on reload.

`build_context` makes the context through Twisted's `CertificateOptions` (the
certificates read with ``cryptography``, so that a bad file is one line);
`Contexts` hands the current one to each new connection, so a reload changes the
next handshake and leaves open connections as they are; `TLSSiteFactory` is
Twisted's TLS around the metrics site, and `TLSChannel` bounds the handshakes.
client_auth_type maps onto OpenSSL's verify modes with Go's meanings
(https://pkg.go.dev/crypto/tls#ClientAuthType; docs/metrics.md).
"""

from __future__ import annotations

from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.internet.interfaces import IHandshakeListener, IOpenSSLServerConnectionCreator
from twisted.internet.protocol import connectionDone
from twisted.internet.ssl import AcceptableCiphers, CertificateOptions, TLSVersion
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from atopgpud_tw.regularfile import read_regular
from atopgpud_tw.server.system.access import peer_name
from atopgpud_tw.server.web.webbounds import BoundedChannel
from atopgpud_tw.server.web.webconfig import CERT_REQUIRED, CERT_VERIFIED, MAX_SIZE, TLSSettings, WebConfigError

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
        return read_regular(path, MAX_SIZE), f"tls_server_config.{what}_file {path}"
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
