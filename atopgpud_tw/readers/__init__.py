"""Readers: where a Snapshot comes from (NVML, nvidia-smi, the simulator).

`make_reader` picks and opens one at start-up; it raises `ReaderUnavailable`
with a one-line reason when none can work here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.logger import Logger

from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.snapshot import Snapshot

log = Logger(namespace="atopgpud_tw.readers")

READERS = ("auto", "nvml", "nvidia-smi", "sim")


@dataclass(frozen=True)
class ReaderSettings:
    """What a reader is made from: the options that concern readers, and nothing else."""

    #: auto (nvml, then nvidia-smi), nvml, nvidia-smi or sim
    kind: str = "auto"
    #: how a card in MIG mode is shown (snapshot.MIG_MODES)
    mig: str = "instances"
    #: the simulator's scenario file (sim; None: the built-in demo)
    scenario: str | None = None
    #: the nvidia-smi binary (None: found on PATH)
    smi_path: str | None = None
    #: seconds an nvidia-smi run may take
    smi_timeout: float = 5.0
    #: seconds an NVML call may run before it is logged as hung (None: the watchdog's default)
    hang_warning: float | None = None


def _nvml(settings: ReaderSettings, reactor: Any) -> IReader:
    try:
        import pynvml
    except ImportError:
        raise ReaderUnavailable("the Python module pynvml (nvidia-ml-py) is not installed") from None
    from atopgpud_tw.readers.nvml.reader import NvmlReader

    return NvmlReader(pynvml, reactor, mig=settings.mig, hang_after=_hang_after(settings))


def _smi(settings: ReaderSettings, reactor: Any) -> IReader:
    from atopgpud_tw.readers.smi.reader import SmiReader

    # the daemon starts no other processes: it may take what runs leave behind as its own
    return SmiReader(
        reactor, settings.smi_path, timeout=settings.smi_timeout, mig=settings.mig, adopt_orphans=True
    )


def _sim(settings: ReaderSettings, reactor: Any) -> IReader:
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.sim import ScenarioError, demo_scenario, load_scenario, simulated_binding

    try:
        scenario = load_scenario(settings.scenario) if settings.scenario else demo_scenario()
    except ScenarioError as error:
        raise ReaderUnavailable(f"scenario {error}") from None
    return NvmlReader(
        simulated_binding(scenario), reactor, mig=settings.mig, hang_after=_hang_after(settings), name="sim"
    )


def _hang_after(settings: ReaderSettings) -> float:
    from atopgpud_tw.readers.nvml.watchdog import HANG_AFTER

    return settings.hang_warning or HANG_AFTER


_MAKERS = {"nvml": _nvml, "nvidia-smi": _smi, "sim": _sim}


def make_reader(settings: ReaderSettings, reactor: Any) -> tuple[IReader, Snapshot]:
    """The reader `settings` ask for, opened, and the devices it found.

    `auto` tries nvml, then nvidia-smi.
    """
    order = ("nvml", "nvidia-smi") if settings.kind == "auto" else (settings.kind,)
    reasons = []
    for name in order:
        try:
            reader = _MAKERS[name](settings, reactor)
            layout = reader.open()
        except ReaderUnavailable as error:
            reasons.append(f"{name}: {error}")
            continue
        log.info("reading GPUs through {reader}", reader=reader.name)
        return reader, layout
    raise ReaderUnavailable("; ".join(reasons))
