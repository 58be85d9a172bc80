"""``atopgpu --health`` and ``--gpm``, from the daemon's ``--metrics`` page (atop's protocol has neither):
checked as a reply is, its keys and columns the table of figures' `Show`.  A GPM figure over a span is
its counter's increase over ``atopgpud_gpu_gpm_seconds``'s: the page is read twice, --watch (or 1) s apart."""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from typing import Any

from atopgpud_tw.atopgpu.cli import columns
from atopgpud_tw.atopgpu.connection import BadReply, ClientError
from atopgpud_tw.codec import printable
from atopgpud_tw.figures import FIGURES, GPM_FIGURES, Show

DEFAULT_URL = "http://127.0.0.1:9445/metrics"
#: seconds to wait for the page (the daemon waits at most 2 s for a stuck NVML call)
FETCH_TIMEOUT = 10.0
_P = "atopgpud_gpu_"
#: the figures shown: the rows of the table of figures with a JSON key (and maybe a column)
_SHOWN = tuple(figure for figure in FIGURES if figure.show is not None)
#: the flags of the clocks-event reasons are shown as one list, of the reasons active
_REASONS = ("clocks_event_reasons",)
_BY_SERIES = {figure.series: figure for figure in _SHOWN}
_FAMILIES = {figure.family.name: figure.family for figure in _SHOWN}
#: the families shown as lists of the reasons active (whatever reasons a daemon names)
_LISTED = {figure.family.name for figure in _SHOWN if figure.show and figure.show.key == _REASONS}
_COLUMNS = tuple(figure.show for figure in _SHOWN if figure.show and figure.show.column)


def fetch(url: str, timeout: float = FETCH_TIMEOUT) -> str:
    """The metrics page at `url`; ClientError (exit status 1) when there is none, BadReply (3) when it is not one."""
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"{url}: not an http:// URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8")
    except urllib.error.HTTPError as error:
        raise BadReply(f"{url}: HTTP {error.code} {error.reason}") from None
    except urllib.error.URLError as error:
        reason = getattr(error.reason, "strerror", None) or str(error.reason)
        raise ClientError(f"{url}: {reason}; is atopgpud running with --metrics?") from None
    except (TimeoutError, OSError) as error:
        raise ClientError(f"{url}: {error.strerror or error}; is atopgpud running with --metrics?") from None
    except UnicodeDecodeError:
        raise BadReply(f"{url}: the page is not UTF-8 text") from None


