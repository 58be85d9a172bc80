"""The atopgpud wire format, both ways, for the daemon and its clients alike: pure
functions over bytes that import nothing of the daemon.

`wire` frames requests and replies and holds atop's limits, `parse` reads replies
back (for clients and tests), `contexts` the ``P`` request's lines (who the
processes are, for ``atopgpu``), `text` makes text from outside safe to show
(``codec.printable``: a terminal's and a log's).  Everything is importable from here: ``codec.frame``,
``codec.parse_stats``.  The daemon's side, ``T`` and ``S`` bodies made from its
counters within those limits, is `atopgpud_tw.server.atop.render`.  The full description,
with atop's limits, is in docs/protocol.md.  `contexts` and `parse` are loaded at
the first of their names looked up here (`LATER`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from atopgpud_tw.codec.text import *  # noqa: F403
from atopgpud_tw.codec.wire import *  # noqa: F403

if TYPE_CHECKING:
    from atopgpud_tw.codec.contexts import *  # noqa: F403
    from atopgpud_tw.codec.parse import *  # noqa: F403

#: the modules whose names are loaded at their first use: a daemon never parses a reply
#: (parse.py: clients and tests) and makes ``P``'s lines only when a client asks ``P``
#: (contexts.py), so neither is loaded at its start-up
LATER = ("contexts", "parse")


def __getattr__(name: str) -> Any:
    if name in LATER:
        return importlib.import_module(f"{__name__}.{name}")
    for module in LATER:
        found = importlib.import_module(f"{__name__}.{module}")
        if not name.startswith("_") and hasattr(found, name):
            value = getattr(found, name)
            globals()[name] = value  # looked up here from now on, as an imported name
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
