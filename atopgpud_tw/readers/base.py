"""What every reader provides, and the error that says one cannot be used here."""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred
from zope.interface import Attribute, Interface

from atopgpud_tw.snapshot import Snapshot


class ReaderUnavailable(Exception):
    """This reader cannot work on this machine; the message says why, in one line."""


class IReader(Interface):
    """A source of Snapshots, one per poll."""

    name = Attribute("a short name for logs: 'nvml', 'nvidia-smi', 'sim'")

    def open() -> Snapshot:
        """At start-up, before the reactor runs (it may block): the devices found, by identity, for ``T``
        to list before the first poll; ReaderUnavailable if the reader cannot work."""

    def poll() -> Deferred:
        """Read every device once, never blocking the reactor; fires with a Snapshot or fails this poll."""

    def close() -> Deferred | None:
        """Release what the reader holds; a Deferred, if any, fires when done (stopping waits briefly)."""

    watchdog = Attribute("the HangWatchdog over the calls in the reader's own thread (on /metrics), or None")

    def health(wanted: Callable[[str], bool]) -> list[tuple[str, Deferred]]:
        """The health figures (`health.CardHealth`) of each card `wanted` (by key), a Deferred each (/metrics)."""

    def xid_counts() -> Deferred | None:
        """A Deferred firing with the XID errors counted so far, by (card key, XID); None if not counted."""


class PollError(Exception):
    """A poll failure the reader understands (a timeout, a garbled report): logged in one line, no traceback."""
