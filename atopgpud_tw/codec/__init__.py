"""The atopgpud wire format, both ways: pure functions over bytes.

`wire` frames requests and replies and holds atop's limits, `render` makes ``T``
and ``S`` bodies from the counters, `parse` reads replies back (for clients and
tests).  Everything is importable from here: ``codec.frame``, ``codec.render_stats``,
``codec.parse_stats``.  The full description, with atop's limits, is in
docs/protocol.md.
"""

from atopgpud_tw.codec.parse import *  # noqa: F403
from atopgpud_tw.codec.render import *  # noqa: F403
from atopgpud_tw.codec.wire import *  # noqa: F403
