"""Requests by a table, and version 1 clients as sessions of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from connections import connect, replies, turns
from snapshots import dev, proc, snap

import atopgpud_tw.server.atop as atop_wing
from atopgpud_tw import codec
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.clients import V1Session

WING = Path(atop_wing.__file__).parent


def test_every_request_command_of_the_wire_has_a_handler():
    """Each command the wire accepts is answered by a handler of its own, and no handler answers another."""
    assert set(Board.HANDLERS) == set(codec.COMMANDS)
    for command in codec.COMMANDS:
        request = codec.parse_request(bytes([command, 2]))
        assert Board.HANDLERS[request.command] is not Board.HANDLERS[
            next(other for other in codec.COMMANDS if other != command)
        ]


def test_each_handler_gives_its_own_reply():
    """T gives the types, S the statistics: by the table, byte for byte what they gave before."""
    board = Board()
    board.fold(snap(dev("a", processes=(proc(7),))))
    queue = board.attach()
    types = board.reply(codec.Request(codec.COMMAND_TYPES, 2), queue)
    stats = board.reply(codec.Request(codec.COMMAND_STATS, 2), queue)
    assert len(codec.parse_types(types[4:])) == 1
    (device,) = codec.parse_stats(stats[4:], 2)
    assert [p.pid for p in device.processes] == [7]
    assert types != stats


def test_a_command_without_a_handler_never_gets_statistics():
    """A request the wire would pass but no handler answers is an error, not an S reply."""
    board = Board()
    board.fold(snap(dev("a")))
    with pytest.raises(codec.ProtocolError, match="0x58"):
        board.reply(codec.Request(ord("X"), 2), board.attach())


def test_a_command_without_a_handler_closes_the_connection(monkeypatch):
    """Through the protocol: replies before it are written, then the connection closes, nothing for it."""
    board = Board()
    board.fold(snap(dev("a")))
    real = codec.parse_request
    monkeypatch.setattr(
        codec, "parse_request", lambda data: codec.Request(ord("X"), 2) if data[:1] == b"X" else real(data)
    )
    protocol, transport = connect(board)
    protocol.dataReceived(b"S\x02X\x02S\x02")
    turns(protocol)
    assert transport.disconnecting
    assert len(replies(transport.value())) == 1


def test_a_version_1_session_begins_with_its_first_request_and_ends_with_its_client():
    """Only a client that asks version 1 has a session; it goes when the client does."""
    board = Board()
    board.fold(snap(dev("a", processes=(proc(7, gpu=40),))))
    v2, v1 = board.attach(), board.attach()
    board.reply(codec.Request(codec.COMMAND_STATS, 2), v2)
    board.reply(codec.Request(codec.COMMAND_STATS, 1), v1)
    assert set(board.v1_sessions) == {v1}
    session = board.v1_sessions[v1]
    assert isinstance(session, V1Session) and session.seen and session.generation == board.counters.generation
    board.detach(v1)
    assert not board.v1_sessions


def _imports(path: Path) -> set[str]:
    """Every module a file imports, TYPE_CHECKING blocks included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_wing_that_serves_atop_has_no_import_circle():
    """board, exits, intervals, render, protocol, turns, poller import one another one way only."""
    names = {path.stem for path in WING.glob("*.py") if path.stem != "__init__"}
    graph = {
        name: {m.rsplit(".", 1)[1] for m in _imports(WING / f"{name}.py") if m.startswith("atopgpud_tw.server.atop.")}
        & names
        for name in names
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for step in graph[start] - seen:
            if step == goal or reaches(step, goal, seen | {step}):
                return True
        return False

    circles = sorted(name for name in names if reaches(name, name, set()))
    assert not circles, f"import circles through {circles}"
