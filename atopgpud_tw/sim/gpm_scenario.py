"""What a simulated GPU's GPM plays: the ``gpm`` object of a scenario GPU (docs/simulator.md, GPM).

Its activities are fixed shares of the graphics (or memory) activity, its traffic MiB/s while
active; a GPU without ``gpm`` has none, as before Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from atopgpud_tw import checks
from atopgpud_tw.figures import GPM_FIGURES, Play

#: the fields of a ``gpm`` object, each with its default and bounds: the table's GPM rows
#: (figures.GPM_FIGURES), whose `Play` says which activity a field is a share (or a rate) of
FIELDS: dict[str, Play] = {f.play.field: f.play for f in GPM_FIGURES if f.gpm is not None and f.play is not None}
#: the traffic rates, MiB/s while fully active
RATES = tuple(f.play.field for f in GPM_FIGURES if f.gpm is not None and f.gpm.rate and f.play is not None)
_DEFAULTS = tuple((name, float(play.default or 0)) for name, play in FIELDS.items())


@dataclass(frozen=True)
class GpmSpec:
    """A GPU's GPM: how its activities follow its graphics and memory activity, each field of
    `FIELDS` with its value (in `FIELDS`' order)."""

    values: tuple[tuple[str, float], ...] = _DEFAULTS

    def value(self, name: str) -> float:
        """A field's value (KeyError for no field of the table's)."""
        return dict(self.values)[name]


def parse_gpm(value: Any, where: str, error: Callable[[str], Exception]) -> GpmSpec | None:
    """Check a scenario GPU's ``gpm``: absent, null or false for none, true or an object for GPM."""
    if value is None or value is False:
        return None
    if value is True:
        return GpmSpec()
    if not isinstance(value, dict):
        raise error(f"{where} must be true, false or an object")
    checks.known(value, where, FIELDS, error)
    found = dict(_DEFAULTS)
    for name, play in FIELDS.items():
        if name in value:
            assert play.high is not None
            found[name] = float(checks.number(value[name], f"{where}.{name}", error, 0, play.high))
    return GpmSpec(tuple(found.items()))
