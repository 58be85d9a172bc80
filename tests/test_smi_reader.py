"""The nvidia-smi reader with real child processes, against tests/fake_nvidia_smi.py."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import pytest_twisted
from smi_doubles import FIXTURES, FakeSmi
from twisted.internet import reactor, task

from atopgpud_tw.readers.base import ReaderUnavailable
from atopgpud_tw.readers.smi import child as smi_child
from atopgpud_tw.readers.smi import reader as smi
from atopgpud_tw.readers.smi.reader import SmiReader, SmiRunError
from atopgpud_tw.snapshot import UNSUPPORTED

MIG_CARD = "GPU-11111111-2222-3333-4444-555555555555"


def dead(pid: int | None) -> bool:
    """Whether `pid` has ended (a zombie waiting for init to reap it counts)."""
    assert pid is not None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_dead(pid: int | None, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not dead(pid):
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.02)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSmi:
    return FakeSmi(tmp_path)


@pytest.fixture
def make_reader(fake: FakeSmi) -> Iterator[Callable[..., SmiReader]]:
    readers = []

    def make(timeout: float = 2.0, mig: str = "instances") -> SmiReader:
        reader = SmiReader(reactor, str(fake.binary), timeout=timeout, mig=mig)
        readers.append(reader)
        return reader

    yield make
    for reader in readers:
        reader.close()  # no stand-in outlives its test


async def until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting"
        await task.deferLater(reactor, 0.02, lambda: None)


async def failure_of(reader: SmiReader) -> str:
    with pytest.raises(SmiRunError) as raised:
        await reader.poll()
    message = str(raised.value)
    assert "\n" not in message
    return message


@pytest_twisted.ensureDeferred
async def test_poll_reads_a_report(fake: FakeSmi, make_reader) -> None:
    """A poll runs nvidia-smi -q -x as a child and fires with its devices."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    snapshot = await reader.poll()
    assert [(d.busid, d.gpu_busy) for d in snapshot.devices] == [
        ("00000000:17:00.0", 13),
        ("00000000:65:00.0", 0),
    ]
    assert not reader.running
    # open's trial run, then the poll (and -L beside the trial run, dropped: no MIG here)
    assert [call for call in fake.calls() if call != "-L"] == ["-q -x", "-q -x"]


@pytest_twisted.ensureDeferred
async def test_poll_tells_who_the_processes_are(fake: FakeSmi, make_reader) -> None:
    """The reader reads each listed process's /proc once (in its thread): this test's own process
    listed as pid 100 is shown with its uid and comm; a pid that is no process here is unknown."""
    report = (FIXTURES / "plain-v11.xml").read_bytes()
    fake.report("plain-v11.xml", report.replace(b"<pid>100</pid>", f"<pid>{os.getpid()}</pid>".encode())
                .replace(b"<pid>200</pid>", b"<pid>4000000</pid>"))
    reader = make_reader()
    reader.open()
    snapshot = await reader.poll()
    mine = snapshot.contexts[os.getpid()]
    assert mine.known and mine.uid == os.getuid() and mine.comm
    assert not snapshot.contexts[4000000].known


@pytest_twisted.ensureDeferred
async def test_hung_nvidia_smi_is_killed_and_the_next_poll_works(fake: FakeSmi, make_reader) -> None:
    """A run past the timeout is killed, the poll fails at once, and a fixed nvidia-smi is read again."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=0.5)
    reader.open()
    fake.mode("hang")
    started = time.monotonic()
    message = await failure_of(reader)
    assert time.monotonic() - started < 2.0
    assert message == f"{fake.binary} -q -x did not finish within 0.5 s; killed"
    # killed but not yet reaped: another poll must not start a second child
    assert reader.running
    pid = fake.hung_pid()
    # the same cause as the kill, so the log says it once rather than alternating
    assert await failure_of(reader) == f"{fake.binary} -q -x did not finish within 0.5 s; killed"
    # open's run and the hung one: no second child
    assert [call for call in fake.calls() if call != "-L"] == ["-q -x", "-q -x"]
    await until(lambda: not reader.running)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped: no zombie left behind
    fake.mode("report")
    assert len((await reader.poll()).devices) == 2


@pytest_twisted.ensureDeferred
async def test_garbage_fails_the_poll_with_a_clear_message(fake: FakeSmi, make_reader) -> None:
    """Output that is no XML fails the poll, naming the command and the fault."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    fake.mode("garbage")
    assert await failure_of(reader) == (
        f"{fake.binary} -q -x: the output is not XML (syntax error: line 1, column 0)"
    )


