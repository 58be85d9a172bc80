"""The atopgpud wire format, both ways, for the daemon and its clients alike: pure
functions over bytes that import nothing of the daemon.

`wire` frames requests and replies and holds atop's limits, `parse` reads replies
back (for clients and tests), `contexts` the ``P`` request's lines (who the
processes are, for ``atopgpu``), `text` makes text from outside safe to show
(``codec.printable``: a terminal's and a log's).  Everything is importable from here: ``codec.frame``,
``codec.parse_stats``.  The daemon's side, ``T`` and ``S`` bodies made from its
counters within those limits, is `atopgpud_tw.server.atop.render`.  The full description,
with atop's limits, is in docs/protocol.md.
"""

from atopgpud_tw.codec.contexts import *  # noqa: F403
from atopgpud_tw.codec.parse import *  # noqa: F403
from atopgpud_tw.codec.text import *  # noqa: F403
from atopgpud_tw.codec.wire import *  # noqa: F403
