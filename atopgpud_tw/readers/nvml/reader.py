"""The NVML reader: one Snapshot per poll through nvidia-ml-py (or the simulator), in one
daemon thread (`SerialWorker`).  A lost GPU is absent for the poll; where NVML must be set
up again (`calls.Reinitialise`) it is, with backoff, every device absent meanwhile.
"""

from __future__ import annotations

import time
from functools import cache
from types import ModuleType
from typing import Any, Callable

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from atopgpud_tw.nvml_codes import (
    DRIVER_NOT_LOADED,
    LIB_RM_VERSION_MISMATCH,
    LIBRARY_NOT_FOUND,
    LIFECYCLE,
    NAMES,
    NO_PERMISSION,
)
from atopgpud_tw.problems import ProblemLog, Problems, printable
from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.readers.identity import CardKeys
from atopgpud_tw.readers.nvml.calls import (
    READING,
    DeviceLost,
    Interrupted,
    NvmlSession,
    Outcome,
    Reinitialise,
    Unsupported,
    answer,
    as_text,
    error_name,
    given,
)
from atopgpud_tw.readers.nvml.device import (
    DevicePoll,
    NvmlDevice,
    placeholder,
    probe_support,
)
from atopgpud_tw.readers.nvml.gpm import GpmReader
from atopgpud_tw.readers.nvml.health import XidEvents, read_card_health
from atopgpud_tw.readers.nvml.mig import layout_card, read_card
from atopgpud_tw.readers.nvml.stamps import host_offsets
from atopgpud_tw.readers.nvml.support import BACKOFF, Backoff
from atopgpud_tw.readers.nvml.watchdog import HANG_AFTER, CallWatch, HangWatchdog
from atopgpud_tw.readers.nvml.worker import SerialWorker
from atopgpud_tw.readers.procinfo import Contexts
from atopgpud_tw.readers.starts import start_times
from atopgpud_tw.snapshot import TASK_COMPUTE, TASK_GRAPHICS, DeviceInfo, DeviceSample, Snapshot, mig_mode

log = Logger(namespace="atopgpud_tw.readers.nvml")


@cache
def _inventory_calls() -> dict[str, str]:
    """The NVML call of each inventory label, by `DeviceInfo` attribute (the table's column)."""
    from atopgpud_tw.figures import INVENTORY

    return {row.attribute: row.nvml for row in INVENTORY}


#: seconds stopping waits for NVML to shut down
CLOSE_TIMEOUT = 0.5
#: NVML's answers at start-up that mean "wait for the driver" (a boot; a driver upgraded, not reloaded)
WAIT_FOR_DRIVER = (DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH)
#: how often a driver not loaded at start-up is looked for: every second for a minute, then backing off
STARTUP_RETRY = (1.0,) * 60 + BACKOFF


