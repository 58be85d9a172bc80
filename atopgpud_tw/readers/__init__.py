"""Readers: where a Snapshot comes from (NVML, nvidia-smi, the simulator); `make_reader` opens one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
    #: seconds an NVML call may run while the reader is opened at start-up (None: the default)
    start_timeout: float | None = None


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
    return SmiReader(reactor, settings.smi_path, timeout=settings.smi_timeout, mig=settings.mig, adopt_orphans=True)


def _sim(settings: ReaderSettings, reactor: Any) -> IReader:
    from atopgpud_tw.readers.nvml.reader import NvmlReader
    from atopgpud_tw.sim import ScenarioError, demo_scenario, load_scenario, simulated_binding

    try:
        scenario = load_scenario(settings.scenario) if settings.scenario else demo_scenario()
    except ScenarioError as error:
        raise ReaderUnavailable(f"scenario {error}") from None
    binding = simulated_binding(scenario)
    return NvmlReader(binding, reactor, mig=settings.mig, hang_after=_hang_after(settings), name="sim")


def _hang_after(settings: ReaderSettings) -> float:
    from atopgpud_tw.readers.nvml.watchdog import HANG_AFTER

    return settings.hang_warning or HANG_AFTER


_MAKERS = {"nvml": _nvml, "nvidia-smi": _smi, "sim": _sim}


def _open(reader: IReader, settings: ReaderSettings, say: Callable[[str], None]) -> Snapshot:
    """The reader opened; an NVML reader's calls watched while it opens (`open_watched`)."""
    calls = getattr(reader, "calls", None)
    if calls is None:
        return reader.open()
    from atopgpud_tw.readers.nvml.watchdog import START_TIMEOUT, StartupHang, open_watched

    try:
        return open_watched(
            reader.open, calls, calls.clock, _hang_after(settings), settings.start_timeout or START_TIMEOUT,
            lambda text: say(f"{reader.name}: {text}"),
        )
    except StartupHang as error:
        raise _Hung(str(error)) from None


class _Hung(ReaderUnavailable):
    """A reader whose opening hung in a call (said at once, as its fall-back is)."""


def make_reader(
    settings: ReaderSettings, reactor: Any, say: Callable[[str], None] | None = None
) -> tuple[IReader, Snapshot]:
    """The reader `settings` ask for, opened, and the devices it found; ReaderUnavailable with each
    reason in one line.  `say` is told what start-up waits for (an NVML call that hangs), and that `auto`
    moves on after such a hang: before the reactor runs the log is written nowhere, so the caller says it."""
    order = ("nvml", "nvidia-smi") if settings.kind == "auto" else (settings.kind,)
    say = say or (lambda text: None)
    reasons = []
    for position, name in enumerate(order):
        try:
            reader = _MAKERS[name](settings, reactor)
            layout = _open(reader, settings, say)
        except ReaderUnavailable as error:
            reasons.append(f"{name}: {error}")
            if position + 1 < len(order):
                fallback = f"{name}: {error}; trying {order[position + 1]}"
                if isinstance(error, _Hung):
                    say(fallback)
                else:
                    log.info("{fallback}", fallback=fallback)
            continue
        log.info("reading GPUs through {reader}", reader=reader.name)
        return reader, layout
    raise ReaderUnavailable("; ".join(reasons))
