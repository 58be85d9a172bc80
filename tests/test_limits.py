"""Bounded resources: client count, unread replies, silent clients, who may connect."""

from __future__ import annotations

from connections import connect, replies
from snapshots import dev, snap
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory, Limits
from atopgpud_tw.server.system.access import AllowList, Peer


def factory_with(**limits) -> tuple[AtopGpuFactory, Clock]:
    board = Board()
    board.fold(snap(dev()))
    clock = Clock()
    return AtopGpuFactory(board, Limits(**limits), clock), clock


def logged(events, text):
    return sum(text in e.get("log_format", "") for e in events)


def test_connections_beyond_the_cap_are_closed_at_once_one_line_per_burst():
    """Beyond --max-clients a connection is closed at once; a burst logs twice at most."""
    with capturedLogs() as events:
        factory, clock = factory_with(max_clients=3)  # one kept for root, two shared
        assert factory.limits.shared == 2
        kept = [connect(factory=factory) for _ in range(2)]
        refused = [connect(factory=factory) for _ in range(50)]
        clock.advance(11)
    assert all(t.disconnecting for _, t in refused)
    assert not any(t.disconnecting for _, t in kept)
    assert logged(events, "refusing connections") == 1
    assert logged(events, "more {what} in that burst") == 1
    assert len(factory.board.clients) == 2
    kept[0][0].connectionLost(None)
    newcomer, transport = connect(factory=factory)
    assert not transport.disconnecting


def test_client_that_does_not_read_is_disconnected():
    """Replies piling up unread past --max-unsent end the connection."""
    factory, _ = factory_with(max_unsent=10_000)
    protocol, transport = connect(factory=factory)
    protocol.pauseProducing()  # what the transport does when its buffer is full
    for _ in range(10_000):
        protocol.dataReceived(b"S\x02")
        if transport.disconnecting:
            break
    assert transport.disconnecting
    assert len(transport.value()) < 20_000


def test_client_that_reads_again_is_not_disconnected():
    """A client that catches up (resumeProducing) starts with a clean slate."""
    factory, _ = factory_with(max_unsent=10_000)
    protocol, transport = connect(factory=factory)
    for _ in range(200):
        protocol.pauseProducing()
        protocol.dataReceived(b"S\x02")
        protocol.resumeProducing()
    assert not transport.disconnecting


def test_silent_new_connection_is_closed_after_the_first_request_timeout():
    """A connection that never sends a request is closed; one that asks is kept."""
    factory, clock = factory_with(first_request_timeout=60, idle_timeout=3600)
    silent, silent_transport = connect(factory=factory)
    talker, talker_transport = connect(factory=factory)
    talker.dataReceived(b"T\x02")
    clock.advance(61)
    assert silent_transport.disconnecting and not talker_transport.disconnecting


def test_atop_with_ten_minute_intervals_stays_connected():
    """A client asking every 10 minutes is never timed out; one silent for the idle timeout is."""
    factory, clock = factory_with(idle_timeout=3 * 3600)
    protocol, transport = connect(factory=factory)
    for _ in range(24):
        protocol.dataReceived(b"S\x02")
        clock.advance(600)
    assert not transport.disconnecting
    clock.advance(3 * 3600)
    assert transport.disconnecting
    assert len(replies(transport.value())) == 24


def test_allow_list_admits_listed_uids_groups_and_root():
    """Empty list admits all; otherwise uid, any group, or root."""
    anyone = AllowList()
    only = AllowList(uids=frozenset({1000}), gids=frozenset({44}))
    assert anyone.admits(Peer(1, 1234, frozenset({1234})))
    assert only.admits(Peer(1, 1000, frozenset({1000})))
    assert only.admits(Peer(1, 1234, frozenset({1234, 44})))
    assert only.admits(Peer(1, 0, frozenset({0})))
    assert not only.admits(Peer(1, 1234, frozenset({1234})))
    assert only.admits(None), "TCP peers have no credentials: not checked"


def test_burst_log_counts_and_resets():
    """Events within the quiet period are one burst; a later one starts another."""
    clock = Clock()
    lines = []
    burst = BurstLog(clock, quiet=10)
    for _ in range(5):
        burst.event(lambda: lines.append("first"), "things")
        clock.advance(1)
    clock.advance(20)
    burst.event(lambda: lines.append("first"), "things")
    assert lines == ["first", "first"] and burst.total == 6
    burst.stop()
    assert clock.getDelayedCalls() == []
