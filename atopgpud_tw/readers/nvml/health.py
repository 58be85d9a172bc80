"""A card's health and power figures (`CardHealth`) and its XID errors, read through NVML in the reader's thread.

`read_card_health` asks one card for every figure the metrics page shows, each as its row
of the table of figures (atopgpud_tw/figures.py) says; only when the page is fetched.
`XidEvents` keeps one NVML event set for XID critical errors and drains it without
waiting whenever the figures are read, counting the events by card and XID code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from atopgpud_tw.nvml_codes import (
    EVENT_XID,
    NOT_SUPPORTED,
    SUCCESS,
    TIMEOUT,
    VALUE_TYPE_DOUBLE,
    VALUE_TYPE_SIGNED_INT,
    VALUE_TYPE_SIGNED_LONG_LONG,
    VALUE_TYPE_UNSIGNED_INT,
    VALUE_TYPE_UNSIGNED_LONG,
    VALUE_TYPE_UNSIGNED_LONG_LONG,
    VALUE_TYPE_UNSIGNED_SHORT,
)
from atopgpud_tw.readers.nvml.calls import (
    Attempt,
    Failed,
    Interrupted,
    Missing,
    NvmlSession,
    Outcome,
    Unsupported,
    answer,
    answer_first,
    given,
    nothing_there,
)
from atopgpud_tw.readers.nvml.device import NvmlDevice
from atopgpud_tw.readers.nvml.direct import handle_value

if TYPE_CHECKING:
    from atopgpud_tw.figures import Ask, Figure, Labels
    from atopgpud_tw.health import CardHealth, Series

#: events taken from the set per reading at most (a storm is counted over later readings)
MAX_EVENTS = 1000
#: nvmlValueType_t -> the member of c_nvmlValue_t that holds it
VALUE_MEMBERS = {
    VALUE_TYPE_DOUBLE: "dVal", VALUE_TYPE_UNSIGNED_INT: "uiVal", VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", VALUE_TYPE_SIGNED_INT: "siVal",
    VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


@cache
def asked() -> tuple[Figure, ...]:
    """The rows of the table of figures that have an NVML call (loaded at the first scrape)."""
    from atopgpud_tw.figures import FIGURES

    return tuple(figure for figure in FIGURES if figure.nvml is not None)


def read_card_health(device: NvmlDevice) -> CardHealth:
    """Every health figure of one card, as it is now (runs in the worker thread)."""
    from atopgpud_tw.health import CardHealth

    reading = CardHealth(device.key, device.busid, device.name, uuid=device.info.uuid)
    attempt = Attempt(device, reading.problems)
    failure = answer(_read_values, device, attempt, reading.values, catch=Interrupted)
    if failure is not None:  # the card lost, or NVML to be set up again
        reading.values = {}
        reading.lost = True
        attempt.note(failure.cause, key="health lost")
    return reading


def _read_values(device: NvmlDevice, attempt: Attempt, values: dict[Series, float]) -> None:
    answers: dict[tuple[Any, ...], Any] = {}
    fields: list[tuple[Figure, int | None]] = []

    def ask(figures: list[Figure], link: int | None) -> None:
        for figure in figures:
            how = figure.nvml
            assert how is not None
            if how.field is not None:
                fields.append((figure, link))
            else:
                found = _answer(device, attempt, answers, how, () if link is None else (link,))
                _store(values, figure, _labels(figure, link), found)

    per_link = [figure for figure in asked() if figure.nvml and figure.nvml.per_link]
    ask([figure for figure in asked() if not (figure.nvml and figure.nvml.per_link)], None)
    for link in _active_links(device, attempt) if per_link else ():
        ask(per_link, link)
    _field_values(device, values, attempt, fields)


def _labels(figure: Figure, link: int | None) -> Labels:
    """A figure's labels, with its NVLink's where it is one per link."""
    return figure.labels if link is None else (*figure.labels, ("link", str(link)))


def _answer(device: NvmlDevice, attempt: Attempt, answers: dict[tuple[Any, ...], Any], how: Ask,
            link: tuple[int, ...]) -> Any:
    """The answer of one call (asked once per reading however many figures it has), through the
    function's older names where the binding or the driver lacks it; None: not supported or failed."""
    key = (how.function, how.args, how.variant, link)
    if key not in answers:
        variant = how.variant and (f"{how.variant} link {link[0]}" if link else how.variant)
        args = (*link, *how.args)
        older = [(function, None, args) for function in how.older]
        answers[key] = attempt(answer_first, NvmlDevice.call, device, (how.function, variant, args), *older,
                               unsupported=None)
    return answers[key]


def _store(values: dict[Series, float], figure: Figure, labels: Labels, answer: Any) -> None:
    """One figure of an answer, as its row says: an element, a bit, a flag, or a number times its scale."""
    how = figure.nvml
    if answer is None or how is None:
        return
    if how.pick is not None:
        answer = answer[how.pick] if isinstance(how.pick, int) else getattr(answer, how.pick)
    if how.bit is not None:
        value: float = 1 if int(answer) & how.bit else 0
    elif how.flag:
        value = 1 if answer else 0
    elif how.below is not None and not 0 <= int(answer) < how.below:
        return  # NVML's "unknown"
    elif how.below is not None:
        value = float(answer)
    else:
        value = float(answer) * how.scale
    values[(figure.family.name, labels)] = value


