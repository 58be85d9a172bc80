"""What a device cannot do: a call's spell of NOT_SUPPORTED, and when it is believed (`Support`)."""

from __future__ import annotations

from dataclasses import dataclass

#: NOT_SUPPORTED from a call that has answered is believed once it has held this
#: long and for this many polls, whichever is longer; until then it is a failed reading
HOLD_SECONDS = 30.0
HOLD_POLLS = 20
#: seconds between asking again a call taken as not supported, the last one kept
RETRY_UNSUPPORTED = (60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


@dataclass(eq=False)
class Support:
    """One call's spell of NOT_SUPPORTED on one device, and whether it is believed.

    From a call that has answered on this device, NOT_SUPPORTED is a failed
    reading until it has held for `HOLD_SECONDS` and `HOLD_POLLS` polls (a driver
    answers so for a moment during a GPU reset, a MIG change or a driver
    reload); then it is believed.  From a call that never answered, it is
    believed at once: that is what the device is.  A call believed unsupported
    is asked again at every poll until the spell has held as long, then at
    `RETRY_UNSUPPORTED`; when it answers it is served again.
    """

    #: whether the call answered on this device before the spell began
    answered: bool
    since: float
    polls: int = 0
    last: float | None = None
    #: whether the spell is believed (the figure is served as not supported)
    believed: bool = False
    #: what a failed reading of it is logged as, and whether the giving up was said (then that
    #: problem stands while it is given up, and its recovery is the line that says it is back)
    cause: str = ""
    said: bool = False
    #: when it is asked again once held, and how many times it was
    retry_at: float = 0.0
    retries: int = 0

    def held(self) -> bool:
        return self.polls >= HOLD_POLLS and (self.last or 0.0) - self.since >= HOLD_SECONDS

    def refused(self, now: float) -> bool:
        """Count one refusal; whether it is believed now."""
        if now != self.last:
            self.polls += 1
            self.last = now
        if self.held():
            # asked again at the next delay
            self.retry_at = now + RETRY_UNSUPPORTED[min(self.retries, len(RETRY_UNSUPPORTED) - 1)]
            self.retries += 1
            self.believed = True
        elif not self.answered:
            self.believed = True
        return self.believed

    def may_ask(self, now: float) -> bool:
        """Whether the call is made in this poll: at every poll until the spell has held, then at the backoff."""
        return not self.held() or now >= self.retry_at
