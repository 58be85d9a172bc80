"""The names log lines carry: fixed, whatever module the code lives in.

Sites filter the journal on a line's source (``[atopgpud_tw.protocol.AtopGpuProtocol#warn]``),
so it must not change when a module moves, as Twisted's `Logger` default would: every
logger is given its name, a module's as ``Logger(namespace=...)``, a class's as `ClassLogger`.
"""

from __future__ import annotations

from twisted.logger import Logger


class ClassLogger(Logger):
    """A class attribute logger under a fixed namespace; like `Logger` as a
    descriptor, its events' source is the instance (or class) it is read from."""

    def __get__(self, instance: object, owner: type | None = None) -> Logger:
        return Logger(self.namespace, owner if instance is None else instance, self.observer)