@pytest_twisted.ensureDeferred
async def test_non_zero_exit_fails_the_poll_with_what_it_said(fake: FakeSmi, make_reader) -> None:
    """A failing nvidia-smi's status and first line become the poll's error."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    fake.mode("fail")
    message = await failure_of(reader)
    assert message.startswith(f"{fake.binary} -q -x exited with status 9: NVIDIA-SMI has failed because")


@pytest_twisted.ensureDeferred
async def test_empty_output_fails_the_poll(fake: FakeSmi, make_reader) -> None:
    """Exit status 0 with nothing printed is no report."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    fake.mode("empty")
    assert await failure_of(reader) == f"{fake.binary} -q -x: the output is empty"


@pytest_twisted.ensureDeferred
async def test_endless_output_is_cut_off(fake: FakeSmi, make_reader, monkeypatch) -> None:
    """More output than any report has kills the child and fails the poll."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    monkeypatch.setattr(smi_child, "MAX_OUTPUT", 1000)
    message = await failure_of(reader)
    assert message == f"{fake.binary} -q -x printed more than 1000 bytes; killed"
    await until(lambda: not reader.running)


@pytest_twisted.ensureDeferred
async def test_poll_before_open_fails() -> None:
    """Polling an unopened reader is an error, not a search for the binary."""
    assert "not opened" in await failure_of(SmiReader(reactor, "/nonexistent/nvidia-smi"))


@pytest_twisted.ensureDeferred
async def test_vanished_device_stays_listed_as_absent(fake: FakeSmi, make_reader) -> None:
    """A device missing from a later report is in the Snapshot with present=False."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    await reader.poll()
    fake.report("no-doctype-crlf.xml")
    snapshot = await reader.poll()
    assert [(d.busid, d.present) for d in snapshot.devices] == [
        ("00000000:01:00.0", True),
        ("00000000:17:00.0", False),
        ("00000000:65:00.0", False),
    ]
    gone = snapshot.devices[1]
    assert (gone.name, gone.gpu_busy, gone.processes) == ("NVIDIA Test Board A", UNSUPPORTED, ())


@pytest_twisted.ensureDeferred
async def test_mig_names_come_from_list_once(fake: FakeSmi, make_reader) -> None:
    """nvidia-smi -L is run when the instances are new, and not again while they stay."""
    fake.report("mig.xml")
    fake.listing("mig-list.txt")
    reader = make_reader()
    reader.open()
    for _ in range(2):
        snapshot = await reader.poll()
        assert [d.name for d in snapshot.devices[:3]] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    # open asks -L once (beside -q -x), so T names the instances before the first poll
    assert sorted(fake.calls()[:2]) == ["-L", "-q -x"] and fake.calls()[2:] == ["-q -x", "-q -x"]


@pytest_twisted.ensureDeferred
async def test_mig_names_are_asked_again_when_instances_change(fake: FakeSmi, make_reader) -> None:
    """A reconfigured card (here instance 13 became 14) means a new -L."""
    fake.report("mig.xml")
    fake.listing("mig-list.txt")
    reader = make_reader()
    reader.open()
    await reader.poll()
    data = (FIXTURES / "mig.xml").read_bytes().replace(b"<gpu_instance_id>13<", b"<gpu_instance_id>14<")
    fake.report("mig.xml", data)
    snapshot = await reader.poll()
    assert snapshot.devices[2].busid == "00000000:17:00.0/14.0"
    assert snapshot.devices[2].name == "1g.10gb"
    assert fake.calls().count("-L") == 2


