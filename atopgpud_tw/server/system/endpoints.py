"""Listening endpoints from --listen strings, with ``unix:@NAME`` for abstract sockets.

Twisted's endpoint strings cover TCP and filesystem UNIX sockets
(``unix:/run/atopgpud/atopgpud.sock:mode=660``).  An abstract socket has no file
(atop 2.13 connects to ``\\0atopgpud_nvidia``), so it gets no lock file either.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from twisted.internet.endpoints import UNIXServerEndpoint, serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint
from zope.interface import implementer

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.server.system.accepting import fair_reactor

ABSTRACT_PREFIX = "unix:@"
#: as many as the kernel allows: it caps any backlog at net.core.somaxconn (4096 by
#: default), so that sysctl decides.  A burst of connections waits in the queue
#: instead of being refused, where Twisted's default of 50 refused them; and a host
#: that raises net.core.somaxconn gives a flooded listener that much more time
#: before a new client's connect is refused (at 100,000 connections a second, 4096
#: places are 41 ms of a daemon that does not get its CPU)
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
