"""The health and power figures of a simulated GPU: the ``health`` object (docs/simulator.md).

Each figure is a played value: a number, a list cycled one entry per simulated second (so what
is reported does not depend on who asks how often), steps, or ``null`` (NOT_SUPPORTED).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable

from atopgpud_tw import checks
from atopgpud_tw.figures import NVLINK_MAX_LINKS, Number, Play, link_fields, played_fields

#: field -> its `Play` (default, bounds); every one may be null (not supported)
FIELDS: dict[str, Play] = played_fields()
#: the fields of one NVLink (an entry of ``nvlink``), besides ``active``
LINK_FIELDS: dict[str, Play] = link_fields()
KNOWN = set(FIELDS) | {"xid_events", "nvlink"}


@dataclass(frozen=True)
class Played:
    """A value over simulated time: constant, cycled per second, or steps."""

    constant: Number | None = None
    cycle: tuple[Number, ...] = ()
    steps: tuple[tuple[float, Number], ...] = ()

    def at(self, t: float) -> Number:
        if self.cycle:
            return self.cycle[int(math.floor(t)) % len(self.cycle)]
        if self.steps:  # the last step by `t`; before the first, its value
            return self.steps[max(0, bisect_right([when for when, _ in self.steps], t) - 1)][1]
        assert self.constant is not None
        return self.constant

    def integral(self, t: float) -> float:
        """The integral of the value from 0 to `t`."""
        if t <= 0:
            return 0.0
        if self.cycle:
            whole, rest = int(math.floor(t)), t - math.floor(t)
            n = len(self.cycle)
            done = (whole // n) * sum(self.cycle) + sum(self.cycle[: whole % n])
            return done + self.cycle[whole % n] * rest
        if self.steps:
            total, start, value = 0.0, 0.0, self.steps[0][1]
            for when, step in self.steps:
                if when >= t:
                    break
                if when > start:
                    total += value * (when - start)
                    start = when
                value = step
            return total + value * (t - start)
        assert self.constant is not None
        return float(self.constant) * t


@dataclass(frozen=True)
class HealthSpec:
    """A GPU's health figures: field name -> Played, or None where it cannot report it."""

    figures: tuple[tuple[str, Played | None], ...] = ()
    #: (time, XID code): an XID critical-error event at that time
    xid_events: tuple[tuple[float, int], ...] = ()
    #: the device has XID events (``"xid_events": null``: registering for them is NOT_SUPPORTED)
    xid_supported: bool = True
    #: its NVLinks, or None: it has none (nvmlDeviceGetNvLinkState is NOT_SUPPORTED)
    nvlink: tuple[LinkSpec, ...] | None = None

    def played(self, name: str) -> Played | None:
        return dict(self.figures).get(name)


@dataclass(frozen=True)
class LinkSpec:
    """One NVLink: whether it is active, and its figures (throughput played in KiB/s, errors as counts)."""

    active: bool = True
    figures: tuple[tuple[str, Played | None], ...] = ()

    def played(self, name: str) -> Played | None:
        return dict(self.figures).get(name)


def default_health() -> HealthSpec:
    return parse_health(None, "health", ValueError)


def parse_health(value: Any, where: str, error: Callable[[str], Exception]) -> HealthSpec:
    """Check a scenario GPU's ``health`` object (None: every default)."""
    spec = checks.known({} if value is None else value, where, KNOWN, error)
    figures = _figures(spec, where, FIELDS, error)
    links = _links(spec.get("nvlink"), f"{where}.nvlink", error)
    events = []
    listed = spec.get("xid_events", [])
    if listed is None:
        return HealthSpec(figures, (), xid_supported=False, nvlink=links)
    if not isinstance(listed, list):
        raise error(f"{where}.xid_events must be a list of [time, xid]")
    for i, entry in enumerate(listed):
        if (
            not isinstance(entry, list) or len(entry) != 2 or not checks.is_number(entry[0]) or entry[0] < 0
            or isinstance(entry[1], bool) or not isinstance(entry[1], int) or entry[1] <= 0
        ):
            raise error(f"{where}.xid_events[{i}] must be [time, xid]: seconds >= 0 and a positive integer")
        events.append((float(entry[0]), entry[1]))
    return HealthSpec(figures, tuple(sorted(events)), nvlink=links)


def _figures(spec: dict[str, Any], where: str, fields: dict[str, Play], error: Callable[[str], Exception]
             ) -> tuple[tuple[str, Played | None], ...]:
    """Each of `fields` played as `spec` has it, or its default."""
    played = ((name, spec.get(name, play.default), play) for name, play in fields.items())
    return tuple((name, None if raw is None else _played(raw, f"{where}.{name}", play.low, play.high, error))
                 for name, raw, play in played)


def _links(value: Any, where: str, error: Callable[[str], Exception]) -> tuple[LinkSpec, ...] | None:
    """``nvlink``: null (no NVLink), or a list of links, each an object of played fields and ``active``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > NVLINK_MAX_LINKS:
        raise error(f"{where} must be null or a list of at most {NVLINK_MAX_LINKS} links")
    links = []
    for i, link in enumerate(value):
        here = f"{where}[{i}]"
        checks.known(link, here, {*LINK_FIELDS, "active"}, error)
        links.append(LinkSpec(checks.flag(link.get("active", True), f"{here}.active", error),
                              _figures(link, here, LINK_FIELDS, error)))
    return tuple(links)


#: what a played value is, in words
_PLAYED = 'a number, a list of numbers, {"steps": [[t, v], ...]} or null'


def _played(value: Any, where: str, low: float, high: float | None, error: Callable[[str], Exception]) -> Played:
    if isinstance(value, dict):
        if set(value) != {"steps"} or not isinstance(value["steps"], list) or not value["steps"]:
            raise error(f"{where} as an object must be {{\"steps\": [[t, v], ...]}}, at least one step")
        steps: list[Any] = []
        for i, step in enumerate(value["steps"]):
            if not isinstance(step, list) or len(step) != 2 or not checks.is_number(step[0]) or step[0] < 0:
                raise error(f"{where}.steps[{i}] must be [t, v] with t >= 0")
            if steps and step[0] <= steps[-1][0]:
                raise error(f"{where}.steps[{i}] must come after the step before it")
            steps.append((float(step[0]), checks.number(step[1], f"{where}.steps[{i}]", error, low, high, _PLAYED)))
        return Played(steps=tuple(steps))
    found = checks.cycled(value, where, error, low, high, _PLAYED)
    return Played(cycle=found) if isinstance(found, tuple) else Played(constant=found)