class LaterReactor:
    """The real reactor, but its clock can be moved ahead (for retry delays)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def seconds(self) -> float:
        return reactor.seconds() + self.ahead

    def __getattr__(self, name: str):
        return getattr(reactor, name)


@pytest_twisted.ensureDeferred
async def test_failed_list_gives_derived_names_logged_once(fake: FakeSmi, logged: list[str]) -> None:
    """Without -L the derived names are shown, the trouble is logged once, and -L is retried later."""
    fake.report("mig.xml")
    fake.mode("fail", "list-mode")
    clock = LaterReactor()
    reader = SmiReader(clock, str(fake.binary), timeout=2.0)
    reader.open()
    for _ in range(2):
        snapshot = await reader.poll()
        assert [d.name for d in snapshot.devices[:3]] == ["42sm.40gb", "28sm.20gb", "14sm.10gb"]
    # open's try, then the first poll's (which logs why it failed), not one per poll
    assert fake.calls().count("-L") == 2
    warnings = [line for line in logged if "MIG profile names unknown" in line]
    assert len(warnings) == 1
    assert "-L exited with status 9: NVIDIA-SMI has failed" in warnings[0]
    fake.listing("mig-list.txt")
    clock.ahead = smi.NAMES_RETRY
    snapshot = await reader.poll()
    assert fake.calls().count("-L") == 3
    assert snapshot.devices[0].name == "3g.40gb"
    assert any(line.startswith("nvidia-smi: recovered (MIG profile names unknown") for line in logged)


@pytest_twisted.ensureDeferred
async def test_card_mode_runs_no_list(fake: FakeSmi, make_reader) -> None:
    """mig="card" needs no profile names, so -L is never run."""
    fake.report("mig.xml")
    reader = make_reader(mig="card")
    reader.open()
    snapshot = await reader.poll()
    assert [d.busid for d in snapshot.devices] == ["00000000:17:00.0", "00000000:65:00.0"]
    assert "-L" not in fake.calls()


@pytest_twisted.ensureDeferred
async def test_value_problems_are_logged_once_and_on_recovery(
    fake: FakeSmi, make_reader, logged: list[str]
) -> None:
    """An unreadable value is logged when it starts and when it ends, not every poll."""
    fake.report("unreadable.xml")
    reader = make_reader()
    reader.open()
    await reader.poll()
    await reader.poll()
    problem = "GPU 00000000:21:00.0: unreadable utilization/gpu_util 'Unknown Error'"
    assert logged.count(f"nvidia-smi: {problem}") == 1
    fake.report("plain-v11.xml")
    await reader.poll()
    assert logged.count(f"nvidia-smi: recovered ({problem})") == 1


@pytest_twisted.ensureDeferred
async def test_close_kills_a_running_child(fake: FakeSmi, make_reader) -> None:
    """Closing the reader kills its child and fails the poll in flight."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=30.0)
    reader.open()
    fake.mode("hang")
    polling = reader.poll()
    await until(lambda: fake.hung_pid() is not None)
    reader.close()
    with pytest.raises(SmiRunError, match="the reader is closing"):
        await polling
    await until(lambda: not reader.running)


@pytest_twisted.ensureDeferred
async def test_cancelling_a_poll_kills_its_child(fake: FakeSmi, make_reader) -> None:
    """A cancelled poll does not leave nvidia-smi running until the timeout."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=30.0)
    reader.open()
    fake.mode("hang")
    polling = reader.poll()
    await until(lambda: fake.hung_pid() is not None)
    polling.cancel()
    with pytest.raises(SmiRunError, match="-q -x was cancelled; killed"):
        await polling
    await until(lambda: not reader.running)


def test_open_logs_the_cards(fake: FakeSmi, make_reader, logged: list[str]) -> None:
    """open() runs nvidia-smi once and names each card, MIG cards with their instances."""
    fake.report("mig.xml")
    make_reader().open()
    assert "nvidia-smi: GPU 00000000:17:00.0 NVIDIA A100-SXM4-80GB (MIG mode, 3 instances)" in logged
    assert "nvidia-smi: GPU 00000000:65:00.0 NVIDIA A100-SXM4-80GB" in logged


def test_open_without_the_binary(tmp_path: Path) -> None:
    """A configured path that does not exist makes the reader unavailable."""
    with pytest.raises(ReaderUnavailable, match=f"^{tmp_path}/nvidia-smi does not exist$"):
        SmiReader(reactor, str(tmp_path / "nvidia-smi")).open()


def test_open_without_nvidia_smi_on_path(tmp_path: Path, monkeypatch) -> None:
    """Without a configured path the binary is looked for on PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ReaderUnavailable, match="nvidia-smi is not installed"):
        SmiReader(reactor, None).open()


