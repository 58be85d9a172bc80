"""Slots no other user can take: two ordinary uids flooding every listener leave root's
and an --allow-uid user's atop their room (real uids through setpriv)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
from daemon import Client, Daemon, free_port
from systemd_container import in_ci
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python import usage

from atopgpud_tw.problems import UidBurstLogs
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory, AtopGpuProtocol, Limits
from atopgpud_tw.server.system.access import AllowList
from atopgpud_tw.tap import Options

# -- the accounting, on a MemoryReactorClock --


def slots(**limits) -> AtopGpuFactory:
    return AtopGpuFactory(Board(), Limits(**limits), MemoryReactorClock())


def connect(factory: AtopGpuFactory, uid: int | None) -> AtopGpuProtocol | None:
    """A connection of `uid` as a fair port admits it (TCP: no allow-list); None if refused."""
    if not factory.room_for(uid, socket.AF_INET):
        return None
    protocol = factory.buildProtocol(None)
    protocol.transport = StringTransport()
    protocol.last_asked = factory.clock.seconds()
    factory.take_slot(protocol, uid)
    return protocol


def closed(protocols) -> list[bool]:
    return [p.transport.disconnecting for p in protocols]


def test_root_and_allowed_users_keep_their_slots_whatever_the_others_take():
    """Ordinary uids, however many, take only the shared slots: root and each --allow-uid
    user still get their kept ones; the factory's count of shared slots stays exact."""
    factory = slots(max_clients=64, allow=AllowList(uids=frozenset({1002})))
    limits = factory.limits
    assert (limits.reserve, limits.shared) == (8, 48)
    taken = [p for uid in range(2000, 2100) for p in [connect(factory, uid)] if p is not None]
    assert len(taken) == 48 and factory.shared_taken == 48
    assert connect(factory, 3000) is None  # the 48 uids holding one each: nobody holds more than an even part
    for uid in (0, 1002):
        mine = [connect(factory, uid) for _ in range(8)]
        assert None not in mine
    assert factory.shared_taken == 48 and len(factory.connections) == 64
    for protocol in taken[:5] + mine[:3]:
        factory.forget(protocol)
    assert factory.shared_taken == 43
    assert factory.shared_taken == sum(max(0, n - limits.kept_for(u)) for u, n in factory.per_uid.items())


def test_the_reserve_shrinks_to_half_of_max_clients():
    """Many --allow-uid users share at most half of --max-clients, one slot each at least."""
    allowed = AllowList(uids=frozenset(range(1000, 1015)))
    assert Limits(max_clients=256, allow=allowed).reserve == 8  # 16 x 8 = 128
    assert Limits(max_clients=64, allow=allowed).reserve == 2
    assert Limits(max_clients=64, allow=allowed).shared == 32


def test_more_allowed_users_than_half_of_max_clients_is_an_error():
    """Each of root and the --allow-uid users must have a slot kept: else start-up says how many."""
    with pytest.raises(usage.UsageError, match="raise it to at least 8"):
        Options().parseOptions(["--max-clients", "6", "--allow-uid", "1,2,3"])
    options = Options()
    options.parseOptions(["--max-clients", "8", "--allow-uid", "1,2,3", "--reserved-clients", "2",
                          "--busy-idle-timeout", "5"])
    assert (options["reserved-clients"], options["busy-idle-timeout"]) == (2, 5.0)


def test_a_uid_below_an_even_part_gets_the_slot_of_the_uid_holding_most():
    """Shared slots all taken: a newcomer holding less than an even part closes the
    longest-silent connection of the biggest holder; holders at an even part are refused."""
    factory = slots(max_clients=16)  # 8 kept for root, 8 shared, 6 at most per uid
    clock = factory.clock
    big = [connect(factory, 1000) for _ in range(6)]
    clock.advance(5)
    for protocol in big[1:]:
        protocol.last_asked = clock.seconds()  # all but the first asked since
    small = [connect(factory, 1001) for _ in range(2)]
    assert factory.shared_taken == 8
    newcomer = connect(factory, 1002)
    assert newcomer is not None
    assert closed(big) == [True, False, False, False, False, False]
    assert factory.per_uid[1000] == 5 and factory.shared_taken == 8
    assert connect(factory, 1002) is not None  # 1002 holds 1 < 8 // 3
    assert connect(factory, 1002) is None  # 1002 holds 2, an even part
    assert not any(closed(small))