def _samples(text: str, url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        found = [(s.name, dict(s.labels), float(s.value))
                 for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as error:
        raise BadReply(f"{url}: not a Prometheus text page ({error})") from None
    if not any(name == "atopgpud_build_info" for name, _, _ in found):
        raise BadReply(f"{url}: not an atopgpud metrics page (no atopgpud_build_info)")
    return found


def _blank(labels: dict[str, str]) -> dict[str, Any]:
    """A card's object with every figure null (a per-link figure an empty object by link)."""
    card: dict[str, Any] = {"busid": labels.get("busid", ""), "type": labels.get("type", ""), "present": None,
                            "stale": None, "age_seconds": None}
    for figure in _SHOWN:
        assert figure.show is not None
        if figure.show.key == _REASONS:
            continue
        *path, leaf = figure.show.key
        place = card
        for step in path:
            place = place.setdefault(step, {})
        place.setdefault(leaf, {} if "link" in figure.family.labels else None)
    card["clocks_event_reasons"] = []
    card["xid_errors"] = {}
    return card


def _shown(name: str, labels: dict[str, str]) -> Any:
    """The row of the table a sample is (its labels but ``link``, a per-link figure's); None if it is none."""
    family = _FAMILIES.get(name)
    own = tuple((label, labels.get(label, "")) for label in family.labels if label != "link") if family else ()
    return _BY_SERIES.get((name, own))


def health_report(text: str, url: str) -> dict[str, Any]:
    """The JSON document: one object per card with health figures, null where the card has none."""
    cards: dict[str, dict[str, Any]] = {}

    def card(labels: dict[str, str]) -> dict[str, Any]:
        busid = labels.get("busid", "")
        if busid not in cards:
            cards[busid] = _blank(labels)
        return cards[busid]

    present: dict[str, float] = {}
    for name, labels, value in _samples(text, url):
        if math.isnan(value) or not name.startswith(_P):
            continue
        short = name[len(_P):]
        if short == "present":
            present[labels.get("busid", "")] = value
            continue
        figure = _shown(name, labels)
        if name in _LISTED:
            if value == 1:
                card(labels)["clocks_event_reasons"].append(labels.get("reason", ""))
        elif figure is not None:
            *path, leaf = figure.show.key
            place = _value(card(labels), path)
            if "link" in figure.family.labels:
                place[leaf][labels.get("link", "")] = _whole(value / figure.show.per)
            else:
                place[leaf] = _whole(value / figure.show.per)
        elif short == "health_age_seconds":
            card(labels)["age_seconds"] = _whole(value)
        elif short == "health_stale":
            card(labels)["stale"] = value == 1
        elif short == "xid_errors_total":
            card(labels)["xid_errors"][labels.get("xid", "")] = _whole(value)
        elif short == "xid_events_total":
            card(labels)  # a card that reports XIDs, none yet: listed with {}
        elif short == "xid_last_seconds":
            card(labels)["xid_last"] = _whole(value)
    for busid, found_card in cards.items():
        # a MIG card's instances share its bus id: it is present if any of them is
        values = [v for key, v in present.items() if key == busid or key.startswith(busid + "/")]
        found_card["present"] = bool(max(values)) if values else None
    return {
        "endpoint": url,
        "time": round(time.time(), 3),
        "gpus": sorted(cards.values(), key=lambda c: c["busid"]),
    }


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 3)


def _cell(value: Any, show: Show) -> str:
    return "-" if value is None else f"{value:.{show.decimals}f}{show.unit}"


_HEADER = ("BUSID", "TYPE", *(str(show.column) for show in _COLUMNS), "XID", "THROTTLE")


def _value(gpu: dict[str, Any], key: tuple[str, ...]) -> Any:
    for step in key:
        gpu = gpu[step]
    return gpu


def render_health(doc: dict[str, Any]) -> str:
    """The report as text: one row per card, `-` where the card has no such figure."""
    rows = []
    for gpu in doc["gpus"]:
        xids = ",".join(f"{code}x{count}" for code, count in sorted(gpu["xid_errors"].items())) or "-"
        throttle = ",".join(r for r in gpu["clocks_event_reasons"] if r != "gpu_idle") or "-"
        flags = [flag for flag, on in (("stale", gpu["stale"]), ("gone", gpu["present"] is False)) if on]
        cells = ["-" if (value := _value(gpu, show.key)) is None else show.prefix + _cell(value / show.column_per, show)
                 for show in _COLUMNS]
        rows.append([gpu["busid"], gpu["type"].replace(" ", "_") + (f" ({','.join(flags)})" if flags else ""),
                     *cells, xids, throttle])
    lines = [f"atopgpud health at {printable(doc['endpoint'])}"]
    lines.extend(columns(_HEADER, rows, {0, 1, len(_HEADER) - 2, len(_HEADER) - 1}))
    if not doc["gpus"]:
        lines.append("(no health figures: no GPU, or a reader without them)")
    return "\n".join(lines)


#: the table's GPM rows (figures.GPM_FIGURES), each with its metric and its view
_ROWS = tuple((f.gpm, f.show) for f in GPM_FIGURES if f.gpm is not None and f.show is not None)
#: each GPM counter's series -> the figure's name (``seconds``: the seconds the sums cover)
_GPM_KEYS = {"atopgpud_gpu_gpm_seconds_total": "seconds",
             **{f.family.name: f.gpm.name for f in GPM_FIGURES if f.gpm is not None}}

Counters = dict[tuple[str, str], dict[str, float]]


def gpm_counters(text: str, url: str) -> Counters:
    """The GPM counters of a metrics page, by device (bus id, type)."""
    found: Counters = {}
    for name, labels, value in _samples(text, url):
        key = _GPM_KEYS.get(name)
        if key is not None and not math.isnan(value):
            found.setdefault((labels.get("busid", ""), labels.get("type", "")), {})[key] = value
    return found


def gpm_report(before: Counters, after: Counters, url: str) -> dict[str, Any]:
    """The JSON document: per device, each figure's average between two readings (null where it has none)."""
    gpus = []
    for (busid, kind), now in sorted(after.items()):
        then = before.get((busid, kind), {})
        span = now.get("seconds", 0.0) - then.get("seconds", 0.0)
        entry: dict[str, Any] = {"busid": busid, "type": kind, "seconds": round(span, 3)}
        for gpm, show in _ROWS:
            entry[show.key[0]] = (round((now[gpm.name] - then.get(gpm.name, 0.0)) / span / show.per, 2)
                                  if span > 0 and gpm.name in now else None)
        gpus.append(entry)
    return {"endpoint": url, "time": round(time.time(), 3), "gpus": gpus}


_GPM_SHOWN = tuple(show for _, show in _ROWS if show.column is not None)
_GPM_HEADER = ("BUSID", "TYPE", *(str(show.column) for show in _GPM_SHOWN))


def render_gpm(doc: dict[str, Any]) -> str:
    """The report as text: one row per device, `-` where it has no such figure."""
    rows = [
        [gpu["busid"], gpu["type"].replace(" ", "_"), *(_cell(gpu[show.key[0]], show) for show in _GPM_SHOWN)]
        for gpu in doc["gpus"]
    ]
    lines = [f"atopgpud GPM at {printable(doc['endpoint'])}"]
    lines.extend(columns(_GPM_HEADER, rows, {0, 1}))
    if not doc["gpus"]:
        lines.append("(no GPM figures: no GPU with GPM, Hopper or later)")
    return "\n".join(lines)
