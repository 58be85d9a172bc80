"""Accepting fairly, on real sockets and a MemoryReactorClock: reaping, the budget, the rounds by uid, the shares."""

from __future__ import annotations

import errno
import os
import socket
import struct
import uuid

import pytest
from snapshots import dev, snap
from twisted.internet.testing import MemoryReactorClock

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory, Limits
from atopgpud_tw.server.system.accepting import ACCEPT_BUDGET, FairTCPPort, FairUNIXPort, fair_reactor
from atopgpud_tw.server.system.access import SockDiag, peer_uid

NOBODY = 65534


def listening(**limits):
    board = Board()
    board.fold(snap(dev()))
    reactor = MemoryReactorClock()
    factory = AtopGpuFactory(board, Limits(**limits), reactor)
    address = "\0atopgpud-test-" + uuid.uuid4().hex[:12]
    port = FairUNIXPort(address, factory, 4096, reactor=reactor)
    port.startListening()
    return port, factory, reactor, address


def client(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    sock.send(b"S\x02")
    return sock


def as_nobody(address: str, count: int) -> tuple[int, int]:
    """A child that connects `count` times as nobody and keeps them open until told; (pid, pipe to tell it)."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            kept = [client(address) for _ in range(count)]
            os.write(ready_w, b"x")
            os.read(done_r, 1)
            del kept
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    return pid, done_w


def hung_up_on(sock: socket.socket) -> bool:
    try:
        return sock.recv(16, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:  # closed with its request unread
        return True


def test_dead_connections_are_closed_before_anything_is_built():
    """Clients that connected, asked and hung up are reaped at once: no protocol, no slot."""
    port, factory, _, address = listening()
    for _ in range(200):
        client(address).close()
    port.take_turn()
    assert port.counts["reaped"] == 200 and port.counts["admitted"] == 0
    assert not factory.connections
    port.stopListening()


def test_at_most_the_budget_is_admitted_per_turn():
    """A burst of live connections becomes protocols a budget at a time, the rest on later turns."""
    port, factory, reactor, address = listening()
    kept = [client(address) for _ in range(3 * ACCEPT_BUDGET + 5)]
    port.take_turn()
    assert len(factory.connections) == ACCEPT_BUDGET
    assert len(reactor.getDelayedCalls()) >= 1  # the rest wait for the next turns
    reactor.advance(0)  # a Clock runs each next turn's call as it is scheduled
    assert len(factory.connections) == len(kept)
    port.stopListening()


def test_one_users_excess_waiting_connections_are_closed_at_once():
    """Beyond what one user may have waiting, its new connections are closed as they are drained."""
    port, factory, _, address = listening()
    port.pending_per_uid = 10
    port.budget = 4
    kept = [client(address) for _ in range(30)]
    port.take_turn()
    assert port.counts["excess"] == 20
    assert len(factory.connections) == 4
    assert sum(map(hung_up_on, kept)) == 20
    port.stopListening()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_the_turns_go_round_the_users():
    """Another user's one connection is admitted in the first turn, ahead of a flood waiting before it."""
    port, factory, _, address = listening()
    pid, done = as_nobody(address, 3 * ACCEPT_BUDGET)
    try:
        mine = client(address)
        port.take_turn()
        assert len(factory.connections) == ACCEPT_BUDGET
        assert factory.per_uid[0] == 1 and factory.per_uid[NOBODY] == ACCEPT_BUDGET - 1
        del mine
    finally:
        os.write(done, b"x")
        os.waitpid(pid, 0)
        port.stopListening()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_one_user_cannot_take_every_slot():
    """A user at its share of --max-clients is refused at accept; another user still connects."""
    port, factory, reactor, address = listening(max_clients=16)
    assert factory.limits.uid_share == 6  # of the 8 shared slots, 8 more being root's
    pid, done = as_nobody(address, 20)
    try:
        for _ in range(3):
            port.take_turn()
            reactor.advance(0)
        assert factory.per_uid[NOBODY] == 6
        assert port.counts["refused"] == 14
        mine = client(address)
        port.take_turn()
        assert factory.per_uid[0] == 1
        del mine
    finally:
        os.write(done, b"x")
        os.waitpid(pid, 0)
        port.stopListening()


def test_the_share_per_uid_is_an_option_and_defaults_to_three_quarters():
    """--max-clients-per-uid caps one uid; by default a quarter of the shared slots is left to others."""
    assert Limits().shared == 248 and Limits().uid_share == 186
    assert Limits(max_clients=2).shared == 1 and Limits(max_clients=2).uid_share == 1
    assert Limits(max_clients=100, max_clients_per_uid=5).uid_share == 5
    assert Limits(max_clients=3, max_clients_per_uid=5).uid_share == 2
    board = Board()
    factory = AtopGpuFactory(board, Limits(max_clients=10, max_clients_per_uid=2), MemoryReactorClock())
    factory.per_uid[1000] = 2
    assert not factory.room_for(1000, socket.AF_UNIX)
    assert factory.room_for(1001, socket.AF_UNIX)
    assert factory.room_for(None, socket.AF_INET)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_local_tcp_clients_uid_is_its_sockets_owner():
    """On TCP loopback, the uid is that of the process that made the client's socket."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(NOBODY)
            sock = socket.socket()
            sock.connect(listener.getsockname())
            sock.recv(1)
        finally:
            os._exit(0)
    accepted, _ = listener.accept()
    diag = SockDiag()
    try:
        assert peer_uid(accepted, diag) == NOBODY
        assert peer_uid(accepted) is None  # without the lookup: unknown
    finally:
        accepted.close()
        os.waitpid(pid, 0)
        listener.close()
        diag.close()


def test_only_twisteds_posix_reactor_gets_fair_ports():
    """A MemoryReactor is left as it is, so wiring tests see what they listen on."""
    reactor = MemoryReactorClock()
    assert fair_reactor(reactor) is reactor


def test_tcp_connections_reset_by_their_clients_are_reaped_too():
    """On TCP loopback, clients that asked and reset are closed unread; one still open is admitted."""
    board = Board()
    board.fold(snap(dev()))
    reactor = MemoryReactorClock()
    factory = AtopGpuFactory(board, Limits(), reactor)
    port = FairTCPPort(0, factory, 4096, "127.0.0.1", reactor)
    port.startListening()
    address = port.getHost()
    try:
        for _ in range(50):
            sock = socket.create_connection((address.host, address.port))
            sock.send(b"S\x02")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        kept = socket.create_connection((address.host, address.port))
        port.take_turn()
        assert port.counts["reaped"] == 50 and port.counts["admitted"] == 1
        assert len(factory.connections) == 1
        kept.close()
    finally:
        port.stopListening()


class _FailingOnce:
    """A listening socket whose first bare accept fails with `code`; the rest is the socket's."""

    def __init__(self, sock: socket.socket, code: int) -> None:
        self._sock = sock
        self._code = code

    def _accept(self):
        if self._code:
            code, self._code = self._code, 0
            raise OSError(code, os.strerror(code))
        return self._sock._accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_an_accept_error_is_left_to_twisteds_own_loop():
    """An error other than EAGAIN (a netfilter EPERM here) goes to Twisted's accept loop, which goes on."""
    port, factory, _, address = listening()
    for _ in range(5):
        client(address).close()
    real = port.socket
    port.socket = _FailingOnce(real, errno.EPERM)
    try:
        port.take_turn()
    finally:
        port.socket = real
    assert port.counts["reaped"] == 5 and not factory.connections
    port.stopListening()


def test_the_drain_waits_for_the_next_turn_and_stopping_cancels_it():
    """A readable listener is drained at the start of the next turn, after this turn's
    readable connections; one drain however often it is readable; none once it stops."""
    port, factory, reactor, address = listening()
    for _ in range(5):
        client(address).close()
    port.doRead()
    port.doRead()
    assert port.counts["reaped"] == 0 and len(reactor.getDelayedCalls()) == 1
    reactor.advance(0)
    assert port.counts["reaped"] == 5
    client(address).close()
    port.doRead()
    port.stopListening()
    reactor.advance(0)
    assert port.counts["reaped"] == 5
    assert not [call for call in reactor.getDelayedCalls() if call.active()]
