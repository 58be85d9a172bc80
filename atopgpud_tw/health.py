"""One card's health and power figures: what a reader hands the metrics page, as `snapshot` is for a poll.

Both readers fill a `CardHealth` per card when ``/metrics`` is fetched; the page
(server/web/metrics.py) knows nothing of either.  Which figures there are is
the table of figures (figures.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atopgpud_tw.problems import Problems

#: a series: (metric name, ((label, value), ...))
Series = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class CardHealth:
    """One reading of one card: its figures, or none when it could not be read (`lost`)."""

    key: str
    busid: str
    name: str
    values: dict[Series, float] = field(default_factory=dict)
    lost: bool = False
    #: why figures failed in this reading (cause -> text), for the log
    problems: Problems = field(default_factory=Problems)
    #: the card's UUID ("" where it has none), a label of its series for joins
    uuid: str = ""
