"""The connection on a StringTransport: framing, ordering, bad input, exits per client."""

from __future__ import annotations

from connections import connect, replies, turns
from snapshots import dev, proc, snap
from twisted.internet.task import Clock

from atopgpud_tw import codec
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory


def board_with_one_gpu() -> Board:
    board = Board()
    board.fold(snap(dev("a", busid="00000000:17:00.0", name="GPU A", processes=(proc(7, gpu=30),))))
    return board


def test_types_reply_is_byte_exact():
    """T answered in the version asked, with the prelude."""
    protocol, transport = connect(board_with_one_gpu())
    protocol.dataReceived(b"T\x01")
    assert transport.value() == codec.frame(1, b"1@00000000:17:00.0 GPU_A 3")


def test_stats_reply_is_byte_exact():
    """S v2 after one poll."""
    protocol, transport = connect(board_with_one_gpu())
    protocol.dataReceived(b"S\x02")
    assert transport.value() == codec.frame(
        2, b"@40 10 16777216 2097152 1 40 10 2097152#A 7 C 30 5 1024 1024 1"
    )


def test_request_split_byte_by_byte_is_answered():
    """A request arriving one byte at a time is answered once complete."""
    protocol, transport = connect(board_with_one_gpu())
    protocol.dataReceived(b"S")
    assert transport.value() == b""
    protocol.dataReceived(b"\x02")
    assert [v for v, _ in replies(transport.value())] == [2]


def test_pipelined_requests_are_answered_in_order():
    """Several requests in one read, and one straddling two reads, all answered in order."""
    protocol, transport = connect(board_with_one_gpu())
    protocol.dataReceived(b"T\x01S\x02S")
    protocol.dataReceived(b"\x00T\x02")
    turns(protocol)
    got = replies(transport.value())
    assert [v for v, _ in got] == [1, 2, 2, 2]
    assert got[0][1].startswith(b"1@") and got[3][1].startswith(b"1@")
    assert got[1][1].startswith(b"@") and got[2][1].startswith(b"@")
    assert not transport.disconnecting


def test_unknown_command_closes_only_that_connection():
    """A bad command: earlier replies are written, then the connection closes."""
    board = board_with_one_gpu()
    bad, bad_transport = connect(board)
    good, good_transport = connect(board)
    bad.dataReceived(b"T\x02X\x02S\x02")
    turns(bad)
    assert bad_transport.disconnecting
    assert len(replies(bad_transport.value())) == 1
    good.dataReceived(b"S\x02")
    assert not good_transport.disconnecting and len(replies(good_transport.value())) == 1


def test_connection_lost_detaches_the_client():
    """A closed connection no longer collects exited processes."""
    board = board_with_one_gpu()
    protocol, _ = connect(board)
    assert len(board.clients) == 1
    protocol.connectionLost(None)
    assert board.clients == set()


def test_each_client_gets_each_exit_once():
    """Two clients each see an exited process once, in their next S."""
    board = board_with_one_gpu()
    (p1, t1), (p2, t2) = connect(board), connect(board)
    for p in (p1, p2):
        p.dataReceived(b"S\x02")
    board.fold(snap(dev("a", busid="00000000:17:00.0", name="GPU A", processes=())))
    for p, t in ((p1, t1), (p2, t2)):
        t.clear()
        p.dataReceived(b"S\x02S\x02")
        turns(p)
        first, second = replies(t.value())
        assert b"#E 7 C 30 5 1024 1024 1" in first[1]
        assert b"#E" not in second[1]


def test_a_flooding_client_gets_one_reply_per_turn():
    """A client that sends many requests at once cannot get two replies before another's one."""
    board = board_with_one_gpu()
    factory = AtopGpuFactory(board, clock=Clock())
    (flood, flood_transport), (other, other_transport) = connect(board, factory), connect(board, factory)
    written: list[str] = []
    flood_transport.write = lambda data: written.append("flood")  # type: ignore[method-assign]
    other_transport.write = lambda data: written.append("other")  # type: ignore[method-assign]
    flood.dataReceived(b"S\x01" * 500)
    other.dataReceived(b"S\x01")
    other.dataReceived(b"S\x02S\x02")
    turns(flood)
    assert written[:2] == ["flood", "other"]
    assert written.count("flood") == 500 and written.count("other") == 3
    assert written.index("other", 2) < written.index("flood", 2) + 2, "one reply each per turn"


def test_a_client_far_ahead_of_its_turns_is_read_no_more_until_served():
    """Requests pile up to a bound; reading stops, then resumes once they are answered."""
    board = board_with_one_gpu()
    protocol, transport = connect(board)
    protocol.dataReceived(b"S\x02" * 40_000)
    assert transport.producerState == "paused"
    turns(protocol)
    assert transport.producerState == "producing"
    assert len(replies(transport.value())) == 40_000


def test_a_queued_request_whose_answer_fails_is_logged_and_closes_its_connection(logged):
    """An error answering a request served in its turn is said, and that connection closed; others go on."""
    board = board_with_one_gpu()
    factory = AtopGpuFactory(board, clock=Clock())
    (broken, broken_transport), (other, other_transport) = connect(board, factory), connect(board, factory)
    answer = board.reply
    asked = [0]

    def reply(request, queue):
        asked[0] += 1
        if asked[0] == 2:  # the first queued one
            raise RuntimeError("a bug")
        return answer(request, queue)

    board.reply = reply  # type: ignore[method-assign]
    broken.dataReceived(b"S\x02S\x02S\x02")
    turns(broken)
    assert broken_transport.disconnecting
    assert len(replies(broken_transport.value())) == 1
    said = [event for event in logged.events if "a queued request failed" in event.get("log_format", "")]
    assert len(said) == 1 and said[0]["log_failure"].check(RuntimeError), list(logged)
    other.dataReceived(b"S\x02S\x02")
    turns(other)
    assert len(replies(other_transport.value())) == 2 and not other_transport.disconnecting
