"""Listening: endpoints from --listen strings, the sockets systemd passed in their place,
and every one listening while the service is built.

twistd builds the service before it daemonizes and before the reactor runs; a
listener started later (``StreamServerEndpointService``) that fails only logs a
traceback while the daemon runs on, serving nothing.  Listening in ``makeService``
fails where a service manager and the shell see it: one line, exit status 1.
``unix:@NAME`` is an abstract socket (atop 2.13 connects to ``\\0atopgpud_nvidia``): no file, no lock file.

With ``atopgpud.socket`` enabled, systemd holds ``@atopgpud_nvidia`` (and, with
``atopgpud-tcp.socket``, TCP 127.0.0.1:59123) from early boot: an atop started
before the daemon connects at once, its request waiting in the socket's queue.
Each passed socket (``LISTEN_FDS``) takes the place of the ``--listen`` or
``--metrics`` endpoint with its address; one that no endpoint names is an error
(held open, never answered).  It belongs to systemd: not bound, chmod-ed, shut
down or removed here, and it keeps its backlog.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any, Sequence

from twisted.application.service import Service
from twisted.internet import defer, endpoints, error, fdesc, main, tcp, unix
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, UNIXServerEndpoint, serverFromString
from twisted.internet.interfaces import IListeningPort, IReactorTime, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger, globalLogPublisher
from twisted.python.failure import Failure
from twisted.python.systemd import ListenFDs
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.system.accepting import FairPort, FairTCPPort, fair_reactor

ABSTRACT_PREFIX = "unix:@"
#: as many as the kernel allows (it caps any backlog at net.core.somaxconn, 4096 by default): a
#: burst waits in the queue where Twisted's 50 refused it (at 100,000 connections a second,
#: 4096 places are 41 ms of a daemon that does not get its CPU)
DEFAULT_BACKLOG = 65535
#: what an atop listener beyond loopback shows the network
PROCESS_LISTS = "every GPU process list"


def listen_endpoint(reactor: Any, description: str) -> IStreamServerEndpoint:
    """An endpoint for one --listen value; ValueError for one that makes no sense.

    ``tcp:``, ``unix:`` and abstract sockets listen on fair ports (`accepting`)."""
    reactor = fair_reactor(reactor)
    if description.startswith(ABSTRACT_PREFIX):
        name, _, rest = description[len(ABSTRACT_PREFIX):].partition(":")
        if not name:
            raise ValueError("an abstract socket needs a name: unix:@NAME")
        backlog = DEFAULT_BACKLOG
        for option in filter(None, rest.split(":")):
            key, _, value = option.partition("=")
            if key != "backlog" or not value.isdigit():
                raise ValueError(f"unknown option {option!r} for an abstract socket")
            backlog = int(value)
        return UNIXServerEndpoint(reactor, "\0" + name, backlog=backlog, wantPID=False)
    kind = description.partition(":")[0]
    if kind in ("tcp", "tcp6", "unix") and "backlog=" not in description:
        description += f":backlog={DEFAULT_BACKLOG}"
    try:
        return serverFromString(reactor, description)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(str(error) or "not a valid endpoint description") from None
    except ImportError as error:  # ssl: without pyOpenSSL
        raise ValueError(f"needs the Python module {error.name or error}, which is not installed") from None
    except OSError as error:  # ssl: a key or certificate file it cannot read
        raise ValueError(error.strerror or str(error)) from None


@implementer(IStreamServerEndpoint)
class CheckedEndpoint:
    """Wraps a listening endpoint: warns of a TCP listener open beyond loopback that
    exposes what `exposed` says (None: nothing worth a warning), and gives a
    filesystem socket the group of ``--socket-group`` once it exists."""

    log = ClassLogger("atopgpud_tw.endpoints.CheckedEndpoint")

    def __init__(
        self, endpoint: IStreamServerEndpoint, group: int | None = None, exposed: str | None = PROCESS_LISTS
    ) -> None:
        self.endpoint = endpoint
        self.group = group
        self.exposed = exposed

    def listen(self, factory: Any) -> Any:
        return self.endpoint.listen(factory).addCallback(self._listening)

    def _listening(self, port: Any) -> Any:
        address = port.getHost()
        host = getattr(address, "host", None)
        if host is not None and self.exposed is not None and not _is_loopback(host):
            self.log.warn(
                "listening on {host} port {port}: {exposed} is visible to the "
                "network; use interface=127.0.0.1 unless that is what you want",
                host=host,
                port=address.port,
                exposed=self.exposed,
            )
        path = getattr(address, "name", None)
        if self.group is not None and isinstance(path, (str, bytes)) and path[:1] not in ("\0", b"\0"):
            os.chown(path, -1, self.group)
        return port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Listener:
    """One endpoint to listen on, the factory it serves, and the socket systemd passed in
    its place, if any (`take_inherited`)."""

    description: str
    endpoint: IStreamServerEndpoint
    factory: Any
    passed: Inherited | None = None


class ListeningService(Service):
    """A port already listening: nothing to start, closed when the service stops."""

    def __init__(self, port: IListeningPort) -> None:
        self.port = port

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        _take_lock(self.port)

    def stopService(self) -> Any:
        super().stopService()
        return self.port.stopListening()


def listen_all(listeners: Sequence[Listener], clock: IReactorTime | None = None) -> list[IListeningPort]:
    """Listen on each listener now; if one cannot, those already listening are closed and
    SystemExit says which and why.  With a clock, trouble accepting is logged by `AcceptLog`."""
    ports: list[IListeningPort] = []
    for listener in listeners:
        outcome: list[Any] = []
        listener.endpoint.listen(listener.factory).addBoth(outcome.append)
        if outcome and not isinstance(outcome[0], Failure):
            ports.append(outcome[0])
            if clock is not None and hasattr(outcome[0], "_logger"):
                accepts = AcceptLog(listener.description, clock)
                outcome[0]._logger = Logger(namespace="atopgpud_tw.listening", observer=accepts)
            continue
        for port in ports:
            _close_now(port)
        if not outcome:
            cause = "the endpoint did not start listening at once"
        else:
            _remove_own_lock(outcome[0].value)
            cause = describe(outcome[0].value)
        raise SystemExit(f"atopgpud: cannot listen on {listener.description}: {cause}")
    return ports


#: what Twisted's accept loop logs for each connection closed for want of a descriptor,
#: and for each other failed accept
_EMFILE_CLOSED = "EMFILE recovery: Closed socket from {address}"
_EMFILE_QUIET = ("EMFILE encountered; releasing reserved file descriptor.",
                 "Re-reserving EMFILE recovery file descriptor.")
_NOT_ACCEPTED = "Could not accept new connection ({acceptError})"


@implementer(ILogObserver)
class AcceptLog:
    """One port's trouble accepting, said once per burst rather than in lines per
    connection (Twisted's own took 23.6 MB of log in 10 s)."""

    log = ClassLogger("atopgpud_tw.listening.AcceptLog")

    def __init__(self, where: str, clock: IReactorTime) -> None:
        self.where = where
        self._closed = BurstLog(clock)
        self._failed = BurstLog(clock)

    def __call__(self, event: dict[str, Any]) -> None:
        text = event.get("log_format")
        if text == _EMFILE_CLOSED:
            self._closed.event(
                lambda: self.log.warn(
                    "out of file descriptors: new connections on {where} are closed at once "
                    "until some are free (raise LimitNOFILE=, or lower --max-clients)",
                    where=self.where,
                ),
                f"connections on {self.where} closed for want of file descriptors",
            )
        elif text == _NOT_ACCEPTED:
            error = event.get("acceptError")
            self._failed.event(
                lambda: self.log.warn("cannot accept a connection on {where}: {error}", where=self.where, error=error),
                f"connections on {self.where} not accepted",
            )
        elif text not in _EMFILE_QUIET:
            globalLogPublisher(event)


def describe(problem: BaseException) -> str:
    """The cause of a failed listen in a few words: 'address already in use'."""
    if isinstance(problem, error.CannotListenError):
        cause = problem.socketError
        if cause == "Cannot acquire lock":
            return f"another process holds {_name(problem.port)}.lock"
        problem = cause if isinstance(cause, BaseException) else problem
    if isinstance(problem, OSError) and problem.strerror:
        text = problem.strerror
    else:
        text = str(problem) or type(problem).__name__
    return text[:1].lower() + text[1:]


def _name(path: Any) -> str:
    return os.fsdecode(path) if isinstance(path, (str, bytes)) else str(path)


def _remove_own_lock(problem: BaseException) -> None:
    """A filesystem socket whose bind failed leaves the lock file it took; ours goes."""
    path = getattr(problem, "port", None)
    if not isinstance(path, (str, bytes)) or _name(path).startswith("\0"):
        return
    lock = _name(path) + ".lock"
    with suppress(OSError):
        if os.readlink(lock) == str(os.getpid()):
            os.unlink(lock)


def _take_lock(port: IListeningPort) -> None:
    """A filesystem socket's lock file names the process that listened (twistd's parent
    once daemonized): the daemon takes it over, so that it is released at shutdown."""
    lock = getattr(port, "lockFile", None)
    name = getattr(lock, "name", None)
    if name is None or not getattr(lock, "locked", False):
        return
    name = os.fsdecode(name)
    pid = str(os.getpid())
    if os.readlink(name) != pid:
        os.symlink(pid, name + ".new")
        os.replace(name + ".new", name)


def _close_now(port: IListeningPort) -> None:
    """Close a port while the reactor is not running (stopListening would wait for it)."""
    lost = getattr(port, "connectionLost", None)
    if lost is None:
        port.stopListening()
        return
    port.stopReading()  # type: ignore[attr-defined]
    lost(Failure(main.CONNECTION_DONE))


#: ("unix", name as bytes) or ("tcp", ip address, port)
Address = tuple[Any, ...]

_ANY = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


@dataclass(frozen=True)
class Inherited:
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
    """The listening sockets systemd passed, in order: as Twisted's endpoints module read (and
    took out of the environment) ``LISTEN_FDS`` at import, asked of it directly (``serverFromString``
    writes ``dropin.cache``: a warning on a read-only file system); ``LISTEN_FDNAMES`` taken out here."""
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
