"""The NVML reader: one Snapshot per poll through nvidia-ml-py (or the simulator).

Every NVML call goes through `NvmlDevice.call`, the one choke point that maps
errors: NOT_SUPPORTED is remembered per device and the call is not made again;
NOT_FOUND is the idle case; GPU_IS_LOST makes that device absent for the poll;
UNINITIALIZED, DRIVER_NOT_LOADED and LIB_RM_VERSION_MISMATCH (and a library that
lacks a symbol) mean NVML must be set up again, which `NvmlReader` does with
backoff while reporting every device absent.  All of it runs in one daemon
thread (`SerialWorker`): the reactor never waits for NVML.

A card in MIG mode (docs/mig.md, NVML-FACTS.md section 5) is read as its MIG
instances, each a device named by `atopgpud_tw.identity`, with its own memory and
processes and no utilization (NVML has none under MIG).  The mode and the
instances are looked up again at every poll, a few cheap calls, so instances
created or destroyed while the daemon runs are picked up.  With ``mig="card"``
the instances are summed into one device for the card.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.readers.nvml_device import (
    BACKOFF,
    LIFECYCLE,
    MIG_MODES,
    NO_PERMISSION,
    TASK_COMPUTE,
    TASK_GRAPHICS,
    DeviceLost,
    NvmlDevice,
    Reinitialise,
    absent_sample,
    as_text,
    error_name,
    placeholder,
    probe_support,
)
from atopgpud_tw.readers.nvml_mig import layout_card, read_card
from atopgpud_tw.snapshot import DeviceSample, Snapshot
from atopgpud_tw.worker import SerialWorker

log = Logger()

#: seconds stopping waits for NVML to shut down
CLOSE_TIMEOUT = 0.5


@implementer(IReader)
class NvmlReader:
    """Reads every GPU through an NVML binding (`pynvml` or the simulator).

    `mig` is how a card in MIG mode is shown: ``"instances"`` (each MIG instance
    a device) or ``"card"`` (one device holding its instances' memory and processes).
    """

    name = "nvml"

    def __init__(self, nvml: ModuleType | Any, reactor: Any, mig: str = "instances") -> None:
        if mig not in MIG_MODES:
            raise ValueError(f"mig must be one of {', '.join(MIG_MODES)}, not {mig!r}")
        self.nvml = nvml
        self.mig = mig
        self._reactor = reactor
        self._worker = SerialWorker(reactor)
        self._problems = ProblemLog("nvml")
        self._devices: list[NvmlDevice] = []
        #: devices ever discovered, by key, so a device that vanishes stays listed
        self._known: dict[str, DeviceSample] = {}
        self._initialised = False
        self._retry_at = 0.0
        self._attempts = 0
        #: re-discovery while a device is lost or missing, with its own backoff
        self._rediscover_at = 0.0
        self._rediscoveries = 0
        self._lost = False
        #: every card ever discovered (its key), to notice one missing
        self._cards: set[str] = set()
        self._announced: set[str] = set()
        #: what the devices said once (a driver without a function), shared by all of them
        self._said: set[str] = set()

    # -- start-up (blocking, before the reactor runs) --

    def open(self) -> Snapshot:
        """Initialise NVML and discover the devices; raise ReaderUnavailable if NVML is not usable.

        Returns the devices by identity (MIG instances included), read nothing
        from yet: what ``T`` shows from the start.
        """
        try:
            self._initialise()
            layout = [sample for card in self._devices for sample in layout_card(card, self.mig)]
        except Exception as error:
            raise ReaderUnavailable(_describe_init_failure(error)) from None
        if not self._devices:
            log.warn("nvml: no GPU found; serving an empty list and looking again every poll")
        return Snapshot(tuple(layout))

    def _initialise(self) -> None:
        self.nvml.nvmlInit()
        self._initialised = True
        self._devices = self._discover()
        self._attempts = 0

    def _discover(self) -> list[NvmlDevice]:
        devices = []
        for index in range(self.nvml.nvmlDeviceGetCount()):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                busid = as_text(self.nvml.nvmlDeviceGetPciInfo(handle).busId)
                name = as_text(self.nvml.nvmlDeviceGetName(handle))
            except Exception as error:
                # an NVML error, or a reply the binding cannot convert (a name not UTF-8)
                if getattr(error, "value", None) in LIFECYCLE:
                    raise
                log.warn(
                    "nvml: GPU index {index} cannot be used: {error}",
                    index=index,
                    error=error_name(error),
                )
                continue
            try:
                key = as_text(self.nvml.nvmlDeviceGetUUID(handle))
            except Exception:
                key = busid
            device = NvmlDevice(self.nvml, handle, key, busid, name, said=self._said)
            device.task_support = probe_support(device)
            devices.append(device)
        self._cards.update(device.key for device in devices)
        for device in devices:
            if device.key not in self._announced:
                self._announced.add(device.key)
                log.info(
                    "nvml: GPU {busid} {name} (processes: {support})",
                    busid=device.busid,
                    name=device.name,
                    support=_support_text(device.task_support),
                )
        return devices

    # -- polling --

    def poll(self) -> Deferred:
        """Read all devices in the worker thread; fires with a Snapshot."""
        result = self._worker.submit(self.read, self._reactor.seconds())
        result.addCallback(self._reported)
        return result

    def _reported(self, outcome: tuple[Snapshot, dict[str, str]]) -> Snapshot:
        snapshot, problems = outcome
        self._problems.report(problems)
        return snapshot

    def read(self, now: float) -> tuple[Snapshot, dict[str, str]]:
        """One blocking poll of every device, and the problems it met.

        An exception that escapes (a bug, or a binding gone wrong) fails this poll
        and has NVML set up again, with backoff, from the next one.
        """
        try:
            return self._read(now)
        except Exception:
            self._shutdown()
            self._schedule_retry(now)
            raise

    def _read(self, now: float) -> tuple[Snapshot, dict[str, str]]:
        problems: dict[str, str] = {}
        if not self._initialised or not self._devices:
            if now < self._retry_at:
                problems["init"] = "NVML is being set up again"
                return self._absent(), problems
            try:
                if self._initialised:
                    self._devices = self._discover()
                else:
                    self._initialise()
            except Exception as error:
                self._schedule_retry(now)
                problems["init"] = f"cannot set up NVML ({_describe_init_failure(error)})"
                return self._absent(), problems
        elif self._missing() and now >= self._rediscover_at:
            self._rediscover()
        samples = []
        lost = False
        for card in self._devices:
            card.now_us = int(now * 1_000_000)
            try:
                found = read_card(card, self.mig, problems)
            except Reinitialise as failure:
                problems["init"] = f"{failure.cause}; setting NVML up again"
                self._shutdown()
                self._schedule_retry(now)
                return self._absent(), problems
            except DeviceLost as failure:
                lost = True
                problems[f"{card.key} lost"] = f"GPU {card.busid}: {failure.cause}"
                if card.mig.enabled and card.mig.instances and self.mig == "instances":
                    continue  # its instances are shown absent, as vanished ones are
                found = [absent_sample(self._known.get(card.key) or placeholder(card))]
            for sample in found:
                self._known[sample.key] = sample
            samples.extend(found)
        if lost or self._missing():
            if now >= self._rediscover_at:
                delay = BACKOFF[min(self._rediscoveries, len(BACKOFF) - 1)]
                self._rediscover_at = now + delay
                self._rediscoveries += 1
            self._lost = lost
        else:
            self._rediscoveries = 0
        return self._with_vanished(samples), problems

    def _missing(self) -> bool:
        """Whether a card seen before is not among the devices read now."""
        current = {card.key for card in self._devices}
        return self._lost or any(key not in current for key in self._cards)

    def _rediscover(self) -> None:
        """Look for the GPUs again; a card found again keeps its state and counters."""
        try:
            fresh = self._discover()
        except Exception:
            return  # NVML itself trouble: the lost devices' reads will say so
        old = {card.key: card for card in self._devices}
        devices = []
        for card in fresh:
            known = old.get(card.key)
            if known is not None:
                known.handle = card.handle
                card = known
            devices.append(card)
        self._devices = devices
        self._lost = False

    def _with_vanished(self, samples: list[DeviceSample]) -> Snapshot:
        present = {s.key for s in samples}
        gone = [absent_sample(s) for key, s in self._known.items() if key not in present]
        return Snapshot(tuple(samples) + tuple(gone))

    def _absent(self) -> Snapshot:
        return Snapshot(tuple(absent_sample(s) for s in self._known.values()))

    def _schedule_retry(self, now: float) -> None:
        self._retry_at = now + BACKOFF[min(self._attempts, len(BACKOFF) - 1)]
        self._attempts += 1

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            self._devices = []
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass  # shutting down a broken library may fail; it is let go anyway

    def close(self) -> Deferred | None:
        """Shut NVML down (in the worker, after any poll in flight) and stop the worker.

        The Deferred fires when NVML is shut down, or after `CLOSE_TIMEOUT`
        seconds if a call is stuck in the driver: stopping never waits longer.
        """
        if self._reactor is None:  # read synchronously (tests, benchmarks)
            self._close_nvml()
            return None
        done = self._worker.submit(self._close_nvml)
        self._worker.stop()
        done.addTimeout(CLOSE_TIMEOUT, self._reactor)
        done.addErrback(lambda failure: log.warn("nvml: not shut down ({error})", error=failure.getErrorMessage()))
        return done

    def _close_nvml(self) -> None:
        was_initialised = self._initialised
        self._shutdown()
        if was_initialised:
            log.info("nvml: shut down")






def _support_text(support: int) -> str:
    kinds = [name for bit, name in ((TASK_COMPUTE, "compute"), (TASK_GRAPHICS, "graphics")) if support & bit]
    return " and ".join(kinds) or "none"


def _describe_init_failure(error: BaseException) -> str:
    value = getattr(error, "value", None)
    if value == 12:
        return "the NVML library (libnvidia-ml.so.1) is not installed"
    if value == 9:
        return "the NVIDIA driver is not loaded"
    if value == 18:
        return "the NVML library does not match the loaded driver (reboot or reload the module)"
    if value == NO_PERMISSION:
        return "no permission to use the GPUs"
    return f"NVML cannot be initialised: {error_name(error)} ({error})"