#: what `_active_links` is given for a link past the card's last (or a card without NVLink)
_NO_LINK = object()


def _active_links(device: NvmlDevice, attempt: Attempt) -> list[int]:
    """The card's active NVLinks: links are asked in order until one the card does not have."""
    from atopgpud_tw.figures import NVLINK_MAX_LINKS

    active = []
    for link in range(NVLINK_MAX_LINKS):
        found = answer(device.call, "nvmlDeviceGetNvLinkState", link, variant=f"nvmlDeviceGetNvLinkState link {link}")
        # past the last link: not a problem; not supported: no NVLink at all (link 0), or no more
        # links (not asked again but at its backoff)
        found = _NO_LINK if nothing_there(found) else attempt.answered(found, unsupported=_NO_LINK)
        if found is None or found is _NO_LINK:
            break
        if found:
            active.append(link)
    return active


def _field_values(device: NvmlDevice, values: dict[Series, float], attempt: Attempt,
                  fields: list[tuple[Figure, int | None]]) -> None:
    """The figures of ``nvmlDeviceGetFieldValues``, one call for them all; a field that is
    NOT_SUPPORTED (each entry has a code of its own) is not asked again."""
    wanted = []
    for figure, link in fields:
        how = figure.nvml
        assert how is not None and how.field is not None
        variant = how.variant or f"nvmlDeviceGetFieldValues {how.field}"
        variant = variant if link is None else f"{variant} link {link}"
        if variant not in device.unsupported and variant not in device.missing:
            wanted.append((figure, how, link, variant))
    if not wanted:
        return
    # a per-link field is asked with the link as its scope
    ids = [how.field if link is None else (how.field, link) for _, how, link, _ in wanted]
    found = attempt(device.call, "nvmlDeviceGetFieldValues", ids, unsupported=None)
    if found is None:
        return
    for index, (figure, how, link, variant) in enumerate(wanted):
        entry = found[index]
        if int(entry.nvmlReturn) == NOT_SUPPORTED:
            device.unsupported.add(variant)
        elif int(entry.nvmlReturn) == SUCCESS:
            member = VALUE_MEMBERS.get(int(entry.valueType), "uiVal")
            values[(figure.family.name, _labels(figure, link))] = float(getattr(entry.value, member)) * how.scale


@dataclass
class XidEvents:
    """XID critical errors from one NVML event set, counted by card key and XID code."""

    #: the reader's session, whose binding makes the calls
    session: NvmlSession
    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    #: the cards that report XIDs (their keys), and whether any can
    supported: set[str] = field(default_factory=set)
    _set: Any = None
    _registered: dict[int, str] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)
    _unavailable: bool = False

    def drain(self, devices: list[NvmlDevice]) -> tuple[dict[tuple[str, int], int], set[str]]:
        """Register new cards, take every event due: the counts, and the cards that report XIDs."""
        failure = None if self._unavailable or not devices else answer(self._drain, devices, catch=Outcome)
        if isinstance(failure, Unsupported):
            self._unavailable = True  # a driver or a binding without events (or without XID events)
        elif failure is not None:
            self._set = None  # NVML set up again, or the set gone: a new one next time
            # no NVML error: a binding that cannot do events
            self._unavailable = isinstance(failure, Failed) and failure.value is None
        return dict(self.counts), set(self.supported)

    def _drain(self, devices: list[NvmlDevice]) -> None:
        """Register the cards not yet registered, then count the events due."""
        if self._set is None:
            self._set = self.session.call("nvmlEventSetCreate")
            self._registered = {}
        for device in devices:
            pointer = _pointer(device.handle)
            if pointer in self._registered or device.key in self._refused:
                continue
            found = answer(self.session.call, "nvmlDeviceRegisterEvents", device.handle, EVENT_XID, self._set,
                           where=device.where)
            if isinstance(found, Unsupported) and not isinstance(found, Missing):
                self._refused.add(device.key)  # this card reports no XIDs
                continue
            given(found)
            self._registered[pointer] = device.key
            self.supported.add(device.key)
        if not self._registered:
            return
        for _ in range(MAX_EVENTS):
            event = answer(self.session.call, "nvmlEventSetWait_v2", self._set, 0)
            if isinstance(event, Failed) and event.value == TIMEOUT:
                return  # none due
            given(event)
            key = self._registered.get(_pointer(event.device))
            if key is not None and int(event.eventType) & EVENT_XID:
                code = int(event.eventData)
                self.counts[(key, code)] = self.counts.get((key, code), 0) + 1


def _pointer(handle: Any) -> int:
    """A device handle's pointer value, to tell which card an event is of."""
    return int(handle_value(handle, id(handle)) or 0)
