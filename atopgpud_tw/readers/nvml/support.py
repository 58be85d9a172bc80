"""What a device cannot do: a call's spell of NOT_SUPPORTED, and when it is believed (`Support`)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: NOT_SUPPORTED from a call that has answered is believed once it has held this long and this many polls
HOLD_SECONDS = 30.0
HOLD_POLLS = 20
#: seconds between asking again a call taken as not supported, the last one kept
RETRY_UNSUPPORTED = (60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: seconds between attempts to set NVML up again, doubling up to the last
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)


class Backoff:
    """When to try something that failed again: the next of `delays` after each failure (the
    last one kept), from the first again once it worked."""

    def __init__(self, delays: tuple[float, ...] = BACKOFF) -> None:
        self.delays = delays
        self.at = 0.0
        self.failures = 0

    def due(self, now: float) -> bool:
        return now >= self.at

    def failed(self, now: float) -> None:
        self.at = now + self.delays[min(self.failures, len(self.delays) - 1)]
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0


@dataclass(eq=False)
class Support:
    """One call's spell of NOT_SUPPORTED on one device, and whether it is believed: at once from a
    call that never answered; from one that has, once it has held (a driver answers so for a
    moment during a GPU reset, a MIG change or a driver reload), then asked at `RETRY_UNSUPPORTED`."""

    #: whether the call answered on this device before the spell began
    answered: bool
    since: float
    polls: int = 0
    last: float | None = None
    #: whether the spell is believed (the figure is served as not supported)
    believed: bool = False
    #: what a failed reading of it is logged as, and whether the giving up was said (its problem then stands)
    cause: str = ""
    said: bool = False
    #: when it is asked again once held
    retry: Backoff = field(default_factory=lambda: Backoff(RETRY_UNSUPPORTED))

    def held(self) -> bool:
        return self.polls >= HOLD_POLLS and (self.last or 0.0) - self.since >= HOLD_SECONDS

    def refused(self, now: float) -> bool:
        """Count one refusal; whether it is believed now."""
        if now != self.last:
            self.polls += 1
            self.last = now
        if self.held():
            self.retry.failed(now)
            self.believed = True
        elif not self.answered:
            self.believed = True
        return self.believed

    def may_ask(self, now: float) -> bool:
        """Whether the call is made in this poll: at every poll until the spell has held, then at the backoff."""
        return not self.held() or self.retry.due(now)
