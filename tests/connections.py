"""atop's connection without a socket: a protocol on a StringTransport, its turns, its replies split."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from atopgpud_tw import codec
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.protocol import AtopGpuFactory


def connect(board: Board | None = None, factory: AtopGpuFactory | None = None):
    """A protocol on a StringTransport, of `factory` or of a new one over `board`
    whose clock is a task.Clock."""
    factory = factory or AtopGpuFactory(board or Board(), clock=Clock())
    protocol = factory.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


def turns(protocol) -> None:
    """Let the factory's clock run the turns in which queued requests are answered.

    At most 1000 turns; once no call is due now, the rest would run nothing.
    """
    clock = protocol.factory.clock
    for _ in range(1000):
        if not any(call.getTime() <= clock.seconds() for call in clock.getDelayedCalls()):
            return
        clock.advance(0)


def replies(data: bytes) -> list[tuple[int, bytes]]:
    """Split written bytes into (version, body) replies; nothing may be left over."""
    out = []
    at = 0  # an offset, not a shrinking copy: 40,000 replies are split in linear time
    while at < len(data):
        version, length = codec.parse_prelude(data[at : at + 4])
        out.append((version, data[at + 4 : at + 4 + length]))
        assert len(data) - at >= 4 + length
        at += 4 + length
    return out
