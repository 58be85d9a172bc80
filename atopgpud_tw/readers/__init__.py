"""Readers: where a Snapshot comes from (NVML, nvidia-smi, the simulator).

`make_reader` picks and opens one at start-up; it raises `ReaderUnavailable`
with a one-line reason when none can work here.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.snapshot import Snapshot

log = Logger()

READERS = ("auto", "nvml", "nvidia-smi", "sim")


def _nvml(options: Any, reactor: Any) -> IReader:
    try:
        import pynvml
    except ImportError:
        raise ReaderUnavailable("the Python module pynvml (nvidia-ml-py) is not installed") from None
    from atopgpud_tw.readers.nvml import NvmlReader

    return NvmlReader(pynvml, reactor, mig=options["mig"], hang_after=_hang_after(options))


def _smi(options: Any, reactor: Any) -> IReader:
    from atopgpud_tw.readers.smi import SmiReader

    return SmiReader(reactor, options["nvidia-smi"], timeout=options["smi-timeout"], mig=options["mig"])


def _sim(options: Any, reactor: Any) -> IReader:
    from atopgpud_tw.readers.nvml import NvmlReader
    from atopgpud_tw.sim import ScenarioError, demo_scenario, load_scenario, simulated_binding

    try:
        scenario = load_scenario(options["scenario"]) if options["scenario"] else demo_scenario()
    except ScenarioError as error:
        raise ReaderUnavailable(f"scenario {error}") from None
    reader = NvmlReader(simulated_binding(scenario), reactor, mig=options["mig"], hang_after=_hang_after(options))
    reader.name = "sim"
    return reader


def _hang_after(options: Any) -> float:
    from atopgpud_tw.watchdog import HANG_AFTER

    return options.get("hang-warning") or HANG_AFTER


_MAKERS = {"nvml": _nvml, "nvidia-smi": _smi, "sim": _sim}


def make_reader(options: Any, reactor: Any) -> tuple[IReader, Snapshot]:
    """The reader the options ask for, opened, and the devices it found.

    `auto` tries nvml, then nvidia-smi.
    """
    choice = options["reader"]
    order = ("nvml", "nvidia-smi") if choice == "auto" else (choice,)
    reasons = []
    for name in order:
        try:
            reader = _MAKERS[name](options, reactor)
            layout = reader.open()
        except ReaderUnavailable as error:
            reasons.append(f"{name}: {error}")
            continue
        log.info("reading GPUs through {reader}", reader=reader.name)
        return reader, layout
    raise ReaderUnavailable("; ".join(reasons))
