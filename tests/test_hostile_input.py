"""Property-based: any byte stream, split anywhere, is handled without harm."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from snapshots import dev, proc, snap
from test_protocol import connect, replies, turns

from atopgpud_tw import codec
from atopgpud_tw.board import Board

VALID = [b"T\x00", b"T\x01", b"T\x02", b"S\x00", b"S\x01", b"S\x02", b"S\x07"]


def busy_board() -> Board:
    board = Board()
    devices = [dev(f"g{g}", processes=tuple(proc(1000 * g + p, memory=p * 999) for p in range(40))) for g in range(8)]
    board.fold(snap(*devices))
    return board


def expected_replies(stream: bytes) -> int:
    """How many requests come before the first invalid one."""
    count = 0
    for i in range(0, len(stream) - len(stream) % 2, 2):
        if stream[i] not in b"TS":
            break
        count += 1
    return count


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


streams = st.one_of(
    st.binary(max_size=64),
    st.lists(st.sampled_from(VALID), max_size=20).map(b"".join),
    st.tuples(st.lists(st.sampled_from(VALID), max_size=8), st.binary(max_size=8)).map(
        lambda t: b"".join(t[0]) + t[1]
    ),
)


@settings(max_examples=300, deadline=None)
@given(stream=streams, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_any_stream_in_any_split_is_answered_safely(stream, cuts):
    """Never raises, never over 8192 bytes, answers exactly the valid prefix, others unaffected."""
    board = busy_board()
    protocol, transport = connect(board)
    bystander, bystander_transport = connect(board)
    for chunk in chunks(stream, cuts):
        protocol.dataReceived(chunk)
    turns(protocol)
    got = replies(transport.value())
    assert len(got) == expected_replies(stream)
    for version, body in got:
        assert 4 + len(body) <= codec.ATOP_REPLY_LIMIT
        assert version in (1, 2)
    invalid = len(got) < len(stream) // 2
    assert transport.disconnecting == invalid
    bystander.dataReceived(b"S\x02")
    ((version, body),) = replies(bystander_transport.value())
    assert len(codec.parse_stats(body, version)) == 8 and not bystander_transport.disconnecting


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=2, max_size=2))
def test_request_parser_accepts_exactly_t_and_s(data):
    """parse_request raises ProtocolError for everything but T and S."""
    try:
        request = codec.parse_request(data)
    except codec.ProtocolError:
        assert data[:1] not in (b"T", b"S")
    else:
        assert data[:1] in (b"T", b"S") and request.version == data[1]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([1, 2]))
def test_reply_parsers_never_raise_anything_but_protocol_error(body, version):
    """A client never trusts a reply: garbage gives ProtocolError, nothing else."""
    for parse in (codec.parse_types, lambda b: codec.parse_stats(b, version)):
        try:
            parse(body)
        except codec.ProtocolError:
            pass