def test_silent_connections_close_when_the_shared_slots_are_short():
    """Every shared slot taken and another connection asked for: those silent for
    --busy-idle-timeout are closed (all of them, not root's kept ones), others are not."""
    factory = slots(max_clients=16, busy_idle_timeout=60)
    clock = factory.clock
    roots = [connect(factory, 0) for _ in range(8)]
    quiet = [connect(factory, 1000) for _ in range(4)]
    asking = [connect(factory, 1001) for _ in range(4)]
    clock.advance(30)
    assert connect(factory, 1000) is None  # nobody silent for 60 s yet, 1000 at an even part
    for protocol in asking:
        protocol.last_asked = clock.seconds()
    clock.advance(31)
    with capturedLogs() as events:
        assert connect(factory, 1000) is not None
    assert all(closed(quiet)) and not any(closed(asking)) and not any(closed(roots))
    assert factory.per_uid[1000] == 1 and factory.shared_taken == 5
    lines = [e for e in events if "to make room" in e.get("log_format", "")]
    assert len(lines) == 1  # one line for four closed


def test_refusals_are_logged_once_per_uid():
    """Two uids refused over and over: one line each, naming the uid, in one burst."""
    factory = slots(max_clients=16, max_clients_per_uid=2)
    with capturedLogs() as events:
        for _ in range(10):
            for uid in (1000, 1001):
                connect(factory, uid)
    refusals = [e["who"] for e in events if e.get("log_format", "").startswith("refusing connections of")]
    assert refusals == ["uid 1000", "uid 1001"]
    factory.stopFactory()


def test_uid_burst_logs_are_bounded():
    """Beyond `most` uids in a burst, the others share one."""
    clock = MemoryReactorClock()
    logs = UidBurstLogs(clock, most=2)
    said = []
    for uid in range(10):
        logs.event(uid, lambda uid=uid: said.append(uid), "x")
    assert said == [0, 1, 2]  # 2 the first of the shared burst
    clock.advance(11)
    logs.event(5, lambda: said.append(5), "x")
    assert said[-1] == 5 and logs.total == 11
    logs.stop()


# -- end to end, as other users --

SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def as_others() -> None:
    """Root, setpriv and /usr/bin/python3, to act as other users: else skipped (in CI, failed)."""
    if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK) or shutil.which("setpriv") is None:
        reason = "needs root, setpriv and /usr/bin/python3 to act as other users"
        if in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)

#: opens COUNT connections to ADDRESS one after another, sends one T on each and
#: waits for its answer, says "ready", and holds them all until its standard input
#: closes; for each line read, it says how many are still open
ATTACKER = """
import socket, sys
family, address, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
if family == "unix":
    target, kind = "\\0" + address, socket.AF_UNIX
else:
    target, kind = ("127.0.0.1", int(address)), socket.AF_INET
held = []
answered = 0
for _ in range(count):
    sock = socket.socket(kind, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(target)
        sock.sendall(b"T\\x02")
        if sock.recv(4):
            answered += 1
    except OSError:
        pass
    held.append(sock)
print("ready", flush=True)
for _ in sys.stdin:
    still = 0
    for sock in held:
        sock.setblocking(False)
        try:
            while sock.recv(65536):
                pass  # the rest of its answer
        except BlockingIOError:
            still += 1
        except OSError:
            pass
    print(still, flush=True)
"""


