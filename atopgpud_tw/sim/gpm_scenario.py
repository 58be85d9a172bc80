"""What a simulated GPU's GPU Performance Monitoring (GPM) plays: the ``gpm`` object of a scenario GPU.

GPM (NVML on Hopper and later) is a set of hardware counters: a sample is a
snapshot of them, and a metric is worked out from two samples as the average
over the time between them.  The simulator plays it from the timelines that
drive the utilization sample buffer: the graphics activity of a card (or of a
MIG GPU instance) over a span is exactly its ``gpu_timeline`` (or ``gpu_util``)
busy share of that span, and the other activities are fixed shares of it:

- ``sm_share``: SM activity per unit of graphics activity (the SMs busy while
  something runs), likewise ``occupancy_share``, ``tensor_share``,
  ``fp64_share``, ``fp32_share`` and ``fp16_share``;
- ``dram_share``: DRAM bandwidth use per unit of memory activity
  (``mem_timeline`` or ``mem_util``);
- ``pcie_tx_mib_s``, ``pcie_rx_mib_s``, ``nvlink_tx_mib_s``,
  ``nvlink_rx_mib_s``: MiB per second moved while active (times the graphics
  activity).

A GPU without a ``gpm`` object has no GPM (nvmlGpmQueryDeviceSupport says it
is not supported, as on GPUs before Hopper).  docs/simulator.md lists the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

#: the C symbols of GPM (atopgpud_tw/sim/gpm_library.py)
GPM_SYMBOLS = (
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
)

#: the shares, each 0 to 1
SHARES = ("sm_share", "occupancy_share", "tensor_share", "fp64_share", "fp32_share", "fp16_share", "dram_share")
#: the traffic rates, MiB/s while fully active
RATES = ("pcie_tx_mib_s", "pcie_rx_mib_s", "nvlink_tx_mib_s", "nvlink_rx_mib_s")
#: no link of today's GPUs moves more (NVLink 5: 1.8 TB/s)
MAX_RATE = 10_000_000


@dataclass(frozen=True)
class GpmSpec:
    """A GPU's GPM: how its activities follow its graphics and memory activity."""

    sm_share: float = 0.9
    occupancy_share: float = 0.5
    tensor_share: float = 0.0
    fp64_share: float = 0.0
    fp32_share: float = 0.0
    fp16_share: float = 0.0
    dram_share: float = 1.0
    pcie_tx_mib_s: float = 0.0
    pcie_rx_mib_s: float = 0.0
    nvlink_tx_mib_s: float = 0.0
    nvlink_rx_mib_s: float = 0.0


_KNOWN = {f.name for f in fields(GpmSpec)}


def parse_gpm(value: Any, where: str, error: Callable[[str], Exception]) -> GpmSpec | None:
    """Check a scenario GPU's ``gpm``: absent, null or false for none, true or an object for GPM."""
    if value is None or value is False:
        return None
    if value is True:
        return GpmSpec()
    if not isinstance(value, dict):
        raise error(f"{where} must be true, false or an object")
    for key in value:
        if key not in _KNOWN and not str(key).startswith("_"):
            raise error(f"{where}.{key} is not a known field")
    found: dict[str, float] = {}
    for name in SHARES + RATES:
        if name not in value:
            continue
        number = value[name]
        top = 1 if name in SHARES else MAX_RATE
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= top:
            raise error(f"{where}.{name} must be a number from 0 to {top}")
        found[name] = float(number)
    return GpmSpec(**found)
