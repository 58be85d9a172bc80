"""The atopgpud wire format, both ways, for the daemon and its clients alike: pure functions over
bytes that import nothing of the daemon (docs/protocol.md).

`wire` frames requests and replies and holds atop's limits, `parse` reads replies back, `contexts`
the ``P`` request's lines, `text` makes text from outside safe to show.  Everything is importable
from here (``codec.frame``, ``codec.parse_stats``); ``T`` and ``S`` bodies are made by
`atopgpud_tw.server.atop.render`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from atopgpud_tw.codec.text import *  # noqa: F403
from atopgpud_tw.codec.wire import *  # noqa: F403

if TYPE_CHECKING:
    from atopgpud_tw.codec.contexts import *  # noqa: F403
    from atopgpud_tw.codec.parse import *  # noqa: F403

#: the modules loaded at the first of their names looked up here (a daemon never parses a reply)
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
