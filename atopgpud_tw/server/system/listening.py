"""Listen while the service is built, so that an endpoint that cannot listen ends start-up.

twistd builds the service before it daemonizes and before the reactor runs; a
listener started later (``StreamServerEndpointService``) that fails only logs a
traceback while the daemon runs on, serving nothing.  Listening in ``makeService``
fails where a service manager and the shell see it: one line, exit status 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from twisted.application.service import Service
from twisted.internet import error, main
from twisted.internet.interfaces import IListeningPort, IReactorTime, IStreamServerEndpoint
from twisted.logger import ILogObserver, Logger, globalLogPublisher
from twisted.python.failure import Failure
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog

if TYPE_CHECKING:
    from atopgpud_tw.server.system.activation import Inherited


@dataclass(frozen=True)
class Listener:
    """One endpoint to listen on, the factory it serves, and the socket systemd passed in
    its place, if any (`activation.take_inherited`)."""

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
        if isinstance(cause, str) and cause == "Cannot acquire lock":
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
    try:
        if os.readlink(lock) == str(os.getpid()):
            os.unlink(lock)
    except OSError:
        pass


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