def test_open_on_a_file_that_is_not_executable(tmp_path: Path) -> None:
    """A binary without the execute bit is refused with that reason."""
    binary = tmp_path / "nvidia-smi"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o644)
    with pytest.raises(ReaderUnavailable, match="is not an executable file"):
        SmiReader(reactor, str(binary)).open()


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("fail", "exited with status 9: NVIDIA-SMI has failed"),
        ("garbage", "the output is not XML"),
        ("empty", "the output is empty"),
        ("hang", "did not finish within 0.5 s; killed"),
    ],
)
def test_open_refuses_an_nvidia_smi_without_a_report(fake: FakeSmi, mode: str, reason: str) -> None:
    """The blocking trial run must give a report, in time."""
    fake.mode(mode)
    reader = SmiReader(reactor, str(fake.binary), timeout=0.5)
    with pytest.raises(ReaderUnavailable, match=reason) as raised:
        reader.open()
    assert "\n" not in str(raised.value)


@pytest_twisted.ensureDeferred
async def test_timeout_kills_what_nvidia_smi_started(fake: FakeSmi, make_reader) -> None:
    """A hung run is killed with its whole process group, not only the direct child."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=0.5)
    reader.open()
    fake.mode("orphan-hang")
    assert await failure_of(reader) == f"{fake.binary} -q -x did not finish within 0.5 s; killed"
    await until(lambda: not reader.running)
    wait_dead(fake.hung_pid())
    wait_dead(fake.grandchild_pid())


@pytest_twisted.ensureDeferred
async def test_endless_output_of_a_grandchild_is_dropped_at_once(fake: FakeSmi, make_reader, monkeypatch) -> None:
    """Output past the cap is let go at the kill, and the group printing it is killed."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=30.0)
    reader.open()
    monkeypatch.setattr(smi_child, "MAX_OUTPUT", 100_000)
    fake.mode("flood")
    assert await failure_of(reader) == f"{fake.binary} -q -x printed more than 100000 bytes; killed"
    child = reader._child
    assert child is None or not child._out  # nothing kept while it is reaped
    await until(lambda: not reader.running)
    wait_dead(fake.grandchild_pid())


@pytest_twisted.ensureDeferred
async def test_a_grandchild_holding_stdout_does_not_hold_the_poll(fake: FakeSmi, make_reader) -> None:
    """nvidia-smi having exited, its report is read though something it started keeps the pipe."""
    fake.report("plain-v11.xml")
    reader = make_reader(timeout=30.0)
    reader.open()
    fake.mode("linger")
    assert len((await reader.poll()).devices) == 2
    assert not reader.running
    wait_dead(fake.grandchild_pid())


def test_open_kills_what_a_hung_nvidia_smi_started(fake: FakeSmi) -> None:
    """At start-up too a timeout kills the whole process group."""
    fake.mode("orphan-hang")
    with pytest.raises(ReaderUnavailable, match="did not finish within 0.5 s; killed$"):
        SmiReader(reactor, str(fake.binary), timeout=0.5).open()
    wait_dead(fake.hung_pid())
    wait_dead(fake.grandchild_pid())


def test_open_cuts_off_endless_output(fake: FakeSmi, monkeypatch) -> None:
    """The start-up run has the same output cap as a poll."""
    monkeypatch.setattr(smi_child, "MAX_OUTPUT", 100_000)
    fake.mode("flood")
    with pytest.raises(ReaderUnavailable, match="printed more than 100000 bytes; killed$"):
        SmiReader(reactor, str(fake.binary), timeout=30.0).open()
    wait_dead(fake.grandchild_pid())


def test_open_reads_a_report_though_a_grandchild_holds_stdout(fake: FakeSmi) -> None:
    """At start-up an exited nvidia-smi is finished, whatever it left holding its pipe."""
    fake.report("plain-v11.xml")
    fake.mode("linger")
    snapshot = SmiReader(reactor, str(fake.binary), timeout=30.0).open()
    assert len(snapshot.devices) == 2
    wait_dead(fake.grandchild_pid())


def test_open_kills_what_a_discarded_list_run_left(fake: FakeSmi) -> None:
    """The -L run beside -q -x, not needed without MIG, leaves nothing running either."""
    fake.report("plain-v11.xml")
    fake.mode("linger", "list-mode")
    SmiReader(reactor, str(fake.binary), timeout=30.0).open()
    # killed before it had started one, the -L run left nothing to look for
    if fake.grandchild_pid() is not None:
        wait_dead(fake.grandchild_pid())


