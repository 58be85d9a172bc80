"""Sockets passed by systemd (socket activation), in place of the endpoints they match.

With ``atopgpud.socket`` enabled, systemd holds ``@atopgpud_nvidia`` (and, with
``atopgpud-tcp.socket``, TCP 127.0.0.1:59123) from early boot: an atop started
before the daemon connects at once, its request waiting in the socket's queue.
systemd passes the sockets (``LISTEN_FDS``); each takes the place of the
``--listen`` or ``--metrics`` endpoint with the same address, so one command line
serves with and without the socket units.  A passed socket that no endpoint names
is an error: it would be held open and never answered.  A passed socket belongs
to systemd: it is not bound, chmod-ed, shut down or removed here, and keeps its backlog.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, Sequence

from twisted.internet import defer, endpoints, fdesc, tcp, unix
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, UNIXServerEndpoint
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.python.systemd import ListenFDs
from zope.interface import implementer

from atopgpud_tw.server.system.accepting import FairPort, FairTCPPort
from atopgpud_tw.server.system.listening import Listener

#: ("unix", name as bytes) or ("tcp", ip address, port)
Address = tuple[Any, ...]

_ANY = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


@dataclass(frozen=True)
class Inherited:
    """One listening socket systemd passed."""

    fd: int
    family: int
    address: Address
    name: str

    def describe(self) -> str:
        if self.address[0] == "unix":
            raw = self.address[1]
            shown = "@" + os.fsdecode(raw[1:]) if raw[:1] == b"\0" else os.fsdecode(raw)
        else:
            host, port = self.address[1], self.address[2]
            shown = f"[{host}]:{port}" if host.version == 6 else f"{host}:{port}"
        return f"{shown} ({self.name})" if self.name else shown


class ActivationError(Exception):
    """A passed socket that cannot be used, or that nothing asks for."""


def inherited_sockets(environ: Any = os.environ) -> list[Inherited]:
    """The listening sockets systemd passed to this process, in order.

    Twisted reads (and takes out of the environment) ``LISTEN_PID``/``LISTEN_FDS``
    when its endpoints module is imported; what it read is asked for here, not
    through ``serverFromString``, which writes ``twisted/plugins/dropin.cache`` (a
    warning on the unit's read-only file system).  ``LISTEN_FDNAMES`` is taken out
    here, so that no child sees any of them.
    """
    found = getattr(getattr(endpoints, "_SystemdParser", None), "_sddaemon", None)
    if not isinstance(found, ListenFDs):  # a Twisted that no longer reads them at import
        found = ListenFDs.fromEnvironment(environ=environ)
    named = found.inheritedNamedDescriptors()
    descriptors = found.inheritedDescriptors()
    names = [next((name for name, fd in named.items() if fd == wanted), "") for wanted in descriptors]
    environ.pop("LISTEN_FDNAMES", None)
    return [_inspect(fd, name) for fd, name in zip(descriptors, names)]


def _inspect(fd: int, name: str) -> Inherited:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as error:
        raise ActivationError(f"systemd passed descriptor {fd} ({name}), which is not a socket: "
                              f"{error.strerror}") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.type != socket.SOCK_STREAM or not listening:
            raise ActivationError(
                f"systemd passed descriptor {fd} ({name}), which is not a listening stream socket "
                "(ListenStream= in the socket unit)"
            )
        return Inherited(fd, sock.family, _address(sock.family, sock.getsockname()), name)
    finally:
        sock.detach()


def _address(family: int, raw: Any) -> Address:
    if family == socket.AF_UNIX:
        return ("unix", os.fsencode(raw))
    return ("tcp", ipaddress.ip_address(raw[0].split("%")[0]), raw[1])


def address_of(endpoint: IStreamServerEndpoint) -> Address | None:
    """Where an endpoint would listen, in the form of `Inherited.address`; None if
    that cannot be known (port 0, or an endpoint type with no fixed address)."""
    if isinstance(endpoint, UNIXServerEndpoint):
        return _address(socket.AF_UNIX, endpoint._address)
    if isinstance(endpoint, (TCP4ServerEndpoint, TCP6ServerEndpoint)) and endpoint._port:
        default = "::" if isinstance(endpoint, TCP6ServerEndpoint) else "0.0.0.0"
        return _address(socket.AF_INET, (endpoint._interface or default, endpoint._port))
    return None


def _same(wanted: Address | None, passed: Address) -> bool:
    if wanted is None or wanted[0] != passed[0]:
        return False
    if wanted[0] == "tcp" and wanted[1] in _ANY and passed[1] in _ANY:
        return wanted[2] == passed[2]  # all interfaces, IPv4 or IPv6
    return wanted == passed


def take_inherited(reactor: Any, listeners: Sequence[Listener], inherited: Sequence[Inherited]) -> list[Listener]:
    """Each listener, with the passed socket that takes its endpoint's place if any;
    ActivationError names a passed socket that no listener matches."""
    left = list(inherited)
    chosen = []
    for listener in listeners:
        match = next((item for item in left if _same(address_of(listener.endpoint), item.address)), None)
        if match is not None:
            left.remove(match)
            listener = replace(listener, endpoint=InheritedEndpoint(reactor, match), passed=match)
        chosen.append(listener)
    if left:
        raise ActivationError(
            "systemd passed " + ", ".join(item.describe() for item in left)
            + ", which no --listen or --metrics names"
        )
    return chosen


@implementer(IStreamServerEndpoint)
class InheritedEndpoint:
    """Serves a socket systemd passed; its descriptor is closed once adopted."""

    def __init__(self, reactor: Any, inherited: Inherited) -> None:
        self.reactor = reactor
        self.inherited = inherited

    def listen(self, factory: Any) -> defer.Deferred:
        fd, family = self.inherited.fd, self.inherited.family
        try:
            fdesc.setNonBlocking(fd)
            if family == socket.AF_UNIX:
                port: Any = _InheritedUNIXPort._fromListeningDescriptor(self.reactor, fd, factory)
            else:
                port = FairTCPPort._fromListeningDescriptor(self.reactor, fd, family, factory)
            port.startListening()  # listen() is not called again: systemd's Backlog= stays
            os.close(fd)
        except BaseException:
            return defer.fail()
        return defer.succeed(port)


class _InheritedUNIXPort(FairPort, unix.Port):
    """A UNIX port on a socket systemd owns.  Twisted's own adopted UNIX port would chmod
    a filesystem socket to 0666, and when it stops call shutdown() on the socket (systemd,
    still holding it, sees a hang-up: the socket unit fails) and remove its file."""

    def startListening(self) -> None:
        tcp._reservedFD.reserve()
        assert self.factory is not None and self._preexistingSocket is not None  # made by _fromListeningDescriptor
        self.factory.doStart()
        sock = self._preexistingSocket
        self._preexistingSocket = None
        self._shouldShutdown = False  # as Twisted's TCP port does for an adopted socket
        self.connected = True
        self.socket = sock
        self.fileno = sock.fileno  # type: ignore[method-assign]  # as Twisted's own ports do
        self.numberAccepts = 100
        self.startReading()

    def connectionLost(self, reason: Any) -> None:
        self.stop_admitting()
        tcp.Port.connectionLost(self, reason)