@implementer(IReader)
class NvmlReader:
    """Reads every GPU through an NVML binding (`pynvml` or the simulator); `mig` is how a card
    in MIG mode is shown: ``"instances"`` (each a device) or ``"card"`` (their sum)."""

    def __init__(
        self,
        nvml: ModuleType | Any,
        reactor: Any,
        mig: str = "instances",
        hang_after: float = HANG_AFTER,
        name: str = "nvml",
    ) -> None:
        mig_mode(mig)
        #: what the log and the status line call this reader ("sim" over the simulator)
        self.name = name
        self.nvml = nvml
        self.mig_mode = mig
        self._reactor = reactor
        #: the time of an NVML call, read when it is made (a poll's calls may wait in the worker)
        self._call_clock = None if reactor is None else reactor.seconds
        #: the host clocks against the reader's, for the steps of the driver's sample clock
        #: (stamps.py): only where the reader's clock is CLOCK_MONOTONIC, as the daemon's is
        self.host_offsets = host_offsets if self._call_clock is time.monotonic else None
        self._worker = SerialWorker(reactor)
        clock = time.monotonic if reactor is None else reactor.seconds
        #: the NVML call in progress, and (with a reactor) the watchdog that warns of a hung one
        self.calls = CallWatch(clock)
        self.watchdog = None if reactor is None else HangWatchdog(self.calls, reactor, hang_after)
        self._problems = ProblemLog("nvml", clock)
        self._devices: list[NvmlDevice] = []
        #: devices ever discovered, by key, so a device that vanishes stays listed
        self._known: dict[str, DeviceSample] = {}
        self._initialised = False
        #: setting NVML up again after it failed
        self._retry = Backoff()
        #: re-discovery while a device is lost or missing, with its own backoff
        self._rediscovery = Backoff()
        self._lost = False
        #: every card ever discovered (its key), to notice one missing (and announce a new one)
        self._cards: set[str] = set()
        #: cards' keys, unique even where two cards report the same UUID
        self._keys = CardKeys()
        #: what each card is (UUID, serial, versions), read once when it is first discovered
        self._info: dict[str, DeviceInfo] = {}
        #: devices (by index) that could not be identified at the last discovery, and why
        self._unusable: dict[int, str] = {}
        self._unusable_reported: dict[str, str] = {}
        #: why each card that was lost was (its problem stands while it is missing)
        self._gone: dict[str, str] = {}
        self.session = NvmlSession(nvml, watch=self.calls)
        self._xid = XidEvents(self.session)
        self._gpm = GpmReader(self.session, self._call_clock)
        #: the processes' start times, which tell a reused pid
        self._starts = start_times(nvml)
        self.contexts = Contexts()
        #: while the driver's lifecycle keeps NVML from use: (its code, since when, whether since start-up)
        self._down: tuple[int, float | None, bool] | None = None

    def open(self) -> Snapshot:
        """Initialise NVML: the devices by identity, what ``T`` shows from the start (or ReaderUnavailable)."""
        try:
            self._initialise()
            layout = [
                sample for card in self._devices
                for sample in self._gpm.layout(card, layout_card(card, self.mig_mode), self.mig_mode)
            ]
        except Exception as error:
            code = getattr(error, "value", None)  # an NVMLError's code
            if code not in WAIT_FOR_DRIVER:
                raise ReaderUnavailable(describe_init_failure(error)) from None
            # the driver is not there yet (a boot) or not yet reloaded: wait for it
            self._retry = Backoff(STARTUP_RETRY)
            self._went_down(code, None, at_start=True)
            return Snapshot(())
        self._problems.report(self._unusable_problems())
        # registered for XID events from the start: the driver delivers none from before
        self._xid.drain(self._devices)
        if not self._devices and not self._unusable:
            log.warn("nvml: no GPU found; serving an empty list and looking again every poll")
        return Snapshot(tuple(layout))

    def _initialise(self) -> None:
        self.session.call("nvmlInit")
        self._initialised = True
        self._devices = self._discover()
        self._retry.succeeded()

    def _discover(self) -> list[NvmlDevice]:
        """The devices that can be used now, in index order; one that cannot be identified now is
        left in `_unusable`, looked for again by `_rediscover`."""
        found = []
        unusable: dict[int, str] = {}
        for index in range(self.session.call("nvmlDeviceGetCount")):
            # an NVML error, or a reply the binding cannot convert (a name not UTF-8)
            identity = answer(_identify, self.session, index, catch=(*READING, DeviceLost))
            if isinstance(identity, Outcome):
                unusable[index] = error_name(identity.error or identity)
                continue
            found.append(identity)
        keys = self._keys.assign([(uuid, busid) for _, uuid, busid, _ in found])
        devices = []
        versions = _versions(self.session) if found else ("", "")
        for (handle, uuid, busid, name), key in zip(found, keys):
            device = NvmlDevice(self.session, handle, key, busid, name)
            if key not in self._info:  # read when the card is first discovered, and kept
                serial, vbios = (_text(self.session, _inventory_calls()[label], f"GPU {busid}", handle)
                                 for label in ("serial", "vbios"))
                self._info[key] = DeviceInfo(uuid or "", serial, vbios, *versions)
            device.info = self._info[key]
            device.task_support = probe_support(device)
            devices.append(device)
        self._unusable = unusable
        for device in devices:
            if device.key not in self._cards:
                self._cards.add(device.key)
                kinds = [kind for bit, kind in ((TASK_COMPUTE, "compute"), (TASK_GRAPHICS, "graphics"))
                         if device.task_support & bit]
                log.info("nvml: GPU {busid} {name} (processes: {support})", busid=printable(device.busid),
                         name=printable(device.name), support=" and ".join(kinds) or "none")
        return devices

    def _unusable_problems(self) -> dict[str, str]:
        """One problem per device that cannot be used now, keyed by its index only (a retry that
        fails again is not logged again).  Known devices that are gone are reported as lost
        instead: as many unusable indices say nothing new."""
        if self._initialised and not self._unusable:  # (every poll but those with one)
            self._unusable_reported = {}
        elif self._initialised:  # (while NVML is set up again, the last report stands)
            present = self._device_keys()
            gone = sum(1 for key in self._cards if key not in present)
            self._unusable_reported = {} if len(self._unusable) <= gone else {
                f"index {index} unusable": f"GPU index {index} cannot be used: {cause}; looking for it again"
                for index, cause in self._unusable.items()
            }
        return self._unusable_reported

    def poll(self) -> Deferred:
        """Read all devices in the worker thread; fires with a Snapshot."""
        result = self._worker.submit(self.read, self._reactor.seconds())
        if self.watchdog is not None:
            self.watchdog.arm()
        # one callback for both: the watchdog disarmed, then the problems reported
        return result.addBoth(self._poll_ended)

    def _poll_ended(self, outcome: tuple[Snapshot, Problems] | Failure) -> Snapshot | Failure:
        if self.watchdog is not None:
            self.watchdog.disarm()
        if isinstance(outcome, Failure):
            return outcome
        snapshot, problems = outcome
        self._problems.report(problems)
        return snapshot

    def read(self, now: float) -> tuple[Snapshot, Problems]:
        """One blocking poll of every device and its problems (an exception has NVML set up again)."""
        try:
            snapshot, problems = self._read(now)
        except Exception:
            self._shutdown()
            self._retry.failed(now)
            raise
        finally:
            self._starts.sweep()  # the pids this poll did not list let go of their pidfds
        problems.update(self._unusable_problems())
        return self.contexts.attach(snapshot), problems  # who the processes are (procinfo.py), here in the thread

    def _read(self, now: float) -> tuple[Snapshot, Problems]:
        problems = Problems()
        self.session.now = now
        if not self._initialised or not (self._devices or self._unusable):
            if not self._retry.due(now):
                if self._down is None:
                    problems.add("init", "NVML is being set up again")
                return self._absent(), problems
            try:
                if self._initialised:
                    self._devices = self._discover()
                else:
                    self._initialise()
            except Exception as error:
                self._retry.failed(now)
                value = getattr(error, "value", None)
                if value in LIFECYCLE:
                    self._went_down(value, now)
                else:
                    problems.add("init", f"cannot set up NVML ({describe_init_failure(error)})")
                return self._absent(), problems
            self._came_back(now)
        elif self._missing() and self._rediscovery.due(now):
            self._rediscover()
        samples = []
        lost = False
        for card in self._devices:
            poll = DevicePoll(int(now * 1_000_000), self._call_clock, host=self.host_offsets, starts=self._starts)
            found = answer(self._read_card, card, problems, poll, now, catch=Interrupted)
            if isinstance(found, Reinitialise):
                self._went_down(found.value, now, found.cause.split(":")[0])
                self._retry.failed(now)
                return self._absent(), problems
            if isinstance(found, DeviceLost):
                lost = True
                self._gpm.forget(card.key)
                self._gone[card.key] = f"GPU {card.busid}: {found.cause}"
                problems.add(f"{card.key} lost", self._gone[card.key])
                if card.mig_state.enabled and card.mig_state.instances and self.mig_mode == "instances":
                    continue  # its instances are shown absent, as vanished ones are
                found = [(self._known.get(card.key) or placeholder(card)).absent()]
            for sample in found:
                self._known[sample.key] = sample
            samples.extend(found)
        # a lost card that re-discovery did not find again is still lost, not recovered
        present = self._device_keys()
        self._gpm.keep(present)
        for key, text in self._gone.items():
            if key not in present:
                problems.setdefault(f"{key} lost", text)
        if lost or self._missing():
            if self._rediscovery.due(now):
                self._rediscovery.failed(now)
            self._lost = lost
        else:
            self._rediscovery.succeeded()
        return self._with_vanished(samples), problems

    def _read_card(self, card: NvmlDevice, problems: Problems, poll: DevicePoll, now: float) -> list[DeviceSample]:
        found = read_card(card, self.mig_mode, problems, poll)
        return self._gpm.read(card, found, problems, now, self.mig_mode)

    def waiting_for(self) -> str | None:
        """What the reader waits for while NVML cannot be used (the status line says it); None otherwise."""
        down = self._down
        return None if down is None else f"waiting for the NVIDIA driver ({NAMES.get(down[0], down[0])})"

    def _went_down(self, value: int | None, now: float | None, where: str = "", at_start: bool = False) -> None:
        """NVML cannot be used because of the driver's lifecycle (`where` answered `value`: nvmlInit or
        the discovery unless said): shut down, and said once, in words an operator acts on, and again
        only if the cause changes."""
        where = where or ("discovery" if self._initialised else "nvmlInit")
        self._shutdown()
        down = self._down
        if down is not None and down[0] == value:
            return
        if down is not None:
            since, at_start = down[1], down[2]
        else:
            since = now if now is not None else (None if self._call_clock is None else self._call_clock())
        self._down = (value if value is not None else 0, since, at_start)
        log.warn("nvml: {words}", words=_lifecycle_words(value, where, at_start and down is None))

    def _came_back(self, now: float) -> None:
        """NVML is set up again after a lifecycle cause: one line, and the usual backoff again."""
        down = self._down
        if down is None:
            return
        self._down = None
        self._retry = Backoff()
        value, since, at_start = down
        took = "" if since is None else f" after {max(0.0, now - since):.0f} s"
        count = len(self._devices)
        gpus = f"{count} GPU{'' if count == 1 else 's'}"
        if at_start:
            log.info("nvml: the NVIDIA driver answers{took}: reading {gpus}", took=took, gpus=gpus)
        else:
            log.info("nvml: NVML works again{took} (it answered {code}): reading {gpus}",
                     took=took, code=_code_name(value), gpus=gpus)

    def _missing(self) -> bool:
        """Whether a card seen before is not among the devices read now, or one could not be used."""
        if self._lost or self._unusable:
            return True
        current = self._device_keys()
        # every card read now was discovered, so none is missing when the counts match
        return len(self._cards) != len(current) and any(key not in current for key in self._cards)

    def _device_keys(self) -> set[str]:
        """The keys of the devices read now."""
        return {card.key for card in self._devices}

    def _rediscover(self) -> None:
        """Look for the GPUs again; a card found again keeps its state and counters."""
        try:
            fresh = self._discover()
        except Exception:
            return  # NVML itself trouble: the lost devices' reads will say so
        old = {card.key: card for card in self._devices}
        for card in fresh:
            if card.key in old:
                old[card.key].handle = card.handle
        self._devices = [old.get(card.key, card) for card in fresh]
        self._lost = False

    def _with_vanished(self, samples: list[DeviceSample]) -> Snapshot:
        present = {sample.key for sample in samples}
        if len(present) == len(self._known):
            return Snapshot(tuple(samples))  # every sample is known: none vanished
        gone = [s.absent() for key, s in self._known.items() if key not in present]
        return Snapshot(tuple(samples) + tuple(gone))

    def _absent(self) -> Snapshot:
        return Snapshot(tuple(s.absent() for s in self._known.values()))

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            self._devices = []
            self._info.clear()  # a driver loaded again may be another version: read at the next discovery
            self._gpm.keep(set())  # sample buffers do not outlive NVML
            # (shutting down a broken library may fail; it is let go anyway)
            answer(self.session.call, "nvmlShutdown", catch=Outcome)

    def close(self) -> Deferred | None:
        """Shut NVML down (in the worker, after any poll in flight) and stop the worker; the
        Deferred fires when it is down, or after `CLOSE_TIMEOUT` if a call is stuck."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._reactor is None:  # read synchronously (tests, benchmarks)
            self._close_nvml()
            return None
        done = self._worker.submit(self._close_nvml)
        self._worker.stop()
        done.addTimeout(CLOSE_TIMEOUT, self._reactor)
        done.addErrback(self._not_shut_down)
        return done

    def _not_shut_down(self, failure: Failure) -> None:
        call = self.calls.current
        if failure.check(defer.TimeoutError) and call is not None:  # addTimeout's: the worker is stuck in a call
            log.warn(
                "nvml: not shut down: {call} has not returned, and stopping waits no more than {timeout:g} s",
                call=call.describe(),
                timeout=CLOSE_TIMEOUT,
            )
        elif failure.check(defer.TimeoutError):
            log.warn("nvml: not shut down within {timeout:g} s; stopping without it", timeout=CLOSE_TIMEOUT)
        else:
            log.warn("nvml: not shut down: {error}", error=printable(failure.getErrorMessage()))

    def health(self, wanted: Callable[[str], bool]) -> list[tuple[str, Deferred]]:
        """A `CardHealth` of each card `wanted` (by key), one job each; none while NVML is not set up."""
        if self._reactor is None or not self._initialised:
            return []
        return [(card.key, self._worker.submit(read_card_health, card)) for card in self._devices if wanted(card.key)]

    def xid_counts(self) -> Deferred | None:
        """The XID errors counted so far by (card key, XID); None while NVML is not set up."""
        if self._reactor is None or not self._initialised:
            return None
        return self._worker.submit(self._xid.drain, list(self._devices))

    def _close_nvml(self) -> None:
        was_initialised = self._initialised
        self._shutdown()
        self._starts.close()
        if was_initialised:
            log.info("nvml: shut down")


def _identify(session: NvmlSession, index: int) -> tuple[Any, str | None, str, str]:
    """The handle, UUID (None: its bus id is its key), bus id and name of the device at `index`."""
    call = session.call
    where = f"GPU index {index}"
    handle = call("nvmlDeviceGetHandleByIndex", index, where=where)
    busid = as_text(call("nvmlDeviceGetPciInfo", handle, where=where).busId)
    where = f"GPU {busid}"
    name = as_text(call("nvmlDeviceGetName", handle, where=where))
    # not supported or missing: no UUID; a passing failure: looked at again, not keyed otherwise
    uuid = answer(call, _inventory_calls()["uuid"], handle, where=where)
    return handle, None if isinstance(uuid, Unsupported) else as_text(given(uuid)), busid, name


def _versions(session: NvmlSession) -> tuple[str, str]:
    """The driver's version and the CUDA version it supports ("" where either cannot be read)."""
    calls = _inventory_calls()
    driver = _text(session, calls["driver_version"], None)
    newest = calls["cuda_version"]
    for function in (newest, newest.removesuffix("_v2")):
        number = _text(session, function, None)
        if number.isdigit():  # e.g. 12040: CUDA 12.4
            return driver, f"{int(number) // 1000}.{int(number) % 1000 // 10}"
    return driver, ""


