"""The wire format's framing: requests, the reply prelude, atop's limits.

Request: two bytes, a command (``T`` GPU types, ``S`` statistics) and an API version;
version 0, or one above `NEWEST_VERSION`, means the newest.

Reply: a four-byte big-endian prelude ``version << 24 | length`` and ``length`` bytes
of ASCII.  atop rejects a reply whose body is longer than 8192 bytes; this codec keeps
the whole reply, prelude included, within `REPLY_LIMIT`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PRELUDE = struct.Struct(">I")
REQUEST_SIZE = 2
NEWEST_VERSION = 2
VERSIONS = (1, 2)
COMMAND_TYPES = ord("T")
COMMAND_STATS = ord("S")
#: ``atopgpu``'s own: who the processes are (contexts.py); atop never sends it
COMMAND_CONTEXTS = ord("P")
#: every request command: what `parse_request` accepts, and what a daemon must answer
COMMANDS = (COMMAND_TYPES, COMMAND_STATS, COMMAND_CONTEXTS)
#: atop's hard limit on a reply body
ATOP_REPLY_LIMIT = 8192
#: what this daemon allows a whole reply, prelude included: no reading of atop's limit is exceeded
REPLY_LIMIT = ATOP_REPLY_LIMIT
#: atop keeps at most this many process entries per GPU (an unsigned char)
MAX_PROCESSES_PER_DEVICE = 255
#: atop keeps at most this many GPUs: ``MAXGPU`` in atop's photosyst.h (line 38 in
#: 2.13.0; 32 in every version).  Given a ``T`` of more, atop's gputype_parse
#: (gpucom.c) fails and atop shows no GPU at all, so no reply to atop carries more
ATOP_MAX_GPUS = 32
#: atop keeps the last characters of a bus id and of a type name
ATOP_ID_CHARS = 12
#: a longer name or bus id keeps its last this many characters on the wire: ``T`` fits whatever it is
MAX_TOKEN_CHARS = 64
#: atop reads ``%d`` and ``%lld`` numbers: nothing on the wire goes beyond these
INT_MAX = 2**31 - 1
LLONG_MAX = 2**63 - 1
#: the longest device record: ``@`` and eight numbers of up to 20 characters
_LONGEST_DEVICE_RECORD = 1 + 8 * 20 + 7
#: devices on the wire at most: this many device records (and ``T`` entries) fit in one reply
MAX_WIRE_DEVICES = (REPLY_LIMIT - PRELUDE.size) // _LONGEST_DEVICE_RECORD
#: a version byte atop never sends: ``atopgpu`` asks with it for version 2 replies of up to
#: `MAX_WIRE_DEVICES` devices (a daemon that does not know it answers it as the newest version)
WIDE_REQUEST = 0x80 | 2


def wire_devices(asked: int) -> int:
    """How many devices (the first, in ``T`` order) a reply to the version byte `asked` carries."""
    return MAX_WIRE_DEVICES if asked == WIDE_REQUEST else ATOP_MAX_GPUS

#: a byte as it may stand in a token: printable ASCII but for the separators, else ``_``
_SAFE = bytes(c if 0x21 <= c <= 0x7E and c not in b"@#" else ord("_") for c in range(256))


class ProtocolError(ValueError):
    """A request or reply that breaks the wire format."""


@dataclass(frozen=True, slots=True)
class Request:
    command: int
    version: int

    @property
    def reply_version(self) -> int:
        """The version the reply is rendered in and stamped with."""
        return negotiate(self.version)

    @property
    def devices(self) -> int:
        """How many devices, at most, its reply carries (`wire_devices`)."""
        return wire_devices(self.version)


def negotiate(version: int) -> int:
    """The reply version for a requested one: 0 and unknown ones mean the newest."""
    return version if version in VERSIONS else NEWEST_VERSION


#: every valid request parsed so far (a few of the 768 there are), parsed once: one per reply
_REQUESTS: dict[bytes, Request] = {}


def parse_request(data: bytes) -> Request:
    """Two bytes to a `Request`; anything but ``T``, ``S`` or ``P`` is a `ProtocolError`."""
    known = _REQUESTS.get(data) if type(data) is bytes else None
    if known is not None:
        return known
    if len(data) != REQUEST_SIZE:
        raise ProtocolError(f"a request is {REQUEST_SIZE} bytes, got {len(data)}")
    command, version = data[0], data[1]
    if command not in COMMANDS:
        raise ProtocolError(f"unknown command byte 0x{command:02x}")
    request = Request(command, version)
    if type(data) is bytes:
        _REQUESTS[data] = request  # a valid request: at most 3 x 256 of them
    return request


def encode_request(command: str, version: int) -> bytes:
    """The two request bytes for a command letter and version (clients, tests)."""
    return command.encode("ascii") + bytes([version])


def frame(version: int, body: bytes) -> bytes:
    """Prefix a body with its prelude."""
    if len(body) > 0xFFFFFF:
        raise ProtocolError("reply body too long for the prelude")
    return PRELUDE.pack(version << 24 | len(body)) + body


def parse_prelude(prelude: bytes) -> tuple[int, int]:
    """The (version, length) of a reply's first four bytes."""
    if len(prelude) != PRELUDE.size:
        raise ProtocolError(f"a prelude is {PRELUDE.size} bytes, got {len(prelude)}")
    (word,) = PRELUDE.unpack(prelude)
    return word >> 24, word & 0xFFFFFF


def wire_token(text: str) -> bytes:
    """A name or bus id as one ``T`` token: printable ASCII without ``@`` or ``#``, every other character
    one ``_``, an empty text ``_``; of a longer text the last `MAX_TOKEN_CHARS` (atop shows the last)."""
    # a character beyond ASCII becomes 0x80 first, which the table turns into "_"
    raw = bytes(min(ord(c), 0x80) for c in text[-MAX_TOKEN_CHARS:]) or b"_"
    return raw.translate(_SAFE)