class Attacker:
    """A process of `uid` (no supplementary groups) holding up to `count` connections."""

    def __init__(self, uid: int, family: str, address: str, count: int = 300) -> None:
        self.uid = uid
        self.proc = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             SYSTEM_PYTHON, "-c", ATTACKER, family, address, str(count)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "ready\n", f"the attacker of uid {self.uid} failed"

    def held(self) -> int:
        """How many of its connections are open now."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@contextmanager
def attackers(*which: tuple[int, str, str]) -> Iterator[list[Attacker]]:
    """The attackers, started one after another (each ready before the next), stopped at the end."""
    started: list[Attacker] = []
    try:
        for uid, family, address in which:
            started.append(Attacker(uid, family, address))
            started[-1].ready()
        yield started
    finally:
        for one in started:
            one.stop()


def answered_as(uid: int, family: str, address: str) -> bool:
    """Whether a client of `uid` gets its T answered (a process of that uid, as atop would be)."""
    code = (
        "import socket,sys\n"
        + ("s=socket.socket(socket.AF_UNIX); t='\\0'+sys.argv[1]\n" if family == "unix"
           else "s=socket.socket(); t=('127.0.0.1',int(sys.argv[1]))\n")
        + "s.settimeout(5); s.connect(t); s.sendall(b'T\\x02')\n"
        "sys.exit(0 if len(s.recv(4)) == 4 else 3)\n"
    )
    result = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", SYSTEM_PYTHON, "-c", code, address],
        capture_output=True, timeout=30,
    )
    return result.returncode == 0


def root_answers(daemon: Daemon, port: int) -> list[float]:
    """Root's T over the UNIX socket three times and over TCP twice: each answer's seconds."""
    took = []
    for client in [daemon.client() for _ in range(3)] + [
        Client(("127.0.0.1", port), socket.AF_INET) for _ in range(2)
    ]:
        try:
            start = time.monotonic()
            client.types()
            took.append(time.monotonic() - start)
        finally:
            client.close()
    return took


@pytest.mark.e2e
def test_two_users_flooding_both_listeners_leave_root_its_room(tmp_path, as_others):
    """uid 1000 on the UNIX socket and uid 1001 on TCP open 300 connections each and ask once:
    root's atop is still answered on both, the shared slots are not all theirs, and each
    refused uid is named in the log once."""
    port = free_port()
    daemon = Daemon(tmp_path, ["--reader", "sim", "--listen", f"tcp:{port}:interface=127.0.0.1"]).start()
    try:
        with attackers((1000, "unix", daemon.name), (1001, "tcp", str(port))) as both:
            took = root_answers(daemon, port)
            first, second = (one.held() for one in both)
            print(f"attackers hold {first} + {second}; root's answers took {[round(t * 1000, 1) for t in took]} ms")
            assert len(took) == 5
            assert first + second <= 256 - 8  # root's eight are never theirs
            assert min(first, second) >= 124 - 1  # neither takes the other's even part
        log = daemon.log()
        for uid in (1000, 1001):
            assert log.count(f"refusing connections of uid {uid}") == 1, log
    finally:
        daemon.stop()


@pytest.mark.e2e
def test_an_allowed_user_keeps_its_room_when_others_flood_tcp(tmp_path, as_others):
    """With --allow-uid 1002, uids 1000 and 1001 flood the TCP listener (which the allow-list
    does not guard): root and uid 1002 are still answered on the UNIX socket and on TCP."""
    port = free_port()
    daemon = Daemon(
        tmp_path, ["--reader", "sim", "--allow-uid", "1002", "--listen", f"tcp:{port}:interface=127.0.0.1"]
    ).start()
    try:
        with attackers((1000, "tcp", str(port)), (1001, "tcp", str(port))):
            assert len(root_answers(daemon, port)) == 5
            assert answered_as(1002, "unix", daemon.name)
            assert answered_as(1002, "tcp", str(port))
            assert not answered_as(1000, "unix", daemon.name)  # the allow-list still holds
    finally:
        daemon.stop()
