"""Listening endpoints from --listen strings, with ``unix:@NAME`` for abstract sockets.

Twisted's endpoint strings cover TCP and filesystem UNIX sockets
(``unix:/run/atopgpud/atopgpud.sock:mode=660``).  An abstract socket has no file
(atop 2.13 connects to ``\\0atopgpud_nvidia``), so it gets no lock file either.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.endpoints import UNIXServerEndpoint, serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint

ABSTRACT_PREFIX = "unix:@"


def listen_endpoint(reactor: Any, description: str) -> IStreamServerEndpoint:
    """An endpoint for one --listen value; ValueError for one that makes no sense."""
    if description.startswith(ABSTRACT_PREFIX):
        name, _, rest = description[len(ABSTRACT_PREFIX):].partition(":")
        if not name:
            raise ValueError("an abstract socket needs a name: unix:@NAME")
        backlog = 50
        for option in filter(None, rest.split(":")):
            key, _, value = option.partition("=")
            if key != "backlog" or not value.isdigit():
                raise ValueError(f"unknown option {option!r} for an abstract socket")
            backlog = int(value)
        return UNIXServerEndpoint(reactor, "\0" + name, backlog=backlog, wantPID=False)
    try:
        return serverFromString(reactor, description)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(str(error) or "not a valid endpoint description") from None
