"""The connection: cut two-byte requests from the stream and write their replies.

Requests may arrive split over reads or several in one read; each is answered in
order.  An unknown command closes that connection only (after the replies
already written), with one log line.  The protocol never calls a reader: it
serves what the `Board` holds.
"""

from __future__ import annotations

from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from atopgpud_tw import codec
from atopgpud_tw.board import Board, ClientQueue


class AtopGpuProtocol(Protocol):
    """One client connection (atop keeps one open and asks every interval)."""

    log = Logger()
    factory: "AtopGpuFactory"

    def __init__(self) -> None:
        self._buffer = b""
        self._closing = False
        self.queue: ClientQueue | None = None

    def connectionMade(self) -> None:
        self.queue = self.factory.board.attach()

    def connectionLost(self, reason: object = None) -> None:
        if self.queue is not None:
            self.factory.board.detach(self.queue)
            self.queue = None

    def dataReceived(self, data: bytes) -> None:
        """Answer every complete request in the stream; keep a partial one."""
        if self._closing:
            return
        buffer = self._buffer + data
        size = codec.REQUEST_SIZE
        end = len(buffer) - len(buffer) % size
        replies = []
        for start in range(0, end, size):
            try:
                request = codec.parse_request(buffer[start : start + size])
            except codec.ProtocolError as error:
                self.log.warn("closing connection from {peer}: {error}", peer=self._peer(), error=str(error))
                self._buffer = b""
                self._closing = True
                self._write(replies)
                self.transport.loseConnection()
                return
            replies.append(self.factory.board.reply(request, self.queue))
        self._buffer = buffer[end:]
        self._write(replies)

    def _write(self, replies: list[bytes]) -> None:
        if replies:
            self.transport.writeSequence(replies)

    def _peer(self) -> str:
        peer = self.transport.getPeer()
        return str(getattr(peer, "host", None) or getattr(peer, "name", None) or peer)


class AtopGpuFactory(Factory):
    """Makes a protocol per connection, all serving one Board."""

    protocol = AtopGpuProtocol
    noisy = False

    def __init__(self, board: Board) -> None:
        self.board = board
