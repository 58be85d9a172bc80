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
        """Check at start-up that the reader can work; raise ReaderUnavailable if not.

        Returns the devices found, by identity (their readings are not used), so
        that ``T`` lists them before the first poll.  May block (it runs once,
        before the reactor starts).
        """

    def poll() -> Deferred:
        """Read every device once; the Deferred fires with a Snapshot.

        Never blocks the reactor.  A failure fails this poll only.
        """

    def close() -> Deferred | None:
        """Release what the reader holds (NVML, child processes); may return a
        Deferred that fires when done (stopping waits for it, briefly)."""

    watchdog = Attribute(
        "the HangWatchdog over the calls in the reader's own thread (its figures are on /metrics); "
        "None for a reader with no such thread"
    )

    def health(wanted: Callable[[str], bool]) -> list[tuple[str, Deferred]]:
        """The health figures (`health.CardHealth`) of each card `wanted` (by key),
        one Deferred per card; only ``/metrics`` asks, when it is scraped."""

    def xid_counts() -> Deferred | None:
        """A Deferred firing with the XID errors counted so far, by (card key, XID);
        None where the reader cannot count them."""


class PollError(Exception):
    """A poll failure the reader understands (a timeout, a garbled report).

    The poller logs it as one line, without a traceback.
    """
