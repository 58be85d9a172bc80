"""The nvidia-smi reader: one ``nvidia-smi -q -x`` child per poll, where NVML cannot be used from Python.

nvidia-smi may hang for good on a sick GPU (docs/nvidia-smi.md): a run that outlasts
``timeout`` is killed with all it started, and the poll fails.  One child exists at a
time; while a killed one is not reaped (stuck in the kernel), polls fail fast.
Reports are parsed in a thread of the reader's own, so that a big one holds no reply up.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

from twisted.internet.defer import Deferred, ensureDeferred, fail, succeed
from twisted.logger import Logger
from zope.interface import implementer

from atopgpud_tw.problems import ProblemLog, Problems, printable
from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.readers.identity import CardKeys
from atopgpud_tw.readers.nvml.worker import SerialWorker
from atopgpud_tw.readers.procinfo import Contexts
from atopgpud_tw.readers.smi.child import Run, SmiRunError, Started
from atopgpud_tw.readers.smi.health import read_cards_health
from atopgpud_tw.readers.smi.mig import MigSlot, mig_slots, name_slots, parse_mig_names
from atopgpud_tw.readers.smi.orphans import Orphans, become_subreaper
from atopgpud_tw.readers.smi.report import note_preamble, read_devices, read_report
from atopgpud_tw.readers.smi.stream import parse_output
from atopgpud_tw.readers.smi.values import SmiReportError
from atopgpud_tw.readers.starts import ProcStarts
from atopgpud_tw.snapshot import DeviceSample, Snapshot, mig_mode

log = Logger(namespace="atopgpud_tw.readers.smi")

#: seconds before a failed ``nvidia-smi -L`` is tried again for unchanged instances
NAMES_RETRY = 60.0


@implementer(IReader)
class SmiReader:
    name = "nvidia-smi"
    #: nothing to watch: a hung nvidia-smi is a poll that times out; reports parsed are bounded
    watchdog = None

    def __init__(
        self,
        reactor: Any,
        binary: str | None,
        timeout: float = 5.0,
        mig: str = "instances",
        adopt_orphans: bool = False,
    ) -> None:
        """`adopt_orphans`: this process starts no others: it kills every child it did not spawn (orphans.py)."""
        mig_mode(mig)
        self._reactor = reactor
        self._configured = binary
        self._binary: str | None = None
        #: setsid(1), which gives each child a process group of its own to kill
        self._setsid: str | None = None
        self._timeout = timeout
        self._mig = mig
        self._problems = ProblemLog("nvidia-smi", reactor.seconds)
        self._child: Run | None = None
        #: devices ever reported, by key, so a device that vanishes stays listed
        self._known: dict[str, DeviceSample] = {}
        #: cards' keys across reports, unique even where two cards report the same UUID
        self._keys = CardKeys()
        #: the listed processes' start times, which tell a reused pid (/proc, read in the worker)
        self._starts = ProcStarts()
        #: the MIG instances the profile names were last asked for, the names and MIG-... UUIDs
        self._slots: tuple[MigSlot, ...] = ()
        self._profiles: dict[tuple[str, int, int], str] = {}
        self._mig_uuids: dict[tuple[str, int, int], str] = {}
        self._names_problem: str | None = None
        self._names_retry_at = 0.0
        #: the latest report, whose health figures /metrics reads (readers/smi/health.py)
        self._report: Any = None
        #: what runs leave outside their group, when this process is the daemon
        self._orphans = Orphans(reactor) if adopt_orphans else None
        #: the process that was made a subreaper (not inherited by a fork: twistd daemonizes)
        self._subreaper: int | None = None
        #: where reports are parsed and read, off the reactor (stream.py)
        self._worker = SerialWorker(reactor, name="atopgpud-smi-report")
        self.contexts = Contexts()

    @property
    def running(self) -> bool:
        """Whether a child is running, or killed but not yet reaped."""
        return self._child is not None

    def open(self) -> Snapshot:
        """Find nvidia-smi and run it once (and ``-L``); ReaderUnavailable if it gives no report."""
        self._binary = self._locate()
        self._adopt()
        try:
            return self._open()
        finally:
            if self._orphans is not None:
                self._orphans.sweep_now()  # before twistd forks: what the trial runs left

    def _open(self) -> Snapshot:
        assert self._binary is not None
        self._setsid = shutil.which("setsid")
        if self._setsid is None:
            log.warn("nvidia-smi: setsid is not installed; a timed-out run's own children will not be killed")
        # -L runs beside -q -x, not after it: on a MIG host the two runs would
        # otherwise be the time an atop started first waits for its T reply.
        listing = Started([self._binary, "-L"]) if self._mig == "instances" else None
        try:
            root, _ = read_report(Started([self._binary, "-q", "-x"]).output(self._timeout))
        except (SmiRunError, SmiReportError) as error:
            if listing is not None:
                listing.discard()
            said = str(error) if isinstance(error, SmiRunError) else f"{self._binary} -q -x: {error}"
            raise ReaderUnavailable(said) from None
        cards, _ = read_devices(root, "card", keys=self._keys)
        slots = mig_slots(root)
        for card in cards:
            instances = sum(1 for slot in slots if slot.card_key == card.key)
            mig = f" (MIG mode, {instances} instances)" if instances else ""
            log.info("nvidia-smi: GPU {busid} {name}{mig}", busid=printable(card.busid), name=printable(card.name),
                     mig=mig)
        if not cards:
            log.warn("nvidia-smi: no GPU found; serving an empty list and looking again every poll")
        if listing is not None and slots:
            try:
                self._name(slots, listing.output(self._timeout))
            except (SmiRunError, SmiReportError):
                self._slots = ()  # asked again at the first poll, which logs why it fails
        elif listing is not None:
            listing.discard()
        devices, _ = self._read_devices(root)
        return Snapshot(devices)

    def _read_devices(self, root: Any) -> tuple[tuple[DeviceSample, ...], Problems]:
        """In the worker: the report's devices, its pids' start times told by `_starts`."""
        self._starts.check()
        try:
            return read_devices(root, self._mig, self._profiles, self._keys, self._mig_uuids, self._starts)
        finally:
            self._starts.sweep()

    def _locate(self) -> str:
        wanted = self._configured or "nvidia-smi"
        found = shutil.which(wanted)
        if found is not None:
            return found
        if os.path.exists(wanted):
            raise ReaderUnavailable(f"{wanted} is not an executable file")
        if os.sep not in wanted:
            raise ReaderUnavailable(f"{wanted} is not installed (not found on PATH)")
        raise ReaderUnavailable(f"{wanted} does not exist")

    def poll(self) -> Deferred:
        """Run ``nvidia-smi -q -x`` (and ``-L`` when MIG instances changed); fires with a Snapshot."""
        return ensureDeferred(self._poll())

    async def _poll(self) -> Snapshot:
        chunks = await self._run("-q", "-x")
        try:
            root, preamble, slots = await self._worker.submit(_parse, chunks, self._mig == "instances")
        except SmiReportError as error:
            raise SmiRunError(f"{self._binary} -q -x: {error}") from None
        problems = Problems()
        note_preamble(preamble, problems)
        if self._mig == "instances":
            await self._learn_names(slots, problems)
        devices, found = await self._worker.submit(self._read_devices, root)
        self._report = root
        problems.update(found)
        self._problems.report(problems)
        for device in devices:
            self._known[device.key] = device
        current = {device.key for device in devices}
        gone = tuple(d.absent() for key, d in self._known.items() if key not in current)
        # who the processes are (procinfo.py), read in the thread
        return await self._worker.submit(self.contexts.attach, Snapshot(devices + gone))

    def health(self, wanted: Callable[[str], bool]) -> list[tuple[str, Deferred]]:
        """The health figures of each card `wanted` (by bus id) in the latest report, each fired already."""
        if self._report is None:
            return []
        return [(r.key, succeed(r)) for r in read_cards_health(self._report) if wanted(r.key)]

    def xid_counts(self) -> None:
        """None: nvidia-smi's report has no XID events."""

    async def _learn_names(self, slots: tuple[MigSlot, ...], problems: Problems) -> None:
        """Ask ``nvidia-smi -L`` for profile names when the MIG instances (their ids, SMs and memory)
        changed: a MIG host normally runs one child per poll, not two."""
        now = self._reactor.seconds()
        if slots == self._slots and (self._names_problem is None or now < self._names_retry_at):
            if self._names_problem is not None:
                problems.add("mig-names", self._names_problem)
            return
        self._slots, self._profiles, self._mig_uuids, self._names_problem = slots, {}, {}, None
        if not slots:
            return
        try:
            self._name(slots, b"".join(await self._run("-L")))
        except (SmiRunError, SmiReportError) as error:
            self._names_problem = f"MIG profile names unknown, names derived from the report shown ({error})"
            self._names_retry_at = now + NAMES_RETRY
            problems.add("mig-names", self._names_problem)

    def _name(self, slots: tuple[MigSlot, ...], listing: bytes) -> None:
        """The instances' profiles and UUIDs from an output of ``nvidia-smi -L``."""
        self._profiles, self._mig_uuids = name_slots(slots, parse_mig_names(listing.decode("utf-8", "replace")))
        self._slots = slots

    def _run(self, *arguments: str) -> Deferred:
        """Run nvidia-smi with `arguments` as a child; fires with its stdout, in the chunks read."""
        if self._binary is None:
            return fail(SmiRunError("nvidia-smi: the reader was not opened"))
        if self._child is not None:
            if self._child.killed is not None:
                # the same cause as the kill, so that it is logged once, not alternating
                return fail(SmiRunError(self._child.killed))
            # no pid in the message: a cause is logged (and counted in the metrics) by its words
            return fail(SmiRunError(f"{self._child.command}: the previous run has not ended yet"))
        self._adopt()
        argv = [self._binary, *arguments]
        sweep = self._orphans.sweep if self._orphans is not None else (lambda: None)
        run = Run(self._reactor, " ".join(argv), self._timeout, lambda: self._ended(run), sweep)
        self._child = run
        try:
            argv = [self._setsid, *argv] if self._setsid is not None else argv
            self._reactor.spawnProcess(run, argv[0], argv, env=None)
        except OSError as error:
            self._child = None
            run.fail(f"cannot be started: {error}")
        return run.result

    def _adopt(self) -> None:
        """Be the subreaper of what runs start, in this process (again after a fork)."""
        if self._orphans is not None and self._subreaper != os.getpid():
            self._subreaper = os.getpid()
            become_subreaper()

    def _ended(self, run: Run) -> None:
        if self._child is run:
            self._child = None

    def close(self) -> None:
        """Kill a running child (and what runs left); its poll fails."""
        ending = []
        if self._child is not None:
            if self._child.transport.pid is not None:
                ending.append(self._child.transport.pid)
            self._child.kill()
            self._child.fail("was stopped: the reader is closing")
        if self._orphans is not None:
            self._orphans.sweep_now(ending=ending)
        if self._starts.watched:
            self._worker.submit(self._starts.close)  # after any poll in flight, in the worker
        self._worker.stop()


def _parse(chunks: list[bytes], instances: bool) -> tuple[Any, str, tuple[MigSlot, ...]]:
    """In the worker: a report's kept elements, what was printed before it, and its MIG instances."""
    root, preamble = parse_output(chunks)
    return root, preamble, mig_slots(root) if instances else ()


