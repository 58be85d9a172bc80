"""The names log lines carry: fixed, whatever module the code lives in.

A log line names its source, ``[atopgpud_tw.protocol.AtopGpuProtocol#warn]``;
sites filter the journal on these names and docs/reliability.md quotes them, so
they are part of what the daemon promises.  Twisted's `Logger` takes the name
from the module (and class) it is declared in, which would change them each
time a module moves: every logger of the daemon is given its name instead, a
module's as ``Logger(namespace=...)``, a class's as `ClassLogger`.
"""

from __future__ import annotations

from twisted.logger import Logger


class ClassLogger(Logger):
    """A class attribute logger under a fixed namespace; like `Logger` as a
    descriptor, its events' source is the instance (or class) it is read from."""

    def __get__(self, instance: object, owner: type | None = None) -> Logger:
        return Logger(self.namespace, owner if instance is None else instance, self.observer)