@pytest_twisted.ensureDeferred
async def test_without_setsid_it_says_so_once_and_still_reads(
    fake: FakeSmi, make_reader, logged: list[str], monkeypatch
) -> None:
    """Where setsid is not installed the child runs as it is, and start-up names the loss."""
    monkeypatch.setenv("PATH", str(fake.state))
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    assert len((await reader.poll()).devices) == 2
    assert [line for line in logged if "setsid" in line] == [
        "nvidia-smi: setsid is not installed; a timed-out run's own children will not be killed"
    ]


def _running(pid: int) -> bool:
    return not dead(pid)


@pytest_twisted.ensureDeferred
async def test_a_grandchild_that_let_go_of_the_pipes_dies_with_the_run(fake: FakeSmi, make_reader) -> None:
    """What nvidia-smi left in its group, ignoring SIGTERM and holding no pipe, is killed when the run ends."""
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    fake.mode("leave")
    try:
        assert len((await reader.poll()).devices) == 2
        (left,) = fake.leftovers()
        wait_dead(left)
    finally:
        fake.reap_leftovers()


def test_open_kills_a_grandchild_that_let_go_of_the_pipes(fake: FakeSmi) -> None:
    """The start-up run's leftovers in its group die with it too."""
    fake.report("plain-v11.xml")
    fake.mode("leave")
    try:
        SmiReader(reactor, str(fake.binary), timeout=5.0, mig="card").open()
        (left,) = fake.leftovers()
        wait_dead(left)
    finally:
        fake.reap_leftovers()


@pytest_twisted.ensureDeferred
async def test_the_report_is_parsed_and_read_off_the_reactor(fake: FakeSmi, make_reader, monkeypatch) -> None:
    """Parsing a report and reading its devices run in the reader's thread, not the reactor's."""
    import threading

    threads = []
    real_parse, real_read = smi._parse, smi.read_devices

    def parse(*args):
        threads.append(threading.current_thread().name)
        return real_parse(*args)

    def read(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(smi, "_parse", parse)
    monkeypatch.setattr(smi, "read_devices", read)
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    threads.clear()
    assert len((await reader.poll()).devices) == 2
    assert threads == ["atopgpud-smi-report"] * 2


@pytest_twisted.ensureDeferred
async def test_a_gpu_listing_more_processes_than_read_counts_none_and_says_so(
    fake: FakeSmi, make_reader, logged: list[str], monkeypatch
) -> None:
    """Past the cap a GPU's processes are not counted in that poll (no partial list), logged once."""
    from atopgpud_tw.readers.smi import stream

    monkeypatch.setattr(stream, "MAX_GPU_PROCESSES", 2)
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    snapshot = await reader.poll()
    assert snapshot.devices[0].processes is None  # four listed
    assert snapshot.devices[1].processes is not None
    await reader.poll()
    said = [line for line in logged if "lists more than 2 processes" in line]
    assert said == ["nvidia-smi: GPU 00000000:17:00.0 lists more than 2 processes: none of them is counted"]


@pytest_twisted.ensureDeferred
async def test_readiness_follows_the_gpus_nvidia_smi_reads(fake: FakeSmi, make_reader) -> None:
    """Through the poller: ready while nvidia-smi reports the GPUs; not ready, with the reason,
    once three polls in a row read none of them (the GPUs gone from its report); ready again."""
    import re

    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.server.atop.poller import UNREAD_POLLS, PollerService
    from atopgpud_tw.server.web.metrics import not_ready

    report = (FIXTURES / "plain-v11.xml").read_bytes()
    fake.report("plain-v11.xml")
    reader = make_reader()
    reader.open()
    poller = PollerService(reader, Board(), 1.0, reactor)
    await poller.poll_once()
    assert not_ready(poller) is None
    fake.report("", data=re.sub(rb"<gpu id=.*?</gpu>", b"", report, flags=re.S))
    for _ in range(UNREAD_POLLS - 1):
        await poller.poll_once()
        assert not_ready(poller) is None  # a poll or two without them: not yet
    await poller.poll_once()
    assert not_ready(poller) == f"could not read any of the 2 GPUs in the last {UNREAD_POLLS} polls"
    fake.report("plain-v11.xml")
    await poller.poll_once()
    assert not_ready(poller) is None