def _text(session: NvmlSession, function: str, where: str | None, *args: Any) -> str:
    """A call's answer as text; "" where the library lacks it or it fails (an inventory label)."""
    found = answer(session.call, function, *args, where=where, catch=(*READING, DeviceLost))
    return "" if isinstance(found, Outcome) else printable(str(as_text(found))).strip()


def _code_name(value: int | None) -> str:
    return f"NVML_ERROR_{NAMES[value]}" if value in NAMES else f"NVML error {value}"


def _lifecycle_words(value: int | None, where: str, at_start: bool) -> str:
    """What a lifecycle answer means and what the operator can do, in one line."""
    answered = f"{where} answered {_code_name(value)}"
    looking = "every GPU shows as absent meanwhile, and the daemon keeps looking (backing off to once a minute)"
    if value == LIB_RM_VERSION_MISMATCH:
        return (f"{answered}: the NVML library does not match the NVIDIA kernel module that is loaded, "
                "usually because the driver was upgraded and its module not yet reloaded (reboot, or "
                f"unload and load the nvidia modules); {looking}")
    if value == DRIVER_NOT_LOADED and at_start:
        return (f"{answered}: the NVIDIA driver is not loaded (at boot the daemon may start before it; "
                "otherwise load it: modprobe nvidia, and see dmesg); no GPU is served until it is, "
                "and the daemon keeps looking for it (every second for a minute, then backing off to "
                "once a minute)")
    if value == DRIVER_NOT_LOADED:
        return (f"{answered}: the NVIDIA kernel module is not loaded any more (a driver being reloaded "
                f"or upgraded; load it: modprobe nvidia); {looking}")
    return f"{answered}: NVML was shut down beneath the daemon and is set up again; {looking}"


#: why NVML could not be set up, by its answer
_INIT_FAILURES: dict[int | None, str] = {
    LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) is not installed",
    DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
    LIB_RM_VERSION_MISMATCH: "the NVML library does not match the loaded driver (reboot or reload the module)",
    NO_PERMISSION: "no permission to use the GPUs",
}


def describe_init_failure(error: BaseException) -> str:
    """Why NVML could not be set up, in words (the daemon's start-up line and problem, `atopgpu doctor`)."""
    error = getattr(error, "error", None) or error  # (an outcome: what the binding raised)
    found = _INIT_FAILURES.get(getattr(error, "value", None))
    return found or f"NVML cannot be initialised: {error_name(error)} ({error})"
